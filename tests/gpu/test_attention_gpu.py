"""The Triton decode kernel on a GPU at SmolLM2-135M's attention shape (9 query heads, 3 KV
heads, head_dim 64, bf16) against the torch reference, and captured into a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from attention_cases import capture_after_warmup
from graphrelay.capture.kernels.attention import (
    MAX_SPLITS,
    AttentionWorkspace,
    decode_attention,
    decode_attention_reference,
    prefill_attention,
)

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
MAX_REQS, MAX_SEQ_LEN, MAX_CONTEXT = 256, 1024, 640
SCALE = HEAD_DIM**-0.5


def make_cache(dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator(DEVICE).manual_seed(seed)
    shape = (MAX_REQS + 1, MAX_SEQ_LEN, KV_HEADS, HEAD_DIM)
    return tuple(torch.randn(shape, generator=generator, device=DEVICE).to(dtype) for _ in range(2))


def make_batch(bs: int, dtype: torch.dtype, seed: int = 1):
    """bs rows on distinct slots with contexts up to MAX_CONTEXT; every 8th row is padding."""
    generator = torch.Generator(DEVICE).manual_seed(seed)
    q = torch.randn(bs, HEADS, HEAD_DIM, generator=generator, device=DEVICE).to(dtype)  # [bs, h, d]
    slots = torch.randperm(MAX_REQS, generator=generator, device=DEVICE)[:bs] + 1
    positions = torch.randint(0, MAX_CONTEXT, (bs,), generator=generator, device=DEVICE)
    padding = torch.arange(bs, device=DEVICE) % 8 == 7
    return q, torch.where(padding, 0, slots), torch.where(padding, 0, positions)


@pytest.mark.parametrize("with_workspace", [False, True])
@pytest.mark.parametrize("bs", [1, 64, 256])
def test_triton_matches_reference_bf16(bs, with_workspace):
    k_cache, v_cache = make_cache(torch.bfloat16)
    q, slots, positions = make_batch(bs, torch.bfloat16)
    workspace = AttentionWorkspace(bs, HEADS, HEAD_DIM, MAX_SPLITS, DEVICE) if with_workspace else None
    got = decode_attention(q, k_cache, v_cache, slots, positions, scale=SCALE, workspace=workspace)
    expected = decode_attention_reference(q, k_cache, v_cache, slots, positions, scale=SCALE)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=0)


@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_triton_matches_reference_float32(num_splits):
    # Float32 dots run in IEEE precision (not tf32): reference accuracy.
    k_cache, v_cache = make_cache(torch.float32)
    q, slots, positions = make_batch(16, torch.float32)
    got = decode_attention(q, k_cache, v_cache, slots, positions, scale=SCALE, num_splits=num_splits)
    expected = decode_attention_reference(q, k_cache, v_cache, slots, positions, scale=SCALE)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("bs", [1, 4, 256])  # 8, 8 and 1 splits at a 1024-key cache on 132 SMs
def test_captured_decode_replays_like_eager(bs):
    k_cache, v_cache = make_cache(torch.bfloat16)
    q, slots, positions = make_batch(bs, torch.bfloat16)
    workspace = AttentionWorkspace(MAX_REQS, HEADS, HEAD_DIM, MAX_SPLITS, DEVICE)
    out = torch.empty(bs, HEADS * HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)

    def step():
        decode_attention(q, k_cache, v_cache, slots, positions, scale=SCALE, out=out, workspace=workspace)

    graph = capture_after_warmup(step)

    # New contexts, longer and shorter than the captured ones, written into the same tensors.
    generator = torch.Generator(DEVICE).manual_seed(7)
    positions.copy_(torch.randint(0, MAX_SEQ_LEN, (bs,), generator=generator, device=DEVICE))
    q.copy_(torch.randn(q.shape, generator=generator, device=DEVICE).to(q.dtype))
    graph.replay()
    replayed = out.clone()
    step()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)
    expected = decode_attention_reference(q, k_cache, v_cache, slots, positions, scale=SCALE)
    torch.testing.assert_close(replayed, expected, atol=2e-2, rtol=0)


def test_prefill_bf16_matches_decode_reference():
    k_cache, v_cache = make_cache(torch.bfloat16)
    slots = torch.tensor([3, 9, 0], device=DEVICE)
    starts = torch.tensor([0, 300, 0], device=DEVICE)
    lengths = torch.tensor([128, 77, 0], device=DEVICE)
    q = torch.randn(3, 128, HEADS, HEAD_DIM, device=DEVICE).to(torch.bfloat16)
    got = prefill_attention(q, k_cache, v_cache, slots, starts, lengths, scale=SCALE, key_len=377)
    assert torch.isfinite(got).all()
    for b, (start, length) in enumerate(((0, 128), (300, 77))):
        rows = torch.arange(length, device=DEVICE)
        expected = decode_attention_reference(
            q[b, :length], k_cache, v_cache, slots[b].expand(length), start + rows, scale=SCALE
        )
        torch.testing.assert_close(got[b, :length], expected, atol=2e-2, rtol=0)
