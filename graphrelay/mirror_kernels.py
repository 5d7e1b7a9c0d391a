"""The host mirror's device-side write in one fused Triton launch.

Imported only when a mirror first uses Triton (`graphrelay.backend.triton_module`). Same
contract as `graphrelay.reference.write_ring`: write ring slot `counter % depth` (batch rows,
row count, stamp = counter), then increment the device counter. Fixed shape in bs, no host
sync: capturable. Inputs may be any strided views; each is addressed through its strides.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from graphrelay.backend import CONTIGUOUS, strides_of
from graphrelay.kernels import offsets, to_dtype
from graphrelay.reference import RingArrays


@triton.jit
def _mirror_write_kernel(
    counter_ptr,  # [1] int64
    stamps_ptr,  # [depth] int64
    counts_ptr,  # [depth] int64
    slots_out,  # [depth, max_batch] int64
    generation_out,  # [depth, max_batch] int64
    tokens_out,  # [depth, max_batch]
    seq_lens_out,  # [depth, max_batch]
    accept_out,  # [depth, max_batch] (unused unless HAS_ACCEPT)
    confidence_out,  # [depth, max_batch, CONF_WIDTH] (unused unless HAS_CONF)
    indices_ptr,  # [bs]
    generation_ptr,  # [max_reqs + 1] int64
    tokens_ptr,  # [bs]
    seq_lens_ptr,  # [bs]
    accept_ptr,  # [bs]
    confidence_ptr,  # [bs, *shape]
    row_strides,  # (indices, tokens, seq_lens, accept_len) element strides
    conf_strides,  # (s0, s1, s2): see backend.strides_of
    bs,
    depth,
    max_batch,
    HAS_ACCEPT: tl.constexpr,
    HAS_CONF: tl.constexpr,
    CONF_MODE: tl.constexpr,
    CONF_WIDTH: tl.constexpr,
    CONF_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    MAX_BATCH: tl.constexpr,
):
    # NOTE: one program only. It reads the counter, writes every row, then bumps the counter;
    # with several programs one could bump it before another had read it.
    iteration = tl.load(counter_ptr)
    ring_slot = iteration % depth
    base = ring_slot * max_batch
    # A static loop over the largest bucket, masked to bs: Triton 3.6's interpreter cannot loop
    # over a runtime bound, and this keeps one compiled kernel per relay config.
    for start in tl.static_range(0, MAX_BATCH, BLOCK):
        rows = start + tl.arange(0, BLOCK)  # [BLOCK]
        live = rows < bs
        slot = tl.load(indices_ptr + rows * row_strides[0], mask=live, other=0)
        slot_generation = tl.load(generation_ptr + slot, mask=live, other=0)
        tl.store(slots_out + base + rows, slot.to(tl.int64), mask=live)
        tl.store(generation_out + base + rows, slot_generation, mask=live)
        token = tl.load(tokens_ptr + rows * row_strides[1], mask=live)
        tl.store(tokens_out + base + rows, to_dtype(token, tokens_out.dtype.element_ty), mask=live)
        seq_len = tl.load(seq_lens_ptr + rows * row_strides[2], mask=live)
        tl.store(seq_lens_out + base + rows, to_dtype(seq_len, seq_lens_out.dtype.element_ty), mask=live)
        if HAS_ACCEPT:
            accepted = tl.load(accept_ptr + rows * row_strides[3], mask=live)
            tl.store(accept_out + base + rows, to_dtype(accepted, accept_out.dtype.element_ty), mask=live)
        if HAS_CONF:
            cols = tl.arange(0, CONF_BLOCK)  # [CONF_BLOCK]
            cell_live = live[:, None] & (cols[None, :] < CONF_WIDTH)
            src = offsets(rows[:, None], cols[None, :], conf_strides, CONF_MODE, CONF_WIDTH)  # [BLOCK, CONF_BLOCK]
            value = tl.load(confidence_ptr + src, mask=cell_live)
            tl.store(
                confidence_out + base * CONF_WIDTH + rows[:, None] * CONF_WIDTH + cols[None, :],
                to_dtype(value, confidence_out.dtype.element_ty),
                mask=cell_live,
            )
    tl.store(counts_ptr + ring_slot, bs)
    tl.store(stamps_ptr + ring_slot, iteration)
    tl.store(counter_ptr, iteration + 1)


def write_ring(
    ring: RingArrays,
    counter: torch.Tensor,
    indices: torch.Tensor,
    generation: torch.Tensor,
    tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    accept_len: Optional[torch.Tensor],
    confidence: Optional[torch.Tensor],
) -> None:
    """`reference.write_ring` in one launch.
    NOTE: the first call per bucket size compiles; warm it up before capture."""
    max_batch = ring.slots.shape[1]
    conf_width = ring.confidence.shape[2] if ring.confidence is not None else 1
    conf_mode, conf_strides = (CONTIGUOUS, (0, 0, 0)) if confidence is None else strides_of(confidence, confidence.shape[1:])
    row_strides = tuple(t.stride(0) if t is not None else 0 for t in (indices, tokens, seq_lens, accept_len))
    _mirror_write_kernel[(1,)](
        counter,
        ring.stamps,
        ring.counts,
        ring.slots,
        ring.generation,
        ring.tokens,
        ring.seq_lens,
        ring.accept_len if ring.accept_len is not None else ring.tokens,
        ring.confidence if ring.confidence is not None else ring.tokens,
        indices,
        generation,
        tokens,
        seq_lens,
        accept_len if accept_len is not None else tokens,
        confidence if confidence is not None else tokens,
        row_strides,
        conf_strides,
        indices.shape[0],
        ring.stamps.shape[0],
        max_batch,
        HAS_ACCEPT=ring.accept_len is not None,
        HAS_CONF=ring.confidence is not None,
        CONF_MODE=conf_mode,
        CONF_WIDTH=conf_width,
        CONF_BLOCK=triton.next_power_of_2(conf_width),
        BLOCK=min(triton.next_power_of_2(max_batch), 128),
        MAX_BATCH=max_batch,
    )
