"""The controls end to end on the tiny model through the serving loop: each control changes the
output (it acts), outputs agree across modes, requests without controls are unchanged when they
share a batch with controlled ones, logprobs equal the model's log-softmax, and constrained
outputs match their JSON schema or regex."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from graphrelay.capture.iteration.controls.grammar import GrammarCompiler, vocabulary
from graphrelay.capture.iteration.controls.params import ControlParams
from graphrelay.capture.iteration.controls.state import ControlsConfig, SamplingControls
from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.iteration.ngram import SpecConfig
from graphrelay.capture.model.model import ModelConfig
from graphrelay.capture.serving.loop import ServingLoop
from graphrelay.capture.serving.workloads import SyntheticWorkload
from controls_cases import EOS, REGEX, SCHEMA, STRINGS, msgspec_replace
from model_reference import reference_logits

MODEL = ModelConfig.preset("tiny")




def make_engine(mode: str, device: str, controls=True, spec=None, grammar_states=512, backend=None) -> Engine:
    engine = Engine(EngineConfig(
        MODEL, max_reqs=6, max_batch=4, device=device, use_graphs=mode != "eager", max_tokens=32, buckets=(32,),
        spec=spec,
        controls=ControlsConfig(max_bias=4, max_stop=2, grammar_states=grammar_states, backend=backend)
        if controls else None,
    ))
    if controls:
        engine.controls.set_compiler(GrammarCompiler(vocabulary(STRINGS, EOS), MODEL.vocab_size))
    engine.capture()
    return engine


def serve(requests, device, mode="overlap", controls=True, spec=None, stats=False):
    result = ServingLoop(make_engine(mode, device, controls, spec), mode).run(requests)
    return (result.outputs, result.stats) if stats else result.outputs


def base_requests(n=4, **overrides):
    spec = dict(num_requests=n, prompt_len=(3, 8), output_len=(10, 10), vocab_size=MODEL.vocab_size, seed=5)
    spec.update(overrides)
    return SyntheticWorkload(**spec).requests()


def with_controls(request, **controls):
    return msgspec_replace(request, controls=ControlParams(**controls))


CONTROLS = {
    "frequency": dict(frequency_penalty=2.0),
    "presence": dict(presence_penalty=2.0),
    "repetition": dict(repetition_penalty=3.0),
    "bias": dict(logit_bias={17: 100.0}),
}


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_each_control_acts_and_the_others_in_the_batch_are_unchanged(name, device):
    requests = base_requests()
    plain = serve(requests, device, controls=False)
    mixed = [with_controls(r, **CONTROLS[name]) if i % 2 == 0 else r for i, r in enumerate(requests)]
    out = serve(mixed, device)
    for i, r in enumerate(requests):
        if i % 2:
            assert out[r.id].tokens == plain[r.id].tokens, f"{r.id} without controls changed"
    changed = [out[r.id].tokens != plain[r.id].tokens for i, r in enumerate(requests) if i % 2 == 0]
    assert any(changed), f"{name} changed no output"
    if name == "bias":
        assert all(set(out[r.id].tokens) == {17} for i, r in enumerate(requests) if i % 2 == 0)


def test_min_tokens_delays_the_stop_token(device):
    requests = base_requests(output_len=(12, 12))
    probe = serve(requests, device, controls=False)
    stop = probe[requests[0].id].tokens[1]  # a token greedy decoding emits early
    stopped = [msgspec_replace(r, stop_tokens=(stop,)) for r in requests]
    early = serve(stopped, device)[requests[0].id]
    assert early.finish_reason == "stop" and len(early.tokens) <= 2
    late = serve([with_controls(r, min_tokens=6) for r in stopped], device)[requests[0].id]
    assert stop not in late.tokens[:6] and len(late.tokens) >= 6


def test_logprobs_equal_the_models_log_softmax(device):
    requests = [with_controls(r, logprobs=3, repetition_penalty=1.5) for r in base_requests(2)]
    engine = make_engine("overlap", device)
    out = ServingLoop(engine, "overlap").run(requests).outputs
    for r in requests:
        seq = list(r.prompt)
        assert len(out[r.id].logprobs) == len(out[r.id].tokens)
        for token, lp in zip(out[r.id].tokens, out[r.id].logprobs):
            # Raw semantics: the model's distribution, before the repetition penalty.
            ref = torch.log_softmax(reference_logits(engine.model, seq).double(), -1)
            assert lp.logprob == pytest.approx(float(ref[token]), rel=1e-3, abs=1e-4)
            assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(ref.topk(3).values.tolist(), rel=1e-3, abs=1e-4)
            seq.append(token)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_logprobs_of_requests_that_asked_are_the_same_beside_requests_that_did_not(backend, device):
    """Two requests ask for logprobs; beside them, a controlled request that does not ask (its
    rows run the controls variant, their logprobs skipped) and an uncontrolled one. The asking
    requests get the same tokens and logprobs as when served alone, the others get none."""
    requests = base_requests(4)
    asking = [with_controls(r, logprobs=3) for r in requests[:2]]
    others = [with_controls(requests[2], presence_penalty=1.0), requests[3]]

    def run(batch):
        return ServingLoop(make_engine("overlap", device, backend=backend), "overlap").run(batch).outputs

    alone, mixed = run(asking), run(asking + others)
    for r in asking:
        assert mixed[r.id].tokens == alone[r.id].tokens, r.id
        assert len(mixed[r.id].logprobs) == len(mixed[r.id].tokens)
        assert mixed[r.id].logprobs == alone[r.id].logprobs, r.id
    assert all(mixed[r.id].logprobs is None for r in others)


def grammar_requests(sampling):
    out = []
    for i, r in enumerate(base_requests(4, output_len=(48, 48))):
        kind = dict(json_schema=json.dumps(SCHEMA)) if i % 2 == 0 else dict(regex=REGEX)
        out.append(msgspec_replace(r, stop_tokens=(EOS,), controls=ControlParams(**kind),
                                   sampling=SamplingParams(temperature=0.9, seed=100 + i) if sampling == "seeded" else r.sampling))
    return out


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_constrained_outputs_match_their_schema_or_regex_in_every_mode(sampling, device):
    requests = grammar_requests(sampling)
    results = {mode: serve(requests, device, mode) for mode in ("overlap", "no-overlap", "eager")}
    for i, r in enumerate(requests):
        out = results["eager"][r.id]
        assert out.finish_reason == "stop", f"{r.id} did not complete its grammar: {out.tokens}"
        text = "".join(STRINGS[t] for t in out.tokens[:-1])
        if i % 2 == 0:
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(REGEX, text), text
        for mode in ("overlap", "no-overlap"):
            assert results[mode][r.id].tokens == out.tokens, f"{mode} differs from eager for {r.id}"


def test_a_grammar_over_the_state_budget_is_refused_naming_it():
    controls = SamplingControls(ControlsConfig(grammar_states=4), max_reqs=2, vocab_size=MODEL.vocab_size,
                                max_rows=2, device="cpu",
                                compiler=GrammarCompiler(vocabulary(STRINGS, EOS), MODEL.vocab_size))
    before = controls.slot_state.clone()
    with pytest.raises(ValueError, match="grammar_states"):
        controls.admit(1, ControlParams(json_schema=json.dumps(SCHEMA)), (EOS,), [1, 2])
    assert torch.equal(before, controls.slot_state)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_controlled_outputs_are_the_same_with_speculation(sampling, device):
    """Verify rows see the counts and automaton state after their drafts, so accepted drafts
    are exactly the tokens plain decoding would emit, logprobs included."""
    controls = [dict(frequency_penalty=0.3, presence_penalty=0.2, logprobs=2), dict(repetition_penalty=1.2),
                dict(min_tokens=8, logit_bias={3: 2.0}), dict(regex=REGEX), dict(json_schema=json.dumps(SCHEMA))]
    requests = []
    for i, r in enumerate(base_requests(5, vocab_size=6, prompt_len=(6, 12), output_len=(24, 24))):
        sampling_params = SamplingParams(temperature=0.3, seed=i) if sampling == "seeded" else r.sampling
        requests.append(msgspec_replace(r, stop_tokens=(EOS,), sampling=sampling_params, controls=ControlParams(**controls[i])))
    plain = serve(requests, device, "no-overlap")
    spec, stats = serve(requests, device, "overlap", spec=SpecConfig(k=3), stats=True)
    assert stats.tokens_per_request_step > 1.0, "no draft was accepted: the test would prove nothing"
    for r in requests:
        assert spec[r.id].tokens == plain[r.id].tokens, r.id
        assert spec[r.id].finish_reason == plain[r.id].finish_reason
    for a, b in zip(spec[requests[0].id].logprobs, plain[requests[0].id].logprobs):
        assert a.logprob == pytest.approx(b.logprob, rel=1e-4, abs=1e-5)


def test_the_loop_refuses_requests_the_controls_cannot_hold_before_serving():
    engine = make_engine("eager", "cpu")
    good = base_requests(1)[0]
    too_many = with_controls(msgspec_replace(good, id="wide"), logit_bias={i: 1.0 for i in range(5)})
    with pytest.raises(ValueError, match="request 'wide': logit_bias has 5 entries.*max_bias = 4"):
        ServingLoop(engine, "eager").run([good, too_many])
    assert engine.iterations_launched == 0
    plain_engine = make_engine("eager", "cpu", controls=False)
    with pytest.raises(ValueError, match="EngineConfig.controls"):
        ServingLoop(plain_engine, "eager").run([with_controls(good, presence_penalty=1.0)])


def test_a_grammar_that_does_not_fit_beside_those_in_use_waits_for_them():
    """A pool with room for the schema's automaton or the regex's, not both: the regex requests
    wait until the schema requests finish, then all complete and match."""
    requests = grammar_requests("greedy")
    engine = make_engine("eager", "cpu", grammar_states=44)  # schema 42 states, regex 9 (+ row 0)
    out = ServingLoop(engine, "eager").run(requests).outputs
    for i, r in enumerate(requests):
        assert out[r.id].finish_reason == "stop", r.id
        text = "".join(STRINGS[t] for t in out[r.id].tokens[:-1])
        if i % 2 == 0:
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(REGEX, text), text
