"""Pure-torch relay ops: the CPU path and the reference the Triton kernels must equal.

Same semantics as `graphrelay.kernels`, in fixed-shape torch ops (no host syncs, no
data-dependent shapes), so this path is capturable too. Padding row 0 is read like any row
and never written; an out-of-range index is clamped to row 0.
"""

from __future__ import annotations

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


def _consume(state: torch.Tensor, err: torch.Tensor, slots: torch.Tensor, live: torch.Tensor, field_ids: tuple[int, int]) -> None:
    """Debug consume-once: every live row must be FRESH in both groups; mark them CONSUMED."""
    states = state[slots]  # [bs, 2]
    for group, field_id in enumerate(field_ids):
        s = states[:, group]
        code = torch.where(s == debug.UNWRITTEN, debug.ERR_UNWRITTEN, debug.ERR_CONSUMED)
        code = torch.where(live & (s != debug.FRESH), code, 0)
        _record_first_error(err, code, slots, torch.full_like(code, field_id))
    consumed = torch.full_like(states, debug.CONSUMED)
    state.index_copy_(0, slots, torch.where(live[:, None], consumed, states))


def gather(idx, bufs, outs, state, err, max_reqs: int, publish_field_id: int, debug_mode: bool) -> None:
    """outs[f][i] = bufs[f][idx[i]] for every field f, cast to outs[f].dtype."""
    slots, in_range = _safe_slots(idx, max_reqs)
    for buf, out in zip(bufs, outs):
        out.copy_(buf.index_select(0, slots))
    if debug_mode:
        _check_range(err, idx, in_range)
        _consume(state, err, slots, slots != 0, (0, publish_field_id))


def scatter(idx, srcs, bufs, groups: tuple[int, ...], state, err, max_reqs: int, debug_mode: bool) -> None:
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
        for group in groups:
            states[:, group] = torch.where(live, debug.FRESH, states[:, group])
        state.index_copy_(0, slots, states)
