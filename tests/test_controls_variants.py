"""An engine with controls captures each bucket twice, "plain" (no controls ops) and "controls",
and runs an iteration plain unless one of its slots was admitted with a control in use. Here:
the choice per control, exactness of every control and of the logprobs across batches that
switch variant (reads lagged as the overlap loop lags them, slots reused), and outputs equal to
an engine running every iteration controlled, in every mode and with speculation."""

from __future__ import annotations

import json

import pytest

from graphrelay.capture.iteration.controls.grammar import GrammarCompiler, vocabulary
from graphrelay.capture.iteration.controls.params import ControlParams
from graphrelay.capture.iteration.controls.state import ControlsConfig
from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.iteration.ngram import SpecConfig
from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.iteration.spans import decode_span
from graphrelay.capture.iteration.step import CONTROLS, PLAIN
from graphrelay.capture.model.model import ModelConfig
from graphrelay.capture.serving.loop import ServingLoop
from graphrelay.capture.serving.workloads import SyntheticWorkload
from controls_cases import (EOS, REGEX, SCHEMA, SEEDED, STRINGS, VARIANTS, always_controlled, msgspec_replace,
                           record_variants, run_schedule)

MODEL = ModelConfig.preset("tiny")


def make_engine(controls=True, spec=None, max_reqs=6, max_batch=4, model=MODEL) -> Engine:
    tokens = 8 * (spec.rows if spec else 1)
    engine = Engine(EngineConfig(model, max_reqs=max_reqs, max_batch=max_batch, max_tokens=tokens, buckets=(tokens,),
                                 spec=spec, controls=ControlsConfig(max_bias=4, max_stop=2, grammar_states=512)
                                 if controls else None))
    if controls:
        engine.controls.set_compiler(GrammarCompiler(vocabulary(STRINGS, EOS), MODEL.vocab_size))
    engine.capture()
    return engine


@pytest.mark.parametrize("params, used", [
    (None, False), (ControlParams(frequency_penalty=0, repetition_penalty=1, logit_bias={}, logprobs=None), False),
    (ControlParams(frequency_penalty=0.1), True), (ControlParams(presence_penalty=-0.5), True),
    (ControlParams(repetition_penalty=1.1), True), (ControlParams(logit_bias={3: 1.0}), True),
    (ControlParams(min_tokens=2), True), (ControlParams(logprobs=0), True), (ControlParams(regex=REGEX), True),
    (ControlParams(json_schema=json.dumps(SCHEMA)), True),
])
def test_an_iteration_runs_the_controls_exactly_when_one_of_its_slots_uses_one(params, used):
    """Each control (and logprobs) alone selects the controls variant for any batch holding its
    slot; neutral values, other slots, and the slot re-admitted without controls run plain.
    If this failed, a control would be skipped (wrong outputs) or a batch without any would pay
    for them."""
    engine = make_engine()
    with engine.activate():
        engine.admit_controls(2, params, (EOS,), [1, 2, 3])
        engine.admit_controls(1, None, (EOS,), [4, 5])
        want = CONTROLS if used else PLAIN
        assert engine.variant([decode_span(2, SEEDED)]) == want
        assert engine.variant([decode_span(1, SEEDED), decode_span(2, SEEDED)]) == want
        assert engine.variant([decode_span(1, SEEDED), decode_span(3, SEEDED)]) == PLAIN
        engine.admit_controls(2, None, (EOS,), [1, 2, 3])
        assert engine.variant([decode_span(2, SEEDED)]) == PLAIN
    assert make_engine(controls=False).variant([decode_span(2, SEEDED)]) == PLAIN


@pytest.mark.parametrize("lag", [0, 2])
def test_every_control_and_the_logprobs_stay_exact_across_plain_iterations(lag):
    """The engine's reads equal those of the same engine running every iteration controlled:
    the same tokens everywhere (the penalty's counts, the automaton and min_tokens saw every
    token their slot emitted), logprobs for exactly the controlled iterations and equal there
    (the channel's ring slot and stamp follow the mirror's iteration, so plain iterations that
    skip it do not shift it). If this failed, a plain iteration would desynchronise the
    logprob channel (a read would raise or return another iteration's rows) or corrupt a
    controlled slot's state."""
    engine = make_engine()
    ran = record_variants(engine)
    got = run_schedule(engine, lag)
    want = run_schedule(always_controlled(make_engine()), lag)
    assert ran == VARIANTS
    for n, ((slots, tokens, logprobs), (want_slots, want_tokens, want_logprobs)) in enumerate(zip(got, want)):
        assert (slots, tokens) == (want_slots, want_tokens), f"iteration {n}"
        if VARIANTS[n] == PLAIN:
            assert logprobs is None, f"iteration {n} ran plain: it wrote no logprobs"
        else:
            assert logprobs == want_logprobs, f"iteration {n}"
            # Only slot 2 asked: the engine reports no logprobs for the other rows.
            assert [lp is not None for lp in logprobs] == [s == 2 for s in slots], f"iteration {n}"
    # The schedule proves something: min_tokens held the biased EOS back, then let it out.
    emitted_4 = [t for slots, tokens, _ in got for s, t in zip(slots, tokens) if s == 4]
    assert EOS not in emitted_4[:3] and EOS in emitted_4


REQUEST_CONTROLS = [None, dict(frequency_penalty=0.5, logprobs=2), None, dict(regex=REGEX), None,
                    dict(min_tokens=6, logit_bias={5: 2.0}), None, dict(repetition_penalty=1.4, presence_penalty=0.3)]


def mixed_requests(vocab_size: int = MODEL.vocab_size):
    """Controlled and uncontrolled requests, more than the slots: slots are reused, and batches
    come with and without controlled requests in them."""
    base = SyntheticWorkload(num_requests=len(REQUEST_CONTROLS), prompt_len=(3, 9), output_len=(6, 14),
                             vocab_size=vocab_size, seed=11).requests()
    return [msgspec_replace(r, stop_tokens=(EOS,), sampling=SamplingParams(temperature=0.7 * (i % 3 > 0), seed=i),
                            controls=ControlParams(**c) if c else None)
            for i, (r, c) in enumerate(zip(base, REQUEST_CONTROLS))]


def serve(engine: Engine, requests, mode: str):
    return {rid: (out.tokens, out.finish_reason, out.logprobs)
            for rid, out in ServingLoop(engine, mode).run(requests).outputs.items()}


@pytest.mark.parametrize("mode,dtype", [("overlap", "float32"), ("no-overlap", "float32"), ("eager", "float32"),
                                        ("overlap", "bfloat16")])
def test_served_outputs_equal_always_controlled_and_uncontrolled_ones_equal_no_controls(mode, dtype):
    """Through the serving loop (3 slots for 8 requests, so a slot goes from a controlled
    request to an uncontrolled one and back, starting clean each time), every output equals
    the always-controlled engine's, and uncontrolled requests' equal an engine without
    controls, while both variants run. In bf16 both variants read the LM head's bf16 output as
    float32 values: the plain one samples it, the controls one edits a float32 copy."""
    requests = mixed_requests()
    model = msgspec_replace(MODEL, dtype=dtype)
    engine = make_engine(max_reqs=3, max_batch=2, model=model)
    assert engine.runner.step.logits.dtype == model.torch_dtype  # what both variants read
    ran = record_variants(engine)
    got = serve(engine, requests, mode)
    assert {PLAIN, CONTROLS} <= set(ran), f"both variants must run for this to test anything: {ran}"
    assert got == serve(always_controlled(make_engine(max_reqs=3, max_batch=2, model=model)), requests, "eager")
    bare = serve(make_engine(controls=False, max_reqs=3, max_batch=2, model=model),
                 [r for r in requests if r.controls is None], mode)
    assert {rid: got[rid] for rid in bare} == bare


def test_speculative_outputs_equal_plain_decoding_across_variants():
    """With n-gram speculation both variants verify drafts; a mixed workload over a 6-token
    vocabulary (drafts get accepted) gives what it gives without speculation."""
    requests = mixed_requests(vocab_size=6)
    engine = make_engine(spec=SpecConfig(k=3), max_reqs=3, max_batch=2)
    ran = record_variants(engine)
    result = ServingLoop(engine, "overlap").run(requests)
    spec = {rid: (out.tokens, out.finish_reason, out.logprobs) for rid, out in result.outputs.items()}
    assert {PLAIN, CONTROLS} <= set(ran)
    assert result.stats.tokens_per_request_step > 1.0, "no draft was accepted: the test would prove nothing"
    plain = serve(make_engine(max_reqs=3, max_batch=2), requests, "no-overlap")
    for rid, (tokens, reason, logprobs) in plain.items():
        assert spec[rid][:2] == (tokens, reason), rid
        if logprobs is not None:
            got = spec[rid][2]
            assert [[t for t, _ in lp.top] for lp in got] == [[t for t, _ in lp.top] for lp in logprobs], rid
            assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in logprobs], rel=1e-4, abs=1e-5)
