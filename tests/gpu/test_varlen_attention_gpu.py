"""The varlen attention kernel on a GPU at SmolLM2-135M's attention shape (9 query heads, 3 KV
heads, head_dim 64, bf16) against the torch reference for decode-only, prefill and mixed
batches, through a permuted block table, and captured into a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from attention_cases import capture_after_warmup, flat_batch, permuted_pages, random_cache
from graphrelay.capture.kernels.varlen_attention import (
    Q_BLOCK,
    VarlenWorkspace,
    identity_block_table,
    varlen_attention,
)

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
NUM_SLOTS, MAX_SEQ_LEN = 257, 2048  # slot 0 padding + 256 requests
SCALE = HEAD_DIM**-0.5
PADDING_TOKENS = 3


def spans_of(count: int, length: int, seed: int, max_cached: int = MAX_SEQ_LEN) -> list[tuple[int, int, int]]:
    """`count` spans of `length` tokens on distinct slots after random cached prefixes; every
    fourth starts at position 0 (a first chunk, or a first decode step)."""
    generator = torch.Generator().manual_seed(seed)
    slots = (torch.randperm(NUM_SLOTS - 1, generator=generator)[:count] + 1).tolist()
    cached = torch.randint(0, min(max_cached, MAX_SEQ_LEN - length + 1), (count,), generator=generator).tolist()
    return [(slot, 0 if i % 4 == 3 else c, length) for i, (slot, c) in enumerate(zip(slots, cached))]


def mixed_spans(seed: int) -> list[tuple[int, int, int]]:
    """Decode rows, verify spans of 4 and prefill chunks of several lengths, on distinct slots."""
    spans = spans_of(48, 1, seed)
    spans += [(slot, cached, 4) for slot, cached, _ in spans_of(16, 4, seed + 1)]
    spans += [(slot, cached, length) for (slot, cached, _), length
              in zip(spans_of(6, 300, seed + 2, max_cached=1500), (300, 17, 129, 64, 1, 250))]
    slots = [slot for slot, *_ in spans]
    # Distinct slots, as an iteration has; redraw the few collisions between the groups.
    free = iter(sorted(set(range(1, NUM_SLOTS)) - set(slots)))
    seen: set[int] = set()
    unique = []
    for slot, cached, length in spans:
        slot = slot if slot not in seen else next(free)
        seen.add(slot)
        unique.append((slot, cached, length))
    return unique


CASES = {
    "decode-1": lambda seed: spans_of(1, 1, seed),
    "decode-64": lambda seed: spans_of(64, 1, seed),
    "decode-256": lambda seed: spans_of(256, 1, seed),
    "prefill-1x2048": lambda seed: [(1 + seed % 200, 0, 2048)],
    "prefill-64x128": lambda seed: spans_of(64, 128, seed),
    "mixed": mixed_spans,
}


@pytest.fixture(scope="module")
def cache():
    return random_cache(NUM_SLOTS, MAX_SEQ_LEN, KV_HEADS, HEAD_DIM, torch.bfloat16, DEVICE)


def attend(batch, k_cache, v_cache, table, workspace=None, backend=None, out=None, **options):
    q = batch["q"]
    out = torch.zeros(q.shape[0], HEADS * HEAD_DIM, dtype=q.dtype, device=DEVICE) if out is None else out
    args = {key: value for key, value in batch.items() if key != "covered"}
    return varlen_attention(k_cache=k_cache, v_cache=v_cache, block_table=table, scale=SCALE, out=out,
                            workspace=workspace, backend=backend, **args, **options)


def workspace_for(batch, spans):
    return VarlenWorkspace.for_buckets([(batch["q"].shape[0], len(spans))], HEADS, KV_HEADS, HEAD_DIM,
                                       MAX_SEQ_LEN, DEVICE)


@pytest.mark.parametrize("case, q_block", [(case, Q_BLOCK) for case in sorted(CASES)]
                         + [("decode-64", 1), ("decode-256", 1)])  # decode buckets may use 1-token blocks
def test_triton_matches_reference_bf16(case, q_block, cache):
    spans = CASES[case](seed=0)
    batch = flat_batch(spans, heads=HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16, device=DEVICE,
                       padding_tokens=PADDING_TOKENS, q_block=q_block)
    table = identity_block_table(NUM_SLOTS, MAX_SEQ_LEN, device=DEVICE)
    got = attend(batch, *cache, table, workspace=workspace_for(batch, spans), q_block=q_block)
    expected = attend(batch, *cache, table, backend="torch", q_block=q_block)
    covered = batch["covered"]
    assert (got[~covered] == 0).all()  # padding tokens untouched
    torch.testing.assert_close(got[covered], expected[covered], atol=2e-2, rtol=0)


@pytest.mark.parametrize("case, q_block", [("decode-1", 1), ("decode-256", 1), ("mixed", Q_BLOCK)])
def test_float8_cache_widens_to_bf16(case, q_block, cache):
    # The opt-in float8 cache (capture.model.kv_cache): the kernel reads it as the reference
    # reads the same values widened to bf16.
    spans = CASES[case](seed=4)
    batch = flat_batch(spans, heads=HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16, device=DEVICE,
                       padding_tokens=PADDING_TOKENS, q_block=q_block)
    table = identity_block_table(NUM_SLOTS, MAX_SEQ_LEN, device=DEVICE)
    float8 = [c.to(torch.float8_e4m3fn) for c in cache]
    got = attend(batch, *float8, table, workspace=workspace_for(batch, spans), q_block=q_block)
    expected = attend(batch, *(c.to(torch.bfloat16) for c in float8), table, backend="torch", q_block=q_block)
    covered = batch["covered"]
    torch.testing.assert_close(got[covered], expected[covered], atol=2e-2, rtol=0)


def test_permuted_block_table_reads_the_same_sequence(cache):
    spans = mixed_spans(seed=1)
    batch = flat_batch(spans, heads=HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    workspace = workspace_for(batch, spans)
    identity = attend(batch, *cache, identity_block_table(NUM_SLOTS, MAX_SEQ_LEN, device=DEVICE), workspace)
    (k_paged, table), (v_paged, _) = (permuted_pages(c, 16, seed=2) for c in cache)
    # Same keys in the same order through another table: the same kernel arithmetic.
    assert torch.equal(attend(batch, k_paged, v_paged, table, workspace), identity)
    # And with no table (each slot's contiguous rows, the engine's cache), computed not loaded.
    assert torch.equal(attend(batch, *cache, None, workspace), identity)


@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_triton_matches_reference_float32(num_splits):
    # Float32 dots run in IEEE precision (not tf32): reference accuracy.
    cache = random_cache(NUM_SLOTS, 512, KV_HEADS, HEAD_DIM, torch.float32, DEVICE)
    spans = [(5, 0, 40), (9, 200, 1), (17, 300, 5), (40, 511, 1), (41, 100, 33)]
    batch = flat_batch(spans, heads=HEADS, head_dim=HEAD_DIM, dtype=torch.float32, device=DEVICE)
    table = identity_block_table(NUM_SLOTS, 512, device=DEVICE)
    workspace = VarlenWorkspace(batch["q"].shape[0], HEADS, HEAD_DIM, num_splits, DEVICE)
    got = attend(batch, *cache, table, workspace, num_splits=num_splits)
    torch.testing.assert_close(got, attend(batch, *cache, table, backend="torch"), atol=1e-5, rtol=0)


@pytest.mark.parametrize("settled", [False, True])
@pytest.mark.parametrize("case", ["decode-1", "decode-64", "mixed"])
def test_captured_replays_like_eager(case, settled, cache):
    spans = CASES[case](seed=3)
    batch = flat_batch(spans, heads=HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16, device=DEVICE,
                       padding_tokens=PADDING_TOKENS)
    table = identity_block_table(NUM_SLOTS, MAX_SEQ_LEN, device=DEVICE)
    workspace = workspace_for(batch, spans)
    out = torch.zeros(batch["q"].shape[0], HEADS * HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    # As in the engine, the graph itself writes the step's positions and queries from staging:
    # positions two kernels before attention, queries just before it (so a settled launch
    # reads positions before its PDL wait and q after it).
    staged_pos, staged_q = batch["token_pos"].clone(), batch["q"].clone()

    def step():
        batch["token_pos"].copy_(staged_pos)
        batch["q"].copy_(staged_q)
        attend(batch, *cache, table, workspace, out=out, metadata_settled=settled)

    graph = capture_after_warmup(step)

    # Same slots and span lengths (so the same q-blocks), other cached prefixes and queries,
    # written into the staging tensors the graph reads.
    moved = [(slot, (cached * 7 + 131) % (MAX_SEQ_LEN - length + 1), length) for slot, cached, length in spans]
    fresh = flat_batch(moved, heads=HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16, device=DEVICE,
                       padding_tokens=PADDING_TOKENS, seed=9)
    assert torch.equal(fresh["q_block_start"], batch["q_block_start"])
    assert not torch.equal(fresh["token_pos"], batch["token_pos"])
    staged_pos.copy_(fresh["token_pos"])
    staged_q.copy_(fresh["q"])
    graph.replay()
    replayed = out.clone()
    step()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)
    expected = attend(batch, *cache, table, backend="torch")
    torch.testing.assert_close(replayed, expected, atol=2e-2, rtol=0)
