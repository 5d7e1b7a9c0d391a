"""The sampling controls on a GPU: the Triton kernels equal the torch reference at a real
vocabulary size, and an engine whose captured graphs apply every control produces exactly what
the same engine run eagerly produces, plain and speculative, with no host sync in the loop,
through batches that switch between the plain and the controls graph of each bucket."""

from __future__ import annotations

import json

import pytest
import torch

from graphrelay.capture.iteration.controls.grammar import GrammarCompiler, made_up_token_strings, vocabulary
from graphrelay.capture.iteration.controls.logprobs import LogprobChannel
from graphrelay.capture.iteration.controls.params import ControlParams
from graphrelay.capture.iteration.controls.state import ControlsConfig, SamplingControls
from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.iteration.ngram import SpecConfig
from graphrelay.capture.model.model import ModelConfig
from graphrelay.capture.serving.loop import ServingLoop
from graphrelay.capture.serving.workloads import SyntheticWorkload
from graphrelay.capture.iteration.step import CONTROLS, PLAIN
from graphrelay.capture.serving.sync_count import HostSyncCounter
from controls_cases import (EOS, REGEX, SCHEMA, STRINGS, VARIANTS, assert_same_logprobs, msgspec_replace, record_variants,
                            run_schedule)

pytestmark = pytest.mark.gpu

MODEL = ModelConfig.preset("tiny")


def loaded_controls(backend: str, vocab: int = 49152, rows: int = 64) -> SamplingControls:
    torch.manual_seed(0)
    c = SamplingControls(ControlsConfig(backend=backend), max_reqs=rows, vocab_size=vocab, max_rows=rows, device="cuda")
    for slot in range(1, rows + 1):
        c.admit(slot, ControlParams(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2, min_tokens=4,
                                    logit_bias={slot: 5.0, vocab - slot: -5.0}), (7, 9), list(range(slot, slot + 40)))
    slots = torch.arange(1, rows + 1, device="cuda")
    for _ in range(30):
        c.observe(slots, torch.randint(0, vocab, (rows,), device="cuda"), c.row_states(slots))
    c.grammar.allowed[1:3] = torch.randint(-(2**31), 2**31 - 1, (2, c.grammar.allowed.shape[1]), dtype=torch.int32)
    c.slot_state[1 : rows + 1 : 2] = 1
    return c


def test_triton_apply_equals_torch_at_a_real_vocabulary():
    rows, vocab = 64, 49152
    logits = torch.randn(rows, vocab, device="cuda") * 4
    slots = torch.arange(1, rows + 1, device="cuda")
    steps = torch.arange(rows, device="cuda") + 38
    results = {}
    for backend in ("torch", "triton"):
        c = loaded_controls(backend)
        results[backend] = c.apply(logits, slots, steps, c.row_states(slots)).clone()
    torch.testing.assert_close(results["triton"], results["torch"])
    assert torch.isinf(results["torch"]).any()


def test_triton_logprobs_equal_torch_at_a_real_vocabulary_captured_with_no_host_sync():
    """The channel's two launches against the torch reference at SmolLM2's vocabulary (a row of
    many ties, a row with -inf logits), eagerly and replayed from a graph at later iterations."""
    rows, vocab, depth = 64, 49152, 3
    torch.manual_seed(0)

    def step_logits():
        logits = torch.randn(rows, vocab, device="cuda") * 4
        logits[1] = logits[1].round()
        logits[2, ::3] = float("-inf")
        return logits

    logits, tokens = step_logits(), torch.randint(0, vocab, (rows,), device="cuda")
    row_slots = torch.arange(rows, device="cuda", dtype=torch.int32)
    iteration = torch.zeros(1, dtype=torch.int64, device="cuda")
    triton_channel, torch_channel = (LogprobChannel(rows, depth, torch.device("cuda"), vocab, b) for b in ("triton", "torch"))
    for c in (triton_channel, torch_channel):  # eager (and the kernels' compile, before capture)
        c.write(row_slots, logits, tokens, iteration)
    torch.cuda.synchronize()
    assert_same_logprobs(logits, triton_channel, torch_channel, 0)
    graph = torch.cuda.CUDAGraph()
    # A host sync inside the capture would fail it (global capture mode); the replays are counted.
    with torch.cuda.graph(graph, capture_error_mode="global"):
        triton_channel.write(row_slots, logits, tokens, iteration)
    for step in (1, 2, 3):
        logits.copy_(step_logits())
        tokens.random_(0, vocab)
        iteration.fill_(step)
        with HostSyncCounter(True) as syncs:
            graph.replay()
        assert syncs.count == 0, f"the replay made {syncs.count} host syncs"
        torch_channel.write(row_slots, logits, tokens, iteration)
        torch.cuda.synchronize()
        assert int(triton_channel.host["stamps"][step % depth]) == step
        assert_same_logprobs(logits, triton_channel, torch_channel, step % depth)


def requests(spec: bool):
    controls = [dict(frequency_penalty=0.4, logprobs=3), dict(repetition_penalty=1.3, logit_bias={5: 3.0}),
                dict(min_tokens=6), dict(regex=REGEX), dict(json_schema=json.dumps(SCHEMA)), {}]
    base = SyntheticWorkload(num_requests=12, prompt_len=(4, 12), output_len=(24, 40), vocab_size=6 if spec else 512,
                             seed=9).requests()
    return [msgspec_replace(r, stop_tokens=(EOS,), sampling=SamplingParams(temperature=0.8 * (i % 2), seed=i),
                            controls=ControlParams(**controls[i % len(controls)]) if controls[i % len(controls)] else None)
            for i, r in enumerate(base)]


def make_engine(use_graphs: bool, spec: bool, max_tokens: int = 32) -> Engine:
    engine = Engine(EngineConfig(MODEL, max_reqs=8, max_batch=4, device="cuda", use_graphs=use_graphs,
                                 max_tokens=max_tokens, buckets=(max_tokens,), spec=SpecConfig(k=3) if spec else None,
                                 controls=ControlsConfig(grammar_states=512)))
    engine.controls.set_compiler(GrammarCompiler(vocabulary(STRINGS, EOS), MODEL.vocab_size))
    report = engine.capture()
    if use_graphs:
        # Both variants captured for every bucket, the plain one without the controls' nodes.
        nodes = report.variant_nodes
        assert set(nodes) == {PLAIN, CONTROLS} and set(nodes[PLAIN]) == set(nodes[CONTROLS]) == {max_tokens}
        assert nodes[PLAIN][max_tokens] < nodes[CONTROLS][max_tokens] == report.nodes[max_tokens]
    return engine


def run(use_graphs: bool, spec: bool):
    engine = make_engine(use_graphs, spec)
    ran = record_variants(engine) if not use_graphs else None
    result = ServingLoop(engine, "overlap" if use_graphs else "eager").run(requests(spec))
    if ran is not None:  # the eager twin runs the same schedule of variants through the step
        assert {PLAIN, CONTROLS} <= set(ran), f"the workload must switch variants: {ran}"
    return result


@pytest.mark.parametrize("spec", [False, True])
def test_captured_controls_equal_eager_with_no_host_sync(spec):
    """Controlled and uncontrolled requests, so batches replay both graphs of the bucket."""
    graphs, eager = run(True, spec), run(False, spec)
    assert graphs.stats.graphs and graphs.stats.host_syncs == 0
    for rid, out in eager.outputs.items():
        assert graphs.outputs[rid].tokens == out.tokens, rid
        if out.logprobs is not None:
            got = graphs.outputs[rid].logprobs
            assert [[t for t, _ in lp.top] for lp in got] == [[t for t, _ in lp.top] for lp in out.logprobs], rid
            assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in out.logprobs], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("spec", [False, True])
def test_an_engine_over_nan_filled_memory_serves_as_eager_does(spec):
    """The allocator hands out memory again as it was: filled with NaN here. Tokens a bucket
    pads with must not pick it up (a NaN row's sampled id once indexed the grammar table out of
    range in warm-up and crashed the engine); the captured run still equals the eager one."""
    junk = torch.full((2**28,), float("nan"), device="cuda")
    del junk  # back to the caching allocator, NaN and all
    graphs = run(True, spec)
    eager = run(False, spec)
    assert graphs.stats.host_syncs == 0
    assert {rid: out.tokens for rid, out in graphs.outputs.items()} == {rid: out.tokens for rid, out in eager.outputs.items()}


@pytest.mark.parametrize("spec", [False, True])
def test_a_schedule_switching_variants_replays_both_graphs_as_eager_runs_them(spec):
    """The schedule whose batches go plain, controlled, plain...: the captured engine replays
    the graph of the variant each batch needs (the runner calls no step: every replay is a
    graph), with no host sync, and every read and logprob equals the eager engine's; plain
    iterations carry no logprobs."""
    graphs = make_engine(True, spec, max_tokens=16)
    stepped = record_variants(graphs)  # after capture: only a run without its graph reaches it
    with HostSyncCounter(True) as syncs:
        got = run_schedule(graphs, lag=2)
    assert syncs.count == 0, f"the replays made {syncs.count} host syncs"
    assert stepped == [], f"iterations ran eagerly instead of replaying their variant's graph: {stepped}"
    eager = make_engine(False, spec, max_tokens=16)
    ran = record_variants(eager)
    want = run_schedule(eager, lag=2)
    assert ran == VARIANTS
    for n, ((slots, tokens, logprobs), (want_slots, want_tokens, want_logprobs)) in enumerate(zip(got, want)):
        assert (slots, tokens) == (want_slots, want_tokens), f"iteration {n}"
        assert (logprobs is None) == (want_logprobs is None) == (VARIANTS[n] == PLAIN), f"iteration {n}"
        if logprobs is not None:  # per row: None where its request did not ask (slot 2 alone asks)
            assert [lp is None for lp in logprobs] == [lp is None for lp in want_logprobs] == [
                s != 2 for s in slots], f"iteration {n}"
            pairs = [(lp, w) for lp, w in zip(logprobs, want_logprobs) if lp is not None]
            assert [lp.top[0][0] for lp, _ in pairs] == [w.top[0][0] for _, w in pairs], f"iteration {n}"
            assert [lp.logprob for lp, _ in pairs] == pytest.approx([w.logprob for _, w in pairs], rel=1e-4,
                                                                    abs=1e-5), f"iteration {n}"


def test_a_speculative_engine_with_grammars_serves_after_an_earlier_engine_at_bench_json_size():
    """`bench json`'s shape without its model file: SmolLM2's architecture (random weights, a
    made-up text vocabulary of its 49,152 tokens), 64 slots, every request constrained, one
    engine without speculation served and dropped, then one with n-gram speculation built,
    captured and served in the same process. On the H200 that second engine once hit an illegal
    memory access in its first warm-up step; every output must match its regex, with no host
    sync."""
    import re

    config = ModelConfig.preset("smollm2-135m")
    strings = made_up_token_strings(config.vocab_size)
    compiler = GrammarCompiler(vocabulary(strings, EOS), config.vocab_size)
    base = SyntheticWorkload(num_requests=24, prompt_len=(16, 64), output_len=(24, 24), vocab_size=config.vocab_size,
                             seed=5).requests()
    requests = [msgspec_replace(r, stop_tokens=(EOS,), sampling=SamplingParams(temperature=0.7 * (i % 2), seed=i),
                                controls=ControlParams(regex=REGEX)) for i, r in enumerate(base)]
    for spec in (None, SpecConfig(k=4)):
        engine = Engine(EngineConfig(config, max_reqs=64, max_batch=64, device="cuda", spec=spec,
                                     controls=ControlsConfig(grammar_states=2048)))
        engine.controls.set_compiler(compiler)
        engine.capture()
        result = ServingLoop(engine, "overlap").run(requests)
        assert result.stats.host_syncs == 0
        finished = [result.outputs[r.id] for r in requests if result.outputs[r.id].finish_reason == "stop"]
        assert len(finished) >= len(requests) // 2, "the regex's matches fit in 24 tokens: most must end"
        for out in finished:
            text = "".join(strings[t] or "" for t in out.tokens if t != EOS)
            assert re.fullmatch(REGEX, text), (spec, text)
        del engine, result


def test_triton_observe_equals_torch_on_cuda_over_verify_spans():
    """64 slots x 5-row verify spans with random accepted prefixes, many repeated tokens: the
    one-launch observe equals the torch reference (programs of one span run concurrently here,
    unlike in the interpreter, so only the span's last emitted row may write its state)."""
    from graphrelay.capture.iteration.controls.observe import observe_torch, observe_triton

    gen = torch.Generator().manual_seed(11)
    vocab, states, spans, per = 49152, 300, 64, 5
    for _ in range(5):
        counts = torch.randint(0, 3, (spans + 1, vocab), generator=gen, dtype=torch.int32)
        next_state = torch.randint(0, states, (states, vocab), generator=gen, dtype=torch.int32)
        slot_state = torch.randint(0, states, (spans + 2,), generator=gen, dtype=torch.int32)
        slots = torch.arange(1, spans + 1, dtype=torch.int32).repeat_interleave(per)
        accepted = torch.randint(1, per + 1, (spans,), generator=gen)
        emitted = (torch.arange(per)[None, :] < accepted[:, None]).reshape(-1)
        tokens = torch.randint(0, 8, (spans * per,), generator=gen)  # few distinct: atomic adds collide
        row_states = torch.randint(0, states, (spans * per,), generator=gen, dtype=torch.int32)
        want = [t.clone() for t in (counts, next_state, slot_state)]
        observe_torch(*want, slots, tokens, row_states, emitted)
        got = [t.cuda() for t in (counts, next_state, slot_state)]
        observe_triton(*got, slots.cuda(), tokens.cuda(), row_states.cuda(), emitted.cuda())
        assert torch.equal(got[0].cpu(), want[0])
        assert torch.equal(got[2].cpu()[: spans + 1], want[2][: spans + 1])
