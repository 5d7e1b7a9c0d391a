"""Tensor parallelism on the CPU (gloo, 2 spawned processes): the split adds up to the whole
model, TP=2 serves the same tokens as TP=1 in every mode (prefill chunks, sampling, aborts,
speculative decoding), every rank ends with the same relay, and a failing rank ends the job
instead of hanging it."""

from __future__ import annotations

import time

import pytest
import torch

from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.kernels.layer_kernels import silu_mul
from graphrelay.capture.serving.loop import ServingLoop
from graphrelay.capture.model.memory_plan import plan_memory
from graphrelay.capture.model.model import ModelConfig, ModelWeights
from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.iteration.ngram import SpecConfig
from graphrelay.capture.iteration.spans import decode_span, prefill_span
from graphrelay.capture.parallel.tensor_parallel import _DECODER, _ENCODER, LaunchCommand, StopCommand, TensorParallel
from graphrelay.capture.parallel.tp_launch import RankFailed, run_ranks
from graphrelay.capture.parallel.tp_serve import serve_rank
from graphrelay.capture.serving.workloads import SyntheticWorkload

MODEL = ModelConfig.preset("tiny")  # float32; 4 heads, 2 KV heads, 128 MLP columns: splits over 2


def test_shard_rejects_a_model_that_does_not_split():
    smollm2 = ModelConfig.preset("smollm2-135m")  # 9 query heads, 3 KV heads
    with pytest.raises(ValueError, match=r"num_heads \(9\) divisible by 2.*small, medium or llama-1b preset"):
        smollm2.shard(2)
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(num_heads=4, num_kv_heads=2, hidden_size=64).shard(4)
    with pytest.raises(ValueError, match="positive int"):
        MODEL.shard(0)
    assert MODEL.shard(2).num_heads == 2 and MODEL.shard(2).head_dim == MODEL.head_dim


def test_llama_1b_preset_has_llama_3_2_1b_sizes_and_splits_over_2_4_8():
    c = ModelConfig.preset("llama-1b")
    # Llama-3.2-1B's published parameter count, tied embeddings counted once; bf16.
    assert plan_memory(c, max_reqs=1, max_tokens=1, sampled_rows=1).weights == 1_235_814_400 * 2
    assert (c.head_dim, c.kv_groups, c.rope_theta, c.tie_word_embeddings) == (64, 4, 500000.0, True)
    for world in (2, 4, 8):
        s = c.shard(world)
        assert (s.num_heads, s.num_kv_heads, s.intermediate_size) == (32 // world, 8 // world, 8192 // world)
        assert s.head_dim == 64 and s.vocab_size == c.vocab_size  # heads narrow, embeddings whole
    with pytest.raises(ValueError, match=r"num_heads \(32\) divisible by 3"):
        c.shard(3)


def test_shards_add_up_to_the_whole_layer():
    """Column-parallel QKV / gate-up and row-parallel O / down: the ranks' partial outputs
    sum to the whole layer's, and each rank's query heads read its own KV heads."""
    c = ModelConfig(num_heads=8, num_kv_heads=4, hidden_size=64, intermediate_size=96)
    whole = ModelWeights.random(c)
    shards = [whole.shard(c, rank, 2) for rank in range(2)]
    layer, h = whole.layers[0], torch.randn(3, c.hidden_size)
    d = c.head_dim

    mlp = silu_mul(h @ layer.gate_up.T) @ layer.down.T
    parts = sum(silu_mul(h @ s.layers[0].gate_up.T) @ s.layers[0].down.T for s in shards)
    torch.testing.assert_close(parts, mlp)

    qkv = h @ layer.qkv.T  # [3, (8 + 2 * 4) * d]
    q, k, v = qkv.split([8 * d, 4 * d, 4 * d], -1)
    for rank, s in enumerate(shards):
        q_r, k_r, v_r = (h @ s.layers[0].qkv.T).split([4 * d, 2 * d, 2 * d], -1)
        torch.testing.assert_close(q_r, q[:, rank * 4 * d: (rank + 1) * 4 * d])
        torch.testing.assert_close(k_r, k[:, rank * 2 * d: (rank + 1) * 2 * d])
        torch.testing.assert_close(v_r, v[:, rank * 2 * d: (rank + 1) * 2 * d])
    attn = torch.randn(3, 8 * d)  # any attention output: the O projection splits by heads
    o_parts = sum(attn[:, r * 4 * d: (r + 1) * 4 * d] @ s.layers[0].o.T for r, s in enumerate(shards))
    torch.testing.assert_close(o_parts, attn @ layer.o.T)
    assert shards[0].embed is whole.embed and shards[1].lm_head is whole.lm_head  # replicated


def test_commands_round_trip():
    spans = [decode_span(1, SamplingParams()), decode_span(3, SamplingParams(temperature=1.0, seed=3)),
             prefill_span(2, SamplingParams(0.7, 5, 11, 0.9), [5, 6, 7], 0, True)]
    for command in (LaunchCommand(spans), StopCommand()):
        assert _DECODER.decode(_ENCODER.encode(command)) == command


def test_only_followers_follow():
    engine = Engine(EngineConfig(MODEL, max_reqs=2, max_batch=2, max_tokens=8), tp=TensorParallel(0, 1, torch.device("cpu"), None, None))
    with pytest.raises(RuntimeError, match="ranks > 0"):
        engine.follow()


def _workload(**overrides):
    spec = dict(num_requests=9, prompt_len=(3, 40), output_len=(2, 14), vocab_size=MODEL.vocab_size, seed=5)
    spec.update(overrides)
    return SyntheticWorkload(**spec).requests()


CASES = {
    # 16 tokens an iteration (prompts chunked beside decodes), 9 requests through 4 slots, two aborts (one running, one queued)
    "greedy-overlap-aborts": (dict(), "overlap", {"r1": 6, "r8": 2}, None),
    "sampled-no-overlap": (dict(temperature=0.9, top_k=20), "no-overlap", None, None),
    "spec-ngram-eager": (dict(temperature=0.0), "eager", None, SpecConfig(k=3, min_n=1, max_n=2)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp2_serves_the_same_tokens_as_tp1(case):
    workload, mode, aborts, spec = CASES[case]
    requests = _workload(**workload)
    config = EngineConfig(MODEL, max_reqs=4, max_batch=4, device="cpu", max_tokens=16, spec=spec, debug=True)
    engine = Engine(config)
    engine.capture()
    single = ServingLoop(engine, mode).run(requests, aborts=aborts)

    out = run_ranks(2, serve_rank, config, requests, mode, aborts, device_type="cpu")

    assert {k: (v.tokens, v.finish_reason) for k, v in out.result.outputs.items()} == \
        {k: (v.tokens, v.finish_reason) for k, v in single.outputs.items()}
    assert sum(len(v.tokens) for v in single.outputs.values()) > 20
    if aborts:
        assert out.result.outputs["r1"].finish_reason == "abort"
    assert [r.rank for r in out.ranks] == [0, 1]
    assert out.ranks[1].relay == out.ranks[0].relay, "the ranks' relays diverged"
    assert [r.host_syncs for r in out.ranks] == [0, 0]


def _fail_on_rank_1(tp: TensorParallel) -> int:
    if tp.rank == 1:
        raise ValueError("rank 1 cannot build its engine")
    tp.all_reduce(torch.ones(2))  # would wait forever for rank 1
    return 0


def test_a_failing_rank_ends_the_job_with_its_error():
    start = time.perf_counter()
    with pytest.raises(RankFailed, match="rank 1: ValueError: rank 1 cannot build its engine"):
        run_ranks(2, _fail_on_rank_1, device_type="cpu")
    assert time.perf_counter() - start < 60


def test_a_failing_loop_on_rank_0_releases_the_followers():
    """A request the engine cannot hold fails rank 0's loop after capture; the followers are
    released (not left in `follow`) and the error names the request."""
    config = EngineConfig(MODEL, max_reqs=2, max_batch=2, device="cpu", max_tokens=16)
    requests = _workload(num_requests=2, prompt_len=(MODEL.max_seq_len, MODEL.max_seq_len), output_len=(4, 4))
    with pytest.raises(RankFailed, match=r"rank 0: ValueError: request .* exceeds the model's max_seq_len") as info:
        run_ranks(2, serve_rank, config, requests, device_type="cpu")
    assert "rank 1" not in str(info.value)
