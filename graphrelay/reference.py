"""Pure-torch relay and mirror ops: the CPU path and the reference the Triton kernels must equal.

Same semantics as `graphrelay.kernels` and `graphrelay.mirror_kernels`, in fixed-shape torch
ops (no host syncs, no data-dependent shapes), so this path is capturable too, and needs no
Triton. Padding row 0 is read like any row and never written; an out-of-range index is
clamped to row 0. Torch ops address strided views correctly by themselves.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from graphrelay import debug


def _safe_slots(idx: torch.Tensor, max_reqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots clamped into [0, max_reqs] with bad ones sent to row 0, in-range mask) [bs]."""
    idx = idx.long()
    in_range = (idx >= 0) & (idx <= max_reqs)
    return torch.where(in_range, idx, torch.zeros_like(idx)), in_range


def _record_first_error(err: torch.Tensor, codes: torch.Tensor, slots: torch.Tensor, field_ids: torch.Tensor) -> None:
    """Debug: keep the first (lowest batch row) nonzero code, unless an error is already held.
    All tensors [n]; fixed shape, no sync."""
    bad = codes != 0
    first = torch.argmax(bad.to(torch.int8))  # first True, or 0 when none
    record = torch.stack([codes[first], slots[first], field_ids[first], err[3]]).to(err.dtype)
    take = (err[0] == 0) & bad.any()
    err.copy_(torch.where(take, record, err))


def _check_range(err: torch.Tensor, idx: torch.Tensor, in_range: torch.Tensor) -> None:
    code = torch.where(in_range, 0, debug.ERR_OUT_OF_RANGE)
    _record_first_error(err, code, idx.long(), torch.full_like(code, debug.ERR_FIELD_INDICES))


def _consume(state: torch.Tensor, err: torch.Tensor, slots: torch.Tensor, live: torch.Tensor, field_ids: tuple[int, ...]) -> None:
    """Debug consume-once: every live row must be FRESH in each read field; mark them CONSUMED."""
    states = state[slots]  # [bs, n_fields]
    for field_id in field_ids:
        s = states[:, field_id]
        code = torch.where(s == debug.UNWRITTEN, debug.ERR_UNWRITTEN, debug.ERR_CONSUMED)
        code = torch.where(live & (s != debug.FRESH), code, 0)
        _record_first_error(err, code, slots, torch.full_like(code, field_id))
        states[:, field_id] = torch.where(live, debug.CONSUMED, s)
    state.index_copy_(0, slots, states)


def gather(idx, bufs, outs, field_ids: tuple[int, ...], state, err, max_reqs: int, debug_mode: bool) -> None:
    """outs[f][i] = bufs[f][idx[i]] for every field f, cast to outs[f].dtype."""
    slots, in_range = _safe_slots(idx, max_reqs)
    for buf, out in zip(bufs, outs):
        out.copy_(buf.index_select(0, slots))
    if debug_mode:
        _check_range(err, idx, in_range)
        _consume(state, err, slots, slots != 0, field_ids)


def scatter(idx, srcs, bufs, field_ids: tuple[int, ...], state, err, max_reqs: int, debug_mode: bool) -> None:
    """bufs[f][idx[i]] = srcs[f][i] cast to the buffer dtype, for every row whose slot is not 0."""
    slots, in_range = _safe_slots(idx, max_reqs)
    live = slots != 0
    for src, buf in zip(srcs, bufs):
        current = buf.index_select(0, slots)
        keep = live.view(-1, *([1] * (buf.dim() - 1)))
        # Rows for slot 0 write back what row 0 already holds: duplicates agree, row 0 is unchanged.
        buf.index_copy_(0, slots, torch.where(keep, src.to(buf.dtype), current))
    if debug_mode:
        _check_range(err, idx, in_range)
        states = state[slots]
        for field_id in field_ids:
            states[:, field_id] = torch.where(live, debug.FRESH, states[:, field_id])
        state.index_copy_(0, slots, states)


# ---- the host mirror's ring write -------------------------------------------------------------


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


def write_ring(
    ring: RingArrays,
    counter: torch.Tensor,  # [1] int64
    indices: torch.Tensor,  # [bs] pool slots, 0 = padding
    generation: torch.Tensor,  # [max_reqs + 1] int64, the relay's device generation table
    tokens: torch.Tensor,  # [bs]
    seq_lens: torch.Tensor,  # [bs]
    accept_len: Optional[torch.Tensor],  # [bs] or None
    confidence: Optional[torch.Tensor],  # [bs, *shape] or None
) -> None:
    """Write ring slot `counter % depth` (batch rows, row count, stamp = counter), casting on
    store, then increment the counter."""
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
