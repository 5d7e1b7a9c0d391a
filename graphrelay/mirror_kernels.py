"""The host mirror's device-side write: one fused Triton launch, and its pure-torch reference.

Both take the ring's arrays (`RingArrays`, device views of the mapped pinned ring) and a
device int64 counter `[1]`; they write ring slot `counter % depth` (batch rows, row count,
stamp = counter) and then increment the counter. Fixed shape in bs, no host sync: capturable.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl


class RingArrays(NamedTuple):
    """The mirror ring, one entry per field; dim 0 is the ring slot (`depth` of them)."""

    stamps: torch.Tensor  # [depth] int64: iteration last written there, -1 if none
    counts: torch.Tensor  # [depth] int64: rows written (the bucket size bs)
    slots: torch.Tensor  # [depth, max_batch] int64: pool slot per batch row, 0 = padding
    generation: torch.Tensor  # [depth, max_batch] int64: that slot's generation when written
    tokens: torch.Tensor  # [depth, max_batch] config token dtype
    seq_lens: torch.Tensor  # [depth, max_batch] config seq-len dtype
    accept_len: Optional[torch.Tensor]  # [depth, max_batch] or None
    confidence: Optional[torch.Tensor]  # [depth, max_batch, width], per-row shape flattened


def write_ring_torch(
    ring: RingArrays,
    counter: torch.Tensor,  # [1] int64
    indices: torch.Tensor,  # [bs] pool slots, 0 = padding
    generation: torch.Tensor,  # [max_reqs + 1] int64, the relay's device generation table
    tokens: torch.Tensor,  # [bs]
    seq_lens: torch.Tensor,  # [bs]
    accept_len: Optional[torch.Tensor],  # [bs] or None
    confidence: Optional[torch.Tensor],  # [bs, *shape] or None
) -> None:
    """Reference path (CPU, and a multi-launch fallback on CUDA)."""
    bs = indices.shape[0]
    ring_slot = counter.remainder(ring.stamps.shape[0])  # [1] int64, stays on the device
    writes = [
        (ring.slots, indices),
        (ring.generation, generation.index_select(0, indices)),
        (ring.tokens, tokens),
        (ring.seq_lens, seq_lens),
        (ring.accept_len, accept_len),
        (ring.confidence, confidence),
    ]
    for dst, src in writes:
        if dst is not None:
            # [1, bs, *rest] into the ring slot's first bs rows; cast on store
            dst[:, :bs].index_copy_(0, ring_slot, src.reshape(1, bs, *dst.shape[2:]).to(dst.dtype))
    ring.counts.index_fill_(0, ring_slot, bs)
    ring.stamps.index_copy_(0, ring_slot, counter)
    counter.add_(1)


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
    confidence_ptr,  # [bs, CONF_WIDTH]
    bs,
    depth,
    max_batch,
    HAS_ACCEPT: tl.constexpr,
    HAS_CONF: tl.constexpr,
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
        slot = tl.load(indices_ptr + rows, mask=live, other=0)
        slot_generation = tl.load(generation_ptr + slot, mask=live, other=0)
        tl.store(slots_out + base + rows, slot.to(tl.int64), mask=live)
        tl.store(generation_out + base + rows, slot_generation, mask=live)
        token = tl.load(tokens_ptr + rows, mask=live)
        tl.store(tokens_out + base + rows, token.to(tokens_out.dtype.element_ty), mask=live)
        seq_len = tl.load(seq_lens_ptr + rows, mask=live)
        tl.store(seq_lens_out + base + rows, seq_len.to(seq_lens_out.dtype.element_ty), mask=live)
        if HAS_ACCEPT:
            accepted = tl.load(accept_ptr + rows, mask=live)
            tl.store(accept_out + base + rows, accepted.to(accept_out.dtype.element_ty), mask=live)
        if HAS_CONF:
            cols = tl.arange(0, CONF_BLOCK)  # [CONF_BLOCK]
            cell = rows[:, None] * CONF_WIDTH + cols[None, :]  # [BLOCK, CONF_BLOCK]
            cell_live = live[:, None] & (cols[None, :] < CONF_WIDTH)
            value = tl.load(confidence_ptr + cell, mask=cell_live)
            tl.store(
                confidence_out + base * CONF_WIDTH + cell,
                value.to(confidence_out.dtype.element_ty),
                mask=cell_live,
            )
    tl.store(counts_ptr + ring_slot, bs)
    tl.store(stamps_ptr + ring_slot, iteration)
    tl.store(counter_ptr, iteration + 1)


def write_ring_triton(
    ring: RingArrays,
    counter: torch.Tensor,
    indices: torch.Tensor,
    generation: torch.Tensor,
    tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    accept_len: Optional[torch.Tensor],
    confidence: Optional[torch.Tensor],
) -> None:
    """Same contract as `write_ring_torch`, in one launch. Inputs must be contiguous.
    NOTE: the first call per bucket size compiles; warm it up before capture."""
    max_batch = ring.slots.shape[1]
    conf_width = ring.confidence.shape[2] if ring.confidence is not None else 1
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
        indices.shape[0],
        ring.stamps.shape[0],
        max_batch,
        HAS_ACCEPT=ring.accept_len is not None,
        HAS_CONF=ring.confidence is not None,
        CONF_WIDTH=conf_width,
        CONF_BLOCK=triton.next_power_of_2(conf_width),
        BLOCK=min(triton.next_power_of_2(max_batch), 128),
        MAX_BATCH=max_batch,
    )
