"""N-gram speculative decoding captured in CUDA graphs: propose -> verify on a toy model ->
sample -> accept -> append as ONE graph per bucket, replayed with its static inputs rewritten
in place, against a twin run eagerly (bit for bit) and against plain one-token decoding; and
`propose` alone at serving sizes (bs 256, max_seq_len 4096), replayed against eager.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from graphrelay.capture.iteration.ngram import Drafts, TokenHistory, propose
from test_speculative import GREEDY_PARAMS, SAMPLED_PARAMS, SpecStep, StaticBucket, ToyModel, plain_decode, run_speculative

pytestmark = pytest.mark.gpu

MAX_REQS, SIZE, K, VOCAB = 12, 96, 4, 5


@pytest.mark.parametrize("bs", [1, 8, 16])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_captured_step_replays_like_eager(bs, sampled):
    """Graph and eager twins serve the same requests under the same schedule: the same tokens
    (equal to plain decoding) and the same history rows, outside the scratch row 0."""
    setup = random.Random(bs)
    prompts = [[setup.randrange(VOCAB) for _ in range(setup.randint(2, 10))] for _ in range(MAX_REQS)]
    params = [setup.choice(SAMPLED_PARAMS) if sampled else GREEDY_PARAMS for _ in prompts]
    model = ToyModel(VOCAB, bs, "cuda")
    runs = []
    for use_graph in (True, False):
        step = SpecStep(TokenHistory(MAX_REQS, SIZE, "cuda"), model, K, min_n=1, max_n=3)
        bucket = StaticBucket(step, bs, "cuda")
        if use_graph:
            bucket.capture()
        # The same seed: both twins see the same batch orders and padding lengths.
        runs.append((run_speculative(bucket, prompts, params, SIZE, random.Random(7)), step.history))
    ((graph_tokens, graph_iters), graph_history), ((eager_tokens, eager_iters), eager_history) = runs
    assert graph_iters == eager_iters
    assert graph_tokens == eager_tokens
    assert torch.equal(graph_history.tokens[1:], eager_history.tokens[1:])
    for slot, prompt in enumerate(prompts, 1):
        assert graph_tokens[slot] == plain_decode(model, prompt, SIZE, *params[slot - 1]), f"slot {slot}"


def captured(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, replays: int = 50) -> float:
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / replays * 1e6


def test_propose_at_serving_size_replays_like_eager():
    """Both backends captured at bs 256, max_seq_len 4096, replayed on new slots and lengths,
    against the torch backend run eagerly; prints each graph's replay time."""
    bs, size, k, min_n, max_n = 256, 4096, 8, 1, 4
    generator = torch.Generator().manual_seed(0)
    history = TokenHistory(bs - 16, size, "cuda")
    # A small vocabulary, so every n finds matches somewhere in the long rows.
    history.tokens.copy_(torch.randint(0, 8, history.tokens.shape, generator=generator))
    slots = torch.zeros(bs, dtype=torch.int64, device="cuda")
    lengths = torch.zeros(bs, dtype=torch.int64, device="cuda")
    outs, graphs = {}, {}
    for backend in ("triton", "torch"):
        out = Drafts(torch.zeros(bs, k, dtype=torch.int64, device="cuda"), torch.zeros(bs, dtype=torch.int64, device="cuda"))
        outs[backend] = out
        graphs[backend] = captured(lambda out=out, backend=backend: propose(
            history, slots, lengths, k, min_n, max_n, out=out, backend=backend))

    for trial in range(5):
        live = torch.randperm(history.max_reqs, generator=generator) + 1  # every live slot, once
        slots.copy_(torch.cat((live, torch.zeros(16, dtype=torch.int64)))[torch.randperm(bs, generator=generator)])
        lengths.copy_(torch.randint(0, size + 1, (bs,), generator=generator))
        want = propose(history, slots, lengths, k, min_n, max_n, backend="torch")
        assert (want.num_drafts > 0).float().mean() > 0.5  # the case exercises real matches
        for backend, graph in graphs.items():
            graph.replay()
            assert torch.equal(outs[backend].tokens, want.tokens), f"{backend}, trial {trial}"
            assert torch.equal(outs[backend].num_drafts, want.num_drafts), f"{backend}, trial {trial}"

    for backend, graph in graphs.items():
        print(f"propose[{backend}] bs={bs} max_seq_len={size} k={k} n={min_n}..{max_n}: {replay_us(graph):.0f} us per replay")
