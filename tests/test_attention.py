"""Slot-cache attention on CPU: the Triton decode kernel under the interpreter against the
torch reference, the reference against a per-row loop, prefill against decode row by row,
and the reference's capturability (no host reads, same ops whatever the values)."""

from __future__ import annotations

import math

import pytest
import torch

from graphrelay.capture.kernels.attention import (
    MAX_SPLITS,
    AttentionWorkspace,
    decode_attention,
    decode_attention_reference,
    pick_num_splits,
    prefill_attention,
)
from attention_cases import naive_attention
from graphrelay.lint import lint_step

MAX_SEQ_LEN = 200  # 4 key blocks of 64: the last is partial
NUM_SLOTS = 6  # slot 0 padding + 5 requests

# (slot, position) per row: both ends of the cache, padding rows on slot 0, and three
# verify-style causal rows sharing slot 2 at consecutive positions.
ROWS = [(1, 0), (2, 61), (2, 62), (2, 63), (0, 0), (3, MAX_SEQ_LEN - 1), (4, 64), (5, 130), (0, 0)]
SHAPES = [(9, 3, 64), (4, 2, 16)]  # (heads, kv_heads, head_dim): SmolLM2's GQA, and a small one
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_cache(kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_SLOTS, MAX_SEQ_LEN, kv_heads, head_dim)
    return (torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype))


def make_rows(heads: int, head_dim: int, dtype: torch.dtype, rows=ROWS, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(len(rows), heads, head_dim, generator=generator).to(dtype)  # [n, h, d]
    slots, positions = (torch.tensor(column) for column in zip(*rows))
    return q, slots, positions


# ----------------------------------------------------------------------------------------------
# Triton decode kernel (interpreted) against the reference


@pytest.mark.parametrize("num_splits", [1, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", SHAPES)
def test_triton_decode_matches_reference(heads, kv_heads, head_dim, dtype, num_splits):
    # 3 interleaved splits over 4 blocks: the row at position 0 leaves splits 1 and 2 empty,
    # position 64 leaves split 2 empty; 5 splits leave split 4 empty for every row.
    k_cache, v_cache = make_cache(kv_heads, head_dim, dtype)
    q, slots, positions = make_rows(heads, head_dim, dtype)
    scale = head_dim**-0.5
    expected = decode_attention_reference(q, k_cache, v_cache, slots, positions, scale=scale)
    got = decode_attention(q, k_cache, v_cache, slots, positions, scale=scale,
                           backend="triton", num_splits=num_splits)
    assert got.dtype == dtype and got.shape == (len(ROWS), heads * head_dim)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=0)


def test_triton_decode_writes_out_and_uses_workspace():
    heads, kv_heads, head_dim = SHAPES[0]
    k_cache, v_cache = make_cache(kv_heads, head_dim, torch.float32)
    q, slots, positions = make_rows(heads, head_dim, torch.float32)
    n = q.shape[0]
    # Larger than needed: calls take prefixes of its buffers.
    workspace = AttentionWorkspace(n + 3, heads, head_dim, 4, "cpu")
    workspace.lse.fill_(float("nan"))
    out = torch.full((n, heads * head_dim), float("nan"))
    got = decode_attention(q, k_cache, v_cache, slots.int(), positions.int(), scale=0.125, out=out,
                           workspace=workspace, backend="triton", num_splits=4)
    assert got is out
    expected = decode_attention_reference(q, k_cache, v_cache, slots, positions, scale=0.125)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    # The split pass wrote the prefix [n, h, 4] of the lse buffer and nothing past it.
    assert not workspace.lse[: n * heads * 4].isnan().any()
    assert workspace.lse[n * heads * 4:].isnan().all()


def test_triton_decode_reads_strided_q():
    # q as split out of a fused qkv projection: row stride (h + 2 kvh) * d, not h * d.
    heads, kv_heads, head_dim = SHAPES[1]
    k_cache, v_cache = make_cache(kv_heads, head_dim, torch.float32)
    _, slots, positions = make_rows(heads, head_dim, torch.float32)
    qkv = torch.randn(len(ROWS), (heads + 2 * kv_heads) * head_dim)
    q = qkv[:, : heads * head_dim].view(len(ROWS), heads, head_dim)
    assert not q.is_contiguous()
    got = decode_attention(q, k_cache, v_cache, slots, positions, scale=0.25, backend="triton", num_splits=2)
    expected = decode_attention_reference(q.contiguous(), k_cache, v_cache, slots, positions, scale=0.25)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_dispatch_defaults_to_reference_on_cpu():
    heads, kv_heads, head_dim = SHAPES[1]
    k_cache, v_cache = make_cache(kv_heads, head_dim, torch.float32)
    q, slots, positions = make_rows(heads, head_dim, torch.float32)
    expected = decode_attention_reference(q, k_cache, v_cache, slots, positions, scale=0.25)
    assert torch.equal(decode_attention(q, k_cache, v_cache, slots, positions, scale=0.25), expected)


# ----------------------------------------------------------------------------------------------
# The reference against an independent oracle


@pytest.mark.parametrize("heads, kv_heads, head_dim", SHAPES)
def test_reference_matches_naive_loop(heads, kv_heads, head_dim):
    k_cache, v_cache = make_cache(kv_heads, head_dim, torch.float32, seed=2)
    q, slots, positions = make_rows(heads, head_dim, torch.float32, seed=3)
    scale = head_dim**-0.5
    expected = naive_attention(q, k_cache, v_cache, slots, positions, scale).float()
    got = decode_attention_reference(q, k_cache, v_cache, slots, positions, scale=scale)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_reference_max_len_bounds_the_gather():
    heads, kv_heads, head_dim = SHAPES[1]
    k_cache, v_cache = make_cache(kv_heads, head_dim, torch.float32)
    rows = [(1, 0), (2, 30), (0, 0), (2, 31)]
    q, slots, positions = make_rows(heads, head_dim, torch.float32, rows=rows)
    expected = naive_attention(q, k_cache, v_cache, slots, positions, 0.25).float()
    got = decode_attention(q, k_cache, v_cache, slots, positions, scale=0.25, max_len=32)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="max_len"):
        decode_attention(q, k_cache, v_cache, slots, positions, scale=0.25, max_len=MAX_SEQ_LEN + 1)


# ----------------------------------------------------------------------------------------------
# Prefill against decode, row by row


@pytest.mark.parametrize("key_len", [None, 45])
@pytest.mark.parametrize("heads, kv_heads, head_dim", SHAPES)
def test_prefill_matches_decode_per_token(heads, kv_heads, head_dim, key_len):
    k_cache, v_cache = make_cache(kv_heads, head_dim, torch.float32, seed=4)
    # A first chunk, a second chunk (starts > 0) shorter than the padded T, and an
    # all-padding entry on slot 0. max(starts + lengths) = 45.
    slots, starts, lengths = torch.tensor([1, 3, 0]), torch.tensor([0, 40, 0]), torch.tensor([6, 5, 0])
    chunk = 6
    q = torch.randn(3, chunk, heads, head_dim, generator=torch.Generator().manual_seed(5))
    scale = head_dim**-0.5
    got = prefill_attention(q, k_cache, v_cache, slots, starts, lengths, scale=scale, key_len=key_len)
    assert got.shape == (3, chunk, heads * head_dim)
    assert torch.isfinite(got).all()  # padding rows included: nothing NaN can leak
    for b in range(3):
        for t in range(int(lengths[b])):
            expected = decode_attention_reference(
                q[b, t][None], k_cache, v_cache, slots[b : b + 1], starts[b : b + 1] + t, scale=scale
            )
            torch.testing.assert_close(got[b, t], expected[0], atol=1e-5, rtol=0)


def test_prefill_padding_rows_ignore_unwritten_keys():
    heads, kv_heads, head_dim = SHAPES[1]
    k_cache, v_cache = make_cache(kv_heads, head_dim, torch.float32)
    q = torch.randn(1, 4, heads, head_dim)
    args = (torch.tensor([2]), torch.tensor([10]), torch.tensor([2]))
    before = prefill_attention(q, k_cache, v_cache, *args, scale=0.25)
    # Positions past the chunk's last real token (11) hold stale data: make it huge (finite,
    # as stale cache rows are; masked keys get probability 0, and 0 * NaN would be NaN).
    k_cache[2, 12:] = 1e4
    v_cache[2, 12:] = 1e4
    after = prefill_attention(q, k_cache, v_cache, *args, scale=0.25)
    assert torch.equal(before, after)


# ----------------------------------------------------------------------------------------------
# Capturability, split heuristic, argument checks


def test_reference_is_capturable():
    heads, kv_heads, head_dim = SHAPES[1]
    k_cache, v_cache = make_cache(kv_heads, head_dim, torch.float32)
    q, slots, positions = make_rows(heads, head_dim, torch.float32)
    out = torch.empty(len(ROWS), heads * head_dim)

    def step(q, slots, positions):
        return decode_attention(q, k_cache, v_cache, slots, positions, scale=0.25, out=out)

    # Other values (still in range) must run the same ops with the same shapes.
    alt = (q.flip(0), slots.flip(0), (positions * 7 + 3) % MAX_SEQ_LEN)
    report = lint_step(step, (q, slots, positions), alt_inputs=alt)
    assert report.ok, report.findings
    assert report.ops_recorded > 0


def test_pick_num_splits_depends_on_static_shapes_only():
    # SmolLM2 on an H200 (132 SMs), 2048-token cache.
    assert pick_num_splits(1, 3, 2048, 132) == MAX_SPLITS
    assert pick_num_splits(64, 3, 2048, 132) == 3
    assert pick_num_splits(256, 3, 2048, 132) == 1
    # Never more splits than pairs of key blocks, never fewer than one.
    assert pick_num_splits(1, 3, 256, 132) == 2
    assert pick_num_splits(1, 3, 64, 132) == 1
    counts = [pick_num_splits(n, 3, 2048, 132) for n in range(1, 257)]
    assert counts == sorted(counts, reverse=True)


def test_workspace_caps_the_heuristic():
    heads, kv_heads, head_dim = SHAPES[1]
    k_cache, v_cache = make_cache(kv_heads, head_dim, torch.float32)
    q, slots, positions = make_rows(heads, head_dim, torch.float32)
    small = AttentionWorkspace(len(ROWS), heads, head_dim, 2, "cpu")
    with pytest.raises(ValueError, match="2 splits"):
        decode_attention(q, k_cache, v_cache, slots, positions, scale=0.25, workspace=small,
                         backend="triton", num_splits=3)
    wrong = AttentionWorkspace(len(ROWS), heads + 1, head_dim, 4, "cpu")
    with pytest.raises(ValueError, match="heads"):
        decode_attention(q, k_cache, v_cache, slots, positions, scale=0.25, workspace=wrong,
                         backend="triton", num_splits=3)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "q": a["q"].double()}, "k_cache and v_cache must both be torch.float64 for q of torch.float64"),
        (lambda a: {**a, "slots": a["slots"].float()}, "slots must be int32 or int64"),
        (lambda a: {**a, "positions": a["positions"][:-1]}, "positions must be"),
        (lambda a: {**a, "q": torch.stack((a["q"], a["q"]), dim=-1)[..., 0]}, "unit-stride"),
        (lambda a: {**a, "q": a["q"][:, :, :8].contiguous(), "k_cache": a["k_cache"][..., :8].contiguous(),
                    "v_cache": a["v_cache"][..., :8].contiguous()}, "power of two >= 16"),
        (lambda a: {**a, "out": torch.empty(3, 4)}, "out must be"),
        (lambda a: {**a, "backend": "cuda"}, "backend must be"),
        (lambda a: {**a, "num_splits": 0}, "num_splits"),
    ],
)
def test_decode_rejects_bad_arguments(change, match):
    heads, kv_heads, head_dim = SHAPES[1]
    k_cache, v_cache = make_cache(kv_heads, head_dim, torch.float32)
    q, slots, positions = make_rows(heads, head_dim, torch.float32)
    args = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "slots": slots, "positions": positions,
            "backend": "triton"}
    with pytest.raises(ValueError, match=match):
        decode_attention(**change(args), scale=1 / math.sqrt(head_dim))
