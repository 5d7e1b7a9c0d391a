"""Tensor parallelism on two GPUs (NCCL): the whole decode iteration, all-reduces included,
captured on every rank; TP=2 serves the same tokens as TP=1 on a float32 model; graph replay
equals eager on every rank; no host syncs on any rank. Needs two GPUs (skipped with fewer)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.serving.loop import ServingLoop
from graphrelay.capture.model.model import ModelConfig
from graphrelay.capture.parallel.tp_launch import run_ranks
from graphrelay.capture.parallel.tp_serve import serve_rank
from graphrelay.capture.serving.workloads import SyntheticWorkload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs 2 GPUs"),
]

# The small preset's shape in float32, shortened: exact enough that TP=2 and TP=1 pick the same
# greedy tokens although the all-reduce sums the partial projections in another order.
MODEL = msgspec.structs.replace(ModelConfig.preset("small"), dtype="float32", num_layers=4, max_seq_len=256)
BUCKET = 64  # one token bucket: graph and eager runs see identical shapes, so they agree bit for bit


def _config(use_graphs: bool) -> EngineConfig:
    return EngineConfig(MODEL, max_reqs=8, max_batch=8, device="cuda", use_graphs=use_graphs,
                        max_tokens=BUCKET, buckets=(BUCKET,), debug=True)


def _requests(temperature: float = 0.0):
    return SyntheticWorkload(num_requests=12, prompt_len=(4, 60), output_len=(8, 40), vocab_size=MODEL.vocab_size,
                             seed=9, temperature=temperature, top_k=50 if temperature else 0).requests()


def _tokens(outputs) -> dict:
    return {k: v.tokens for k, v in outputs.items()}


def test_tp2_graphs_match_tp1_and_eager_on_every_rank():
    requests = _requests()
    engine = Engine(_config(use_graphs=True))
    single_capture = engine.capture()
    single = ServingLoop(engine, "overlap").run(requests)
    del engine
    torch.cuda.empty_cache()

    graphs = run_ranks(2, serve_rank, _config(True), requests, "overlap", device_type="cuda")
    eager = run_ranks(2, serve_rank, _config(False), requests, "eager", device_type="cuda")

    assert _tokens(graphs.result.outputs) == _tokens(single.outputs)
    assert _tokens(eager.result.outputs) == _tokens(graphs.result.outputs)
    assert graphs.result.stats.graphs and not eager.result.stats.graphs
    for g, e in zip(graphs.ranks, eager.ranks):  # replay equals eager, rank by rank
        assert g.relay == e.relay, f"rank {g.rank}: graph and eager relays differ"
    assert graphs.ranks[1].relay == graphs.ranks[0].relay
    assert [r.host_syncs for r in graphs.ranks] == [0, 0]
    # The all-reduces are inside the graph: two per layer on top of the one-GPU step's nodes.
    assert graphs.capture.nodes[BUCKET] >= single_capture.nodes[BUCKET] + 2 * MODEL.num_layers


def test_tp2_seeded_sampling_matches_tp1_with_aborts():
    requests = _requests(temperature=0.8)
    aborts = {"r2": 5, "r11": 1}
    engine = Engine(_config(use_graphs=True))
    engine.capture()
    single = ServingLoop(engine, "overlap").run(requests, aborts=aborts)
    del engine
    torch.cuda.empty_cache()
    out = run_ranks(2, serve_rank, _config(True), requests, "overlap", aborts, device_type="cuda")
    assert _tokens(out.result.outputs) == _tokens(single.outputs)
    assert out.result.outputs["r2"].finish_reason == "abort"
    assert out.ranks[1].relay == out.ranks[0].relay
