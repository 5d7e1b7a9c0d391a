"""The unified iteration run eagerly on the CPU (the same code a CUDA graph captures) against the
slow reference model: decode spans and whole prompts in one flat batch while requests join and
leave and the padding changes, padding that never changes a real request's result, an empty
iteration, and parts or spans the engine cannot run refused before anything runs."""

from __future__ import annotations

import pytest
import torch

from graphrelay.capture.iteration.inputs import IterationInputs
from graphrelay.capture.iteration.spans import decode_span, prefill_span
from graphrelay.capture.iteration.step import IterationStep
from graphrelay.capture.model.model import LlamaModel
from model_reference import reference_logits
from capture_cases import GREEDY, MODEL, Driver, build_stack, composition_schedule
from graphrelay import Relay, RelayConfig
from graphrelay.mirror import HostMirror

MAX_REQS, MAX_BATCH, MAX_TOKENS = 10, 8, 128
STEPS = 14
# Step and reference sum in different orders; their logits agree to ~1e-6, so a greedy pick
# may only differ from the reference's where its top two logits are closer than this.
TIE = 1e-4


def check_against_reference(driver: Driver, seqs: dict[int, list[int]], iteration: int) -> int:
    """Every token the iteration reported against `reference_logits` of its sequence (decode
    rows and the first token of each joining prompt alike), then extend the sequences.
    Returns the rows reported."""
    read = driver.read(iteration)
    step = driver.stack.step
    for slot, token, seq_len in zip(read.slots.tolist(), read.tokens.tolist(), read.seq_lens.tolist()):
        seq = seqs[slot]
        where = f"iteration {iteration}, slot {slot} ({len(seq)} tokens)"
        # The iteration consumed seq[-1] at position len(seq) - 1 and cached it.
        assert seq_len == len(seq), f"{where}: new seq len {seq_len}, expected {len(seq)}"
        row = int((step.inputs.buffers.span_slot == slot).nonzero()[0])  # request-major rows, one per span
        ref = reference_logits(driver.stack.model, seq)  # [vocab]
        got = step.logits[row]
        assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), \
            f"{where}: logits differ from the reference by {(got - ref).abs().max():.2e}"
        top2 = ref.topk(2).values
        if token != int(ref.argmax()):
            assert float(top2[0] - top2[1]) < TIE and float(ref[token]) >= float(top2[1]), \
                f"{where}: sampled {token}, reference argmax {int(ref.argmax())}"
        seq.append(token)
    return len(read)


@pytest.mark.parametrize("buckets", [None, [MAX_TOKENS]], ids=["default-buckets", "one-bucket"])
def test_mixed_iterations_agree_with_reference(buckets):
    """Requests join (their prompt prefilled in the same iteration as the running decodes)
    and leave every step; iterations are padded to token buckets. If this failed, the
    iteration an engine captures would emit wrong tokens before any graph is involved."""
    stack = build_stack("cpu", max_reqs=MAX_REQS, max_batch=MAX_BATCH, max_tokens=MAX_TOKENS, buckets=buckets)
    driver = Driver(stack)
    seqs: dict[int, list[int]] = {}
    mixed = 0
    for plan in composition_schedule(STEPS, MAX_REQS, MAX_BATCH, seed=3, sampled=False):
        for slot in plan.leave:
            driver.leave(slot)
            del seqs[slot]
        for slot, prompt, params in plan.join:
            driver.join(slot, prompt, params)
            seqs[slot] = list(prompt)
        driver.launch(plan.batch)
        mixed += bool(plan.batch and plan.join)
        reported = check_against_reference(driver, seqs, driver.iteration - 1)
        assert reported == len(plan.batch) + len(plan.join)
    assert mixed >= 3, "the schedule must mix prompts and decodes in one iteration"


def test_padding_amount_does_not_change_tokens():
    """The same iterations with little padding (dense buckets) and heavy padding (one bucket)
    give the same tokens and seq lens. If this failed, a request's output would depend on how
    many other tokens happen to share its iteration."""
    exact = Driver(build_stack("cpu", max_reqs=MAX_REQS, max_batch=MAX_BATCH, max_tokens=MAX_TOKENS))
    padded = Driver(build_stack("cpu", max_reqs=MAX_REQS, max_batch=MAX_BATCH, max_tokens=MAX_TOKENS,
                                buckets=[MAX_TOKENS]))
    for plan in composition_schedule(STEPS, MAX_REQS, MAX_BATCH, seed=5, sampled=True):
        sizes = [d.apply(plan) for d in (exact, padded)]
        assert sizes[1] == MAX_TOKENS and sizes[0] <= MAX_TOKENS
        a, b = (d.read(d.iteration - 1) for d in (exact, padded))
        for name in ("slots", "tokens", "seq_lens", "generation"):
            assert torch.equal(getattr(a, name), getattr(b, name)), \
                f"iteration {a.iteration}: {name} {getattr(a, name).tolist()} vs {getattr(b, name).tolist()}"
    rows = slice(1, None)  # request rows; row 0 is the padding row
    for name in exact.stack.relay.buffers:
        assert torch.equal(exact.stack.relay.buffers[name][rows], padded.stack.relay.buffers[name][rows]), name


def test_empty_iteration_is_a_bucket_of_padding():
    """An iteration with no spans runs the smallest bucket of padding and changes no request
    row. If this failed, an idle iteration would corrupt a paused request's state."""
    stack = build_stack("cpu", max_reqs=MAX_REQS, max_batch=MAX_BATCH, max_tokens=MAX_TOKENS)
    driver = Driver(stack)
    driver.join(3, [5, 6, 7])
    driver.launch([])
    before = {name: t.clone() for name, t in stack.relay.buffers.items()}
    kv_before = stack.model.kv_cache.keys[0][1:].clone()
    assert driver.launch([]) == 1
    assert len(driver.read(1)) == 0
    for name, t in stack.relay.buffers.items():
        assert torch.equal(t, before[name]), f"relay.{name} changed on an empty iteration"
    assert torch.equal(stack.model.kv_cache.keys[0][1:], kv_before), "an empty iteration wrote a request's KV rows"


def test_chunks_that_do_not_end_their_prompt_report_nothing():
    """A prompt split over three iterations reports only the last chunk's token, which then
    equals the token the whole prompt gives in one iteration."""
    prompt = list(range(3, 30))
    whole = Driver(build_stack("cpu", max_reqs=4, max_batch=4, max_tokens=32))
    whole.join(2, prompt)
    whole.launch([])
    chunked = build_stack("cpu", max_reqs=4, max_batch=4, max_tokens=32)
    engine = chunked.engine
    chunks = [(prompt[:10], 0, False), (prompt[10:20], 10, False), (prompt[20:], 20, True)]
    for tokens, start, last in chunks:
        engine.launch([prefill_span(2, GREEDY, tokens, start, last)])
    reads = [engine.read(i, block=True) for i in range(3)]
    assert [len(r) for r in reads] == [0, 0, 1]
    assert reads[2].tokens.tolist() == whole.read(0).tokens.tolist()
    assert reads[2].seq_lens.tolist() == [len(prompt)]


@pytest.mark.parametrize("spans, match", [
    ([decode_span(0, GREEDY)], "slot must be an int in 1..4"),
    ([decode_span(1, GREEDY), decode_span(5, GREEDY)], r"slot must be an int in 1..4 \(0 is padding\), got 5"),
    ([decode_span(2, GREEDY), decode_span("3", GREEDY)], r"slot must be an int in 1..4 \(0 is padding\), got '3'"),
    ([decode_span(2, GREEDY), decode_span(1.0, GREEDY)], r"got 1\.0"),
    ([decode_span(1, GREEDY), decode_span(1, GREEDY)], "one span per slot"),
    ([prefill_span(1, GREEDY, list(range(1, 40)), 0, True)], "exceeds max_tokens 32"),
    ([prefill_span(1, GREEDY, [1, 2], MODEL.max_seq_len - 1, True)], "exceeds max_seq_len"),
    ([], "1..4 spans"),
])
def test_engine_refuses_iterations_it_cannot_run(spans, match):
    """Bad spans are refused before anything is queued: no iteration is numbered, no slot
    admitted."""
    engine = build_stack("cpu", max_reqs=4, max_batch=4, max_tokens=32).engine
    generations = engine.relay.host_generation.clone()
    with pytest.raises(ValueError, match=match):
        engine.launch(spans)
    assert engine.iterations_launched == 0 and torch.equal(engine.relay.host_generation, generations)


def test_step_rejects_mismatched_parts():
    """IterationStep refuses parts sized for different engines. If this failed, a mismatch
    would surface as an out-of-bounds index inside a captured graph instead of a clear error."""
    relay = Relay(RelayConfig.plain(4, 4), "cpu", validate=False)
    mirror = HostMirror(relay, validate=False)
    with pytest.raises(ValueError, match="sampled rows"):
        IterationStep(relay, LlamaModel(MODEL, 4, "cpu"), mirror, IterationInputs(16, 8, 1, "cpu"))
    with pytest.raises(ValueError, match="max_reqs"):
        IterationStep(relay, LlamaModel(MODEL, 5, "cpu"), mirror, IterationInputs(4, 4, 1, "cpu"))
    with pytest.raises(ValueError, match="rows_per_span"):
        IterationStep(relay, LlamaModel(MODEL, 4, "cpu"), mirror, IterationInputs(4, 4, 2, "cpu"))
