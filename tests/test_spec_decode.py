"""Speculative decoding through the engine and the loop: outputs identical to plain decoding
(greedy and seeded) in every mode, stop tokens and length limits inside an accepted run cut
exactly, and prompt lookup actually accepts drafts where the output copies the input."""

from __future__ import annotations

import pytest

from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.serving.loop import ServingLoop
from graphrelay.capture.model.model import ModelConfig
from graphrelay.capture.iteration.ngram import SpecConfig
from graphrelay.capture.serving.workloads import Request, SyntheticWorkload

MODEL = ModelConfig.preset("tiny")
SPEC = SpecConfig(k=3, min_n=1, max_n=3)


def serve(mode: str, requests, device: str, spec=None, max_batch: int = 4):
    # One token bucket (every mode runs every iteration at the same shape), room for a full
    # verify iteration beside prompt chunks.
    tokens = 2 * max_batch * (spec.rows if spec else 1)
    engine = Engine(EngineConfig(MODEL, max_reqs=6, max_batch=max_batch, device=device, use_graphs=mode != "eager",
                                 max_tokens=tokens, buckets=(tokens,), spec=spec, debug=True))
    engine.capture()
    result = ServingLoop(engine, mode).run(requests)
    engine.relay.check()
    return result


def workload(temperature: float = 0.0, **overrides):
    # Repetitive prompts (a short pattern tiled) give the drafter matches to propose.
    spec = dict(num_requests=10, prompt_len=(4, 16), output_len=(1, 24), vocab_size=12, seed=5,
                temperature=temperature)
    spec.update(overrides)
    return SyntheticWorkload(**spec).requests()


def tokens_of(result) -> dict[str, list[int]]:
    return {rid: out.tokens for rid, out in result.outputs.items()}


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
@pytest.mark.parametrize("mode", ["overlap", "no-overlap", "eager"])
def test_speculative_outputs_equal_plain_decoding(device, mode, temperature):
    requests = workload(temperature)
    plain = serve(mode, requests, device)
    spec = serve(mode, requests, device, spec=SPEC)
    assert tokens_of(spec) == tokens_of(plain)
    assert all(len(spec.outputs[r.id].tokens) == r.max_new_tokens for r in requests)
    # Every request step yields at least one token; more only when drafts were accepted.
    assert spec.stats.tokens_per_request_step >= 1.0 and plain.stats.tokens_per_request_step == 1.0


def test_stop_tokens_and_limits_inside_accepted_runs_cut_exactly(device):
    requests = workload(output_len=(20, 30))
    probe = serve("eager", requests, device, spec=SPEC)
    assert probe.stats.tokens_per_request_step > 1.0, "the drafter accepted nothing: the test needs accepted runs"
    counts: dict[int, int] = {}
    for out in probe.outputs.values():
        for t in out.tokens[1:]:
            counts[t] = counts.get(t, 0) + 1
    stop = max(counts, key=counts.get)
    stopped = [Request(id=r.id, prompt=r.prompt, max_new_tokens=r.max_new_tokens, stop_tokens=(stop,)) for r in requests]
    result = serve("eager", stopped, device, spec=SPEC)
    cut = 0
    for r in stopped:
        full, got = probe.outputs[r.id].tokens, result.outputs[r.id]
        if stop in full:
            assert got.tokens == full[: full.index(stop) + 1] and got.finish_reason == "stop"
            cut += 1
        else:
            assert got.tokens == full and got.finish_reason == "length"
    assert cut > 0


def test_spec_config_rejects_bad_values():
    with pytest.raises(ValueError, match="k .* 1..16"):
        SpecConfig(k=0)
    with pytest.raises(ValueError, match="min_n <= max_n"):
        SpecConfig(min_n=3, max_n=2)
