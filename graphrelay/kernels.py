"""Fused Triton kernels: one launch gathers any set of fields, one launch scatters any set.

Imported only when the Triton backend is first used (`graphrelay.backend.triton_module`).
Both kernels walk the relay's field table as tuples of tensors. The grid is
`(batch rows, chunks)`: each field's row is split into chunks of BLOCKS[f] elements (at most
`backend.chunk_bytes(bs)`), and program `(i, c)` copies one chunk of one field for batch row
`i`, casting to the destination dtype on store. Wide fields (hidden states) thus spread over
several programs instead of one program looping, which is what a batch of 1 needs to be fast.
Slot 0 is the padding row: gathers read it (it holds the fill values), scatters to it are
dropped, so no padded batch row can change rows 1..max_reqs. An out-of-range index is clamped
to row 0 (and recorded in debug mode) rather than touching memory outside the buffers.

Caller tensors (indices, payloads, `out=` buffers) may be any strided view: each comes with
a stride descriptor (`backend.strides_of`), so a view is addressed where it really lives
rather than as if it were contiguous; the relay's own buffers are always contiguous.

The pure-torch twin of these semantics is `graphrelay.reference`; tests demand bit-equality.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphrelay import backend, debug

# Compile-time constants (jit functions may only read constexpr globals).
_FRESH = tl.constexpr(debug.FRESH)
_CONSUMED = tl.constexpr(debug.CONSUMED)
_UNWRITTEN = tl.constexpr(debug.UNWRITTEN)
_ERR_UNWRITTEN = tl.constexpr(debug.ERR_UNWRITTEN)
_ERR_CONSUMED = tl.constexpr(debug.ERR_CONSUMED)
_ERR_OUT_OF_RANGE = tl.constexpr(debug.ERR_OUT_OF_RANGE)
_ERR_FIELD_INDICES = tl.constexpr(debug.ERR_FIELD_INDICES)
_CONTIGUOUS = tl.constexpr(backend.CONTIGUOUS)
_FLAT = tl.constexpr(backend.FLAT)


@triton.jit
def to_dtype(v, ty: tl.constexpr):
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
def offsets(row, k, strides, MODE: tl.constexpr, WIDTH: tl.constexpr):
    """Element offsets of row-major elements `k` of row `row` (see `backend.strides_of`);
    `strides` is unused, and may be None, for a contiguous tensor."""
    if MODE == _CONTIGUOUS:
        return row * WIDTH + k
    elif MODE == _FLAT:
        return row.to(tl.int64) * strides[0] + k * strides[2]
    else:
        return row.to(tl.int64) * strides[0] + (k // MODE) * strides[1] + (k % MODE) * strides[2]


@triton.jit
def _copy_fields(caller, strides, MODES: tl.constexpr, caller_row, bufs, slot, c, TO_RELAY: tl.constexpr,
                 WIDTHS: tl.constexpr, BLOCKS: tl.constexpr, STARTS: tl.constexpr):
    """Program column `c` copies one chunk of one field between the caller's tensor (row
    `caller_row`, any strides) and the relay's buffer (row `slot`, contiguous), towards the
    relay when TO_RELAY. Field f owns columns STARTS[f] .. STARTS[f + 1] - 1, one per
    BLOCKS[f] elements of its row. `strides` is None when every caller tensor is contiguous:
    the common case then binds no stride arguments at all (cheaper eager launches)."""
    for f in tl.static_range(len(WIDTHS)):
        if (c >= STARTS[f]) & (c < STARTS[f + 1]):
            k = (c - STARTS[f]) * BLOCKS[f] + tl.arange(0, BLOCKS[f])
            mask = k < WIDTHS[f]
            if MODES[f] == _CONTIGUOUS:
                theirs = caller[f] + caller_row * WIDTHS[f] + k
            else:
                theirs = caller[f] + offsets(caller_row, k, strides[f], MODES[f], WIDTHS[f])
            ours = bufs[f] + slot * WIDTHS[f] + k
            if TO_RELAY:
                tl.store(ours, to_dtype(tl.load(theirs, mask=mask), bufs[f].dtype.element_ty), mask=mask)
            else:
                tl.store(theirs, to_dtype(tl.load(ours, mask=mask), caller[f].dtype.element_ty), mask=mask)


@triton.jit
def _record_error(err_ptr, code, slot, field_id):
    """Keep the first error: [code, slot, field_id]."""
    if tl.atomic_cas(err_ptr, 0, code) == 0:
        tl.store(err_ptr + 1, slot)
        tl.store(err_ptr + 2, field_id)


@triton.jit
def _load_slot(idx_ptr, idx_stride, i, c, max_reqs, err_ptr, DEBUG: tl.constexpr):
    """Slot index of batch row i, clamped to padding row 0 when out of range."""
    slot = tl.load(idx_ptr + i * idx_stride).to(tl.int64)
    in_range = (slot >= 0) & (slot <= max_reqs)
    if DEBUG:
        if (c == 0) & (in_range == 0):  # one report per bad row
            _record_error(err_ptr, _ERR_OUT_OF_RANGE, slot.to(tl.int32), _ERR_FIELD_INDICES)
    return tl.where(in_range, slot, 0)


@triton.jit
def gather_kernel(
    idx_ptr,  # [bs] slot per batch row
    idx_stride,
    bufs,  # tuple: relay buffers [rows, width_f], contiguous
    outs,  # tuple: outputs [bs, width_f], any strides
    out_strides,  # tuple of (s0, s1, s2) per output, or None when all are contiguous
    state_ptr,  # [rows, n_fields] int8 debug states
    err_ptr,  # [4] int32 debug error record
    max_reqs,
    OUT_MODES: tl.constexpr,  # backend.strides_of mode per output
    WIDTHS: tl.constexpr,
    BLOCKS: tl.constexpr,
    STARTS: tl.constexpr,  # first chunk column of each field, then the total
    FIELD_IDS: tl.constexpr,  # relay field id of each field: its debug state column
    N_FIELDS: tl.constexpr,
    DEBUG: tl.constexpr,
):
    i = tl.program_id(0)
    c = tl.program_id(1)
    slot = _load_slot(idx_ptr, idx_stride, i, c, max_reqs, err_ptr, DEBUG)
    _copy_fields(outs, out_strides, OUT_MODES, i, bufs, slot, c, False, WIDTHS, BLOCKS, STARTS)
    if DEBUG:
        # One program per batch row owns the consume-once bookkeeping; padding is exempt.
        if (c == 0) & (slot != 0):
            for f in tl.static_range(len(FIELD_IDS)):
                state = tl.load(state_ptr + slot * N_FIELDS + FIELD_IDS[f])
                if state != _FRESH:
                    code = tl.where(state == _UNWRITTEN, _ERR_UNWRITTEN, _ERR_CONSUMED)
                    _record_error(err_ptr, code, slot.to(tl.int32), FIELD_IDS[f])
                tl.store(state_ptr + slot * N_FIELDS + FIELD_IDS[f], _CONSUMED)


@triton.jit
def scatter_kernel(
    idx_ptr,  # [bs]
    idx_stride,
    srcs,  # tuple: payload tensors [bs, width_f], any strides
    bufs,  # tuple: relay buffers [rows, width_f], contiguous
    src_strides,  # tuple of (s0, s1, s2) per payload tensor, or None when all are contiguous
    state_ptr,
    err_ptr,
    max_reqs,
    SRC_MODES: tl.constexpr,
    WIDTHS: tl.constexpr,
    BLOCKS: tl.constexpr,
    STARTS: tl.constexpr,
    FIELD_IDS: tl.constexpr,
    N_FIELDS: tl.constexpr,
    DEBUG: tl.constexpr,
):
    i = tl.program_id(0)
    c = tl.program_id(1)
    slot = _load_slot(idx_ptr, idx_stride, i, c, max_reqs, err_ptr, DEBUG)
    if slot != 0:  # writes to padding row 0 are dropped: it must keep its fill values
        _copy_fields(srcs, src_strides, SRC_MODES, i, bufs, slot, c, True, WIDTHS, BLOCKS, STARTS)
        if DEBUG:
            if c == 0:
                for f in tl.static_range(len(FIELD_IDS)):
                    tl.store(state_ptr + slot * N_FIELDS + FIELD_IDS[f], _FRESH)
