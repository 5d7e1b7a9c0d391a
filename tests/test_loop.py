"""The serving loop: modes agree token for token, every request stops exactly where it
should, aborts leave the others unchanged (the soak with heavy slot churn, checked against a
reference, is tests/test_loop_soak.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.serving.loop import ServingLoop
from graphrelay.capture.model.model import ModelConfig
from model_reference import reference_logits
from graphrelay.capture.serving.workloads import Request, SyntheticWorkload

MODEL = ModelConfig.preset("tiny")


def make_engine(mode: str, device: str, max_reqs: int = 6, max_batch: int = 4, max_tokens: int = 24,
                kv_cache_dtype: str = "auto") -> Engine:
    # One token bucket: every mode runs every iteration at the same shape, so per-row results
    # (and greedy tokens) are bit-identical across modes (see README: "Where the modes may
    # differ"). 24 tokens: prompts (up to 12) are chunked over iterations beside decodes.
    engine = Engine(EngineConfig(
        MODEL, max_reqs=max_reqs, max_batch=max_batch, device=device, max_tokens=max_tokens,
        use_graphs=mode != "eager", buckets=(max_tokens,), debug=True, kv_cache_dtype=kv_cache_dtype,
    ))
    engine.capture()
    return engine


def serve(mode: str, requests, device: str, kv_cache_dtype: str = "auto", **kwargs):
    engine = make_engine(mode, device, kv_cache_dtype=kv_cache_dtype)
    result = ServingLoop(engine, mode).run(requests, **kwargs)
    engine.relay.check()  # debug mode: no unwritten or double-consumed row was ever read
    return result


def workload(**overrides):
    spec = dict(num_requests=14, prompt_len=(2, 12), output_len=(1, 20), vocab_size=MODEL.vocab_size, seed=3)
    spec.update(overrides)
    return SyntheticWorkload(**spec).requests()


def tokens_of(result) -> dict[str, list[int]]:
    return {rid: out.tokens for rid, out in result.outputs.items()}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_greedy_tokens_match_the_slow_reference(kv_cache_dtype, device):
    requests = workload(num_requests=5, output_len=(3, 8))
    result = serve("overlap", requests, device, kv_cache_dtype)
    engine_model = make_engine("eager", device, kv_cache_dtype=kv_cache_dtype).model
    for r in requests:
        seq = list(r.prompt)
        for token in result.outputs[r.id].tokens:
            assert token == int(reference_logits(engine_model, seq).argmax()), f"request {r.id} at {len(seq)}"
            seq.append(token)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_modes_produce_identical_tokens(sampling, kv_cache_dtype, device):
    extra = {} if sampling == "greedy" else dict(temperature=0.8, top_k=20)
    requests = workload(**extra)
    results = {mode: serve(mode, requests, device, kv_cache_dtype)
               for mode in ("overlap", "no-overlap", "eager")}
    base = tokens_of(results["eager"])
    assert len(base) == len(requests)
    for mode, result in results.items():
        assert tokens_of(result) == base, f"{mode} differs from eager"


def test_every_request_stops_exactly_at_its_stop_token_or_limit(device):
    # A stop token that greedy decoding actually produces: take the most common token of a run.
    probe = serve("overlap", workload(), device)
    counts = {}
    for out in probe.outputs.values():
        for t in out.tokens[1:]:
            counts[t] = counts.get(t, 0) + 1
    stop = max(counts, key=counts.get)
    requests = workload(stop_tokens=(stop,))
    result = serve("overlap", requests, device)
    stopped = 0
    for r in requests:
        out = result.outputs[r.id]
        unconstrained = probe.outputs[r.id].tokens
        if stop in unconstrained:
            cut = unconstrained.index(stop) + 1
            assert out.tokens == unconstrained[:cut] and out.finish_reason == "stop", r.id
            stopped += 1
        else:
            assert out.tokens == unconstrained and out.finish_reason == "length", r.id
            assert len(out.tokens) == r.max_new_tokens
    assert stopped > 0


def test_no_token_lost_or_duplicated(device):
    requests = workload(num_requests=20)
    result = serve("overlap", requests, device)
    for r in requests:
        out = result.outputs[r.id]
        assert out.finish_reason == "length" and len(out.tokens) == r.max_new_tokens, r.id
    assert result.stats.tokens == sum(r.max_new_tokens for r in requests)


def test_aborts_leave_other_requests_unchanged(device):
    requests = workload(num_requests=12, output_len=(10, 20))
    base = tokens_of(serve("overlap", requests, device))
    aborts = {"r1": 3, "r4": 5, "r11": 0}  # two mid-flight, one before admission
    result = serve("overlap", requests, device, aborts=aborts)
    for r in requests:
        out = result.outputs[r.id]
        if r.id in aborts:
            assert out.finish_reason == "abort"
            assert out.tokens == base[r.id][: len(out.tokens)] and len(out.tokens) < len(base[r.id])
        else:
            assert out.tokens == base[r.id], r.id


def test_bad_requests_are_rejected_with_the_request_named():
    engine = make_engine("eager", "cpu")
    loop = ServingLoop(engine, "overlap")
    too_long = Request(id="long", prompt=[1] * 200, max_new_tokens=100)
    with pytest.raises(ValueError, match="'long'.*max_seq_len"):
        loop.run([too_long])
    with pytest.raises(ValueError, match="vocab_size"):
        loop.run([Request(id="v", prompt=[MODEL.vocab_size], max_new_tokens=2)])
    with pytest.raises(ValueError, match="mode"):
        ServingLoop(engine, "fast")


def test_the_loop_passes_on_warnings_it_does_not_count():
    """Sync counting records warnings; any other warning raised inside the loop must still
    reach the user."""
    engine = Engine(EngineConfig(MODEL, max_reqs=6, max_batch=4, use_graphs=False, max_tokens=16))
    engine.capture()
    launch = engine.launch

    def launch_and_warn(spans, before_replay=None):
        warnings.warn("a warning from inside the loop", UserWarning)
        return launch(spans, before_replay)

    engine.launch = launch_and_warn
    with pytest.warns(UserWarning, match="from inside the loop"):
        ServingLoop(engine, "overlap").run(workload(num_requests=4, output_len=(3, 5)))


def test_a_float8_kv_cache_changes_tokens_and_halves_the_cache():
    # The float8 cache is not the model-dtype one (tiny's float32 K/V rounded to 3 mantissa
    # bits): some greedy token moves, and the memory plan counts a quarter of float32's bytes.
    requests = workload(num_requests=8, output_len=(16, 20))
    assert tokens_of(serve("eager", requests, "cpu", "fp8")) != tokens_of(serve("eager", requests, "cpu"))
    sizes = dict(max_reqs=8, max_batch=4, max_tokens=16)
    plain, float8 = (EngineConfig(MODEL, **sizes, kv_cache_dtype=name).memory_plan() for name in ("auto", "fp8"))
    assert float8.kv_cache * 4 == plain.kv_cache and float8.weights == plain.weights
    engine = make_engine("eager", "cpu", kv_cache_dtype="fp8")
    assert {t.dtype for t in engine.model.kv_cache.keys + engine.model.kv_cache.values} == {torch.float8_e4m3fn}


def test_engine_config_rejects_an_unknown_kv_cache_dtype():
    with pytest.raises(ValueError, match=r"EngineConfig.kv_cache_dtype 'int4' is not supported; use one of \['auto', 'fp8'\]"):
        EngineConfig(MODEL, max_reqs=4, max_batch=2, kv_cache_dtype="int4")


@pytest.mark.parametrize("field, value", [("max_batch", 0), ("max_reqs", -1), ("max_tokens", 1.5), ("max_top_k", 0),
                                        ("max_top_k", True)])
def test_engine_config_rejects_bad_sizes_by_name(field, value):
    with pytest.raises(ValueError, match=f"EngineConfig.{field} must be"):
        EngineConfig(MODEL, **{"max_reqs": 4, "max_batch": 2, field: value})


def test_engine_config_needs_room_for_a_full_decode_iteration():
    with pytest.raises(ValueError, match="max_tokens .* must hold a full decode iteration"):
        EngineConfig(MODEL, max_reqs=8, max_batch=8, max_tokens=4)
    with pytest.raises(ValueError, match="buckets must end at max_tokens"):
        EngineConfig(MODEL, max_reqs=8, max_batch=4, max_tokens=16, buckets=(4, 8))


def test_capture_leaves_serving_state_untouched():
    """Capture warms every token bucket up over padding: the relay's rows, the slots'
    generations and the iteration count stay as they were."""
    engine = Engine(EngineConfig(MODEL, max_reqs=3, max_batch=2, device="cpu", max_tokens=8))
    before = {name: buf.clone() for name, buf in engine.relay.buffers.items()}
    generations = engine.relay.host_generation.clone()
    engine.capture()
    assert all(torch.equal(before[name][1:], buf[1:]) for name, buf in engine.relay.buffers.items())
    assert torch.equal(engine.relay.host_generation, generations) and engine.iterations_launched == 0


def test_long_prompt_is_chunked_beside_running_decodes():
    """A prompt longer than the token budget is cut into chunks over several iterations while
    an earlier request keeps decoding in every one of them, and both equal the reference."""
    engine = make_engine("overlap", "cpu", max_tokens=8)
    requests = [Request(id="short", prompt=[5, 6], max_new_tokens=12),
                Request(id="long", prompt=list(range(1, 40)), max_new_tokens=3, arrival=0.0)]
    launched = []
    launch = engine.launch
    engine.launch = lambda spans, before_replay=None: (launched.append([(s.slot, len(s.tokens)) for s in spans])
                                                       or launch(spans, before_replay))
    result = ServingLoop(engine, "overlap").run(requests)
    mixed = [spans for spans in launched if any(n == 0 for _, n in spans) and any(n > 0 for _, n in spans)]
    assert len(mixed) >= 4, launched  # the 39-token prompt rode beside decode rows, 7 tokens at a time
    for r in requests:
        seq = list(r.prompt)
        for token in result.outputs[r.id].tokens:
            assert token == int(reference_logits(engine.model, seq).argmax()), f"request {r.id} at {len(seq)}"
            seq.append(token)
