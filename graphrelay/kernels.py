"""Fused Triton kernels: one launch gathers every field, one launch scatters any set of them.

Both kernels walk the relay's field table as tuples of tensors. The grid is
`(batch rows, chunks)`: each field's row is split into chunks of BLOCKS[f] elements (at most
`chunk_bytes(bs)`), and program `(i, c)` copies one chunk of one field for batch row `i`, casting
to the destination dtype on store. Wide fields (hidden states) thus spread over several
programs instead of one program looping, which is what a batch of 1 needs to be fast.
Slot 0 is the padding row: gathers read it (it holds the fill values), scatters to it are
dropped, so no padded batch row can change rows 1..max_reqs. An out-of-range index is clamped
to row 0 (and recorded in debug mode) rather than touching memory outside the buffers.

The pure-torch twin of these semantics is `graphrelay.reference`; tests demand bit-equality.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphrelay import debug

# Debug-mode codes as compile-time constants (jit functions may only read constexpr globals).
_FRESH = tl.constexpr(debug.FRESH)
_CONSUMED = tl.constexpr(debug.CONSUMED)
_UNWRITTEN = tl.constexpr(debug.UNWRITTEN)
_ERR_UNWRITTEN = tl.constexpr(debug.ERR_UNWRITTEN)
_ERR_CONSUMED = tl.constexpr(debug.ERR_CONSUMED)
_ERR_OUT_OF_RANGE = tl.constexpr(debug.ERR_OUT_OF_RANGE)
_ERR_FIELD_INDICES = tl.constexpr(debug.ERR_FIELD_INDICES)


@triton.jit
def _to_dtype(v, ty: tl.constexpr):
    """Cast `v` to `ty`, rounding float32 -> bfloat16 to nearest-even explicitly.

    NOTE: Triton's interpreter truncates fp32 -> bf16 while torch and the GPU round to
    nearest even; doing the rounding in integer ops makes every path agree bit for bit.
    """
    if ty == tl.bfloat16:
        if v.dtype.is_floating():
            bits = v.to(tl.float32).to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            # NaN stays NaN (a NaN's exact bits differ between torch's CPU and CUDA casts too).
            rounded = tl.where(v != v, 0x7FFF, rounded)
            return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return v.to(tl.float32).to(tl.bfloat16)
    else:
        return v.to(ty)


@triton.jit
def _copy_chunk(src, src_row, dst, dst_row, chunk, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """dst[dst_row, chunk*BLOCK : ...] = src[src_row, same] (row-major rows of WIDTH elements)."""
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < WIDTH
    v = tl.load(src + src_row * WIDTH + offs, mask=mask)
    tl.store(dst + dst_row * WIDTH + offs, _to_dtype(v, dst.dtype.element_ty), mask=mask)


@triton.jit
def _copy_fields(srcs, src_row, dsts, dst_row, c, WIDTHS: tl.constexpr, BLOCKS: tl.constexpr, STARTS: tl.constexpr):
    """Program column `c` copies one chunk of one field: field f owns columns
    STARTS[f] .. STARTS[f + 1] - 1, one per BLOCKS[f] elements of its row."""
    for f in tl.static_range(len(WIDTHS)):
        if (c >= STARTS[f]) & (c < STARTS[f + 1]):
            _copy_chunk(srcs[f], src_row, dsts[f], dst_row, c - STARTS[f], WIDTHS[f], BLOCKS[f])


@triton.jit
def _record_error(err_ptr, code, slot, field_id):
    """Keep the first error: [code, slot, field_id]."""
    if tl.atomic_cas(err_ptr, 0, code) == 0:
        tl.store(err_ptr + 1, slot)
        tl.store(err_ptr + 2, field_id)


@triton.jit
def _load_slot(idx_ptr, i, f, max_reqs, err_ptr, DEBUG: tl.constexpr):
    """Slot index of batch row i, clamped to padding row 0 when out of range."""
    slot = tl.load(idx_ptr + i).to(tl.int64)
    in_range = (slot >= 0) & (slot <= max_reqs)
    if DEBUG:
        if (f == 0) & (in_range == 0):  # one report per bad row
            _record_error(err_ptr, _ERR_OUT_OF_RANGE, slot.to(tl.int32), _ERR_FIELD_INDICES)
    return tl.where(in_range, slot, 0)


@triton.jit
def _consume(state_ptr, err_ptr, slot, group: tl.constexpr, field_id: tl.constexpr):
    """Debug: demand a FRESH row for `group`, then mark it CONSUMED."""
    state = tl.load(state_ptr + slot * 2 + group)
    if state != _FRESH:
        code = tl.where(state == _UNWRITTEN, _ERR_UNWRITTEN, _ERR_CONSUMED)
        _record_error(err_ptr, code, slot.to(tl.int32), field_id)
    tl.store(state_ptr + slot * 2 + group, _CONSUMED)


@triton.jit
def gather_kernel(
    idx_ptr,  # [bs] slot per batch row
    bufs,  # tuple: relay buffers [rows, width_f]
    outs,  # tuple: outputs [bs, width_f]
    state_ptr,  # [rows, 2] int8 debug states
    err_ptr,  # [4] int32 debug error record
    max_reqs,
    WIDTHS: tl.constexpr,
    BLOCKS: tl.constexpr,
    STARTS: tl.constexpr,  # first chunk column of each field, then the total
    PUBLISH_FIELD_ID: tl.constexpr,  # error attribution for the publish group
    DEBUG: tl.constexpr,
):
    i = tl.program_id(0)
    c = tl.program_id(1)
    slot = _load_slot(idx_ptr, i, c, max_reqs, err_ptr, DEBUG)
    _copy_fields(bufs, slot, outs, i, c, WIDTHS, BLOCKS, STARTS)
    if DEBUG:
        # One program per batch row owns the consume-once bookkeeping; padding is exempt.
        if (c == 0) & (slot != 0):
            _consume(state_ptr, err_ptr, slot, 0, 0)
            _consume(state_ptr, err_ptr, slot, 1, PUBLISH_FIELD_ID)


@triton.jit
def scatter_kernel(
    idx_ptr,  # [bs]
    srcs,  # tuple: payload tensors [bs, width_f]
    bufs,  # tuple: relay buffers [rows, width_f]
    state_ptr,
    err_ptr,
    max_reqs,
    WIDTHS: tl.constexpr,
    BLOCKS: tl.constexpr,
    STARTS: tl.constexpr,
    GROUPS: tl.constexpr,  # tuple of groups this launch writes (0 stash, 1 publish)
    DEBUG: tl.constexpr,
):
    i = tl.program_id(0)
    c = tl.program_id(1)
    slot = _load_slot(idx_ptr, i, c, max_reqs, err_ptr, DEBUG)
    if slot != 0:  # writes to padding row 0 are dropped: it must keep its fill values
        _copy_fields(srcs, i, bufs, slot, c, WIDTHS, BLOCKS, STARTS)
        if DEBUG:
            if c == 0:
                for g in tl.static_range(len(GROUPS)):
                    tl.store(state_ptr + slot * 2 + GROUPS[g], _FRESH)


NUM_WARPS = 4  # per program


def chunk_bytes(bs: int) -> int:
    """Bytes one program copies. Small batches want many programs (a batch of 1 would leave
    most of the GPU idle); large ones want fewer, fatter programs (less block scheduling).
    Measured on an H200, EAGLE fields: 2 KiB is best up to ~64 rows, 4 KiB above."""
    return 2048 if bs <= 64 else 4096


class Layout(tuple):
    """(WIDTHS, BLOCKS, STARTS) constexpr tuples for a list of (width, itemsize) fields split in
    chunks of at most `max_bytes`, and the grid's chunk count `STARTS[-1]`."""

    @classmethod
    def of(cls, fields: list[tuple[int, int]], max_bytes: int) -> "Layout":
        widths = tuple(w for w, _ in fields)
        blocks = tuple(min(triton.next_power_of_2(w), max(1, max_bytes // size)) for w, size in fields)
        starts = [0]
        for w, b in zip(widths, blocks):
            starts.append(starts[-1] + triton.cdiv(w, b))
        return cls((widths, blocks, tuple(starts)))

    @property
    def chunks(self) -> int:
        return self[2][-1]
