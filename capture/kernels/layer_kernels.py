"""Fused per-layer kernels for the decode step: fewer CUDA-graph nodes per layer.

At batch 1 a captured decode step is launch-bound, so what counts is nodes per layer. With the
GEMMs left to torch (cuBLAS), a layer becomes

    normed, x = rms_norm(mlp_out, attn_norm, eps, residual=x, residual_out=x)  # 1: add + norm
    qkv = normed @ qkv_w.T                                                     # 1: GEMM
    q = rotary_and_cache_write(qkv, rope_cos, rope_sin, positions,
                               k_cache, v_cache, slots, h, kvh)                # 1: rope + K/V write
    attn_out = attention(q, ...) @ o_w.T                                       # attention + GEMM
    normed, x = rms_norm(attn_out, mlp_norm, eps, residual=x, residual_out=x)  # 1: add + norm
    mlp_out = silu_mul(normed @ gate_up_w.T) @ down_w.T                        # 3: GEMM, 1, GEMM

(layer 0 norms the embeddings without a residual; the final norm takes the last `mlp_out`).

Each op dispatches on `backend`: "triton" (the default for CUDA tensors) launches one Triton
kernel; "torch" (the default otherwise) runs a reference twin that is, op for op, the math of
capture/model/model.py, so the CPU float32 path keeps its numerics. Both backends take the same
arguments and reject the same ones; every tensor must be contiguous (a non-contiguous one is
a ValueError, never a silent copy).

Capturable: the grid depends on shapes alone, nothing is read back to the host, and nothing
is allocated when the `out=` tensors are given. Slots and positions are read on the device.

Precision of the Triton kernels against the torch twins (the tests hold them to this):
- Every store to the model dtype rounds float32 to nearest even (`_round_to`: Triton's
  interpreter would truncate to bfloat16), and every rounding torch does is done here too
  (e.g. silu is rounded to the model dtype before the multiply by `up`).
- rotary_and_cache_write does torch's float32 ops in torch's order, with FMA contraction off:
  bit-identical results.
- rms_norm sums squares in a different order than torch and silu_mul's exp differs in the
  last float32 bits, so a float32 result can differ by ~1e-7 relative, which can move a
  bfloat16 rounding by 1 ulp (2 ulp after the multiply by a general weight / `up`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BACKENDS = ("triton", "torch")
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
CACHE_FLOAT8 = torch.float8_e4m3fn  # the opt-in KV cache dtype besides the model's (capture.model.kv_cache)
SILU_BLOCK = 512  # intermediate 1536 -> 3 unmasked programs per row


def to_cache_dtype(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V values as a cache of `dtype` stores them (the kernels' `_to_cache`): float8
    saturates at its largest finite value (torch's CUDA cast would turn an overflow into NaN,
    its CPU cast saturates), NaN stays NaN, rounding is to nearest even; the model's own dtype
    is left as it is."""
    if dtype == CACHE_FLOAT8:
        largest = torch.finfo(dtype).max
        values = values.clamp(-largest, largest)
    return values.to(dtype)


def _pick_backend(backend: str | None, x: torch.Tensor) -> str:
    if backend is None:
        return "triton" if x.is_cuda else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before importing triton")
    return backend


def _num_warps(elements: int) -> int:
    """Warps for a program that holds `elements` values: 8 to 16 values per thread up to 8192."""
    return 4 if elements <= 2048 else 8 if elements <= 4096 else 16


def _expect(name: str, t: object, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...],
            device: torch.device) -> None:
    """ValueError unless `t` is a contiguous tensor of `shape`, one of `dtypes`, on `device`."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape or t.dtype not in dtypes or t.device != device:
        allowed = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must be a {allowed} tensor of shape {list(shape)} on {device}, "
                         f"got {t.dtype} {list(t.shape)} on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}; pass .contiguous()")


def _expect_2d(name: str, t: object) -> tuple[int, int]:
    """Shape of a 2-D model-dtype tensor (contiguity is checked by `_expect` after)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in MODEL_DTYPES:
        got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 2-D tensor of {MODEL_DTYPES}, got {got}")
    return t.shape[0], t.shape[1]


# Read when the kernels are defined, as triton.jit decides between compiling and interpreting.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _round_to(v, ty: tl.constexpr):
    """float32 -> `ty`, round to nearest even.

    NOTE: the interpreter truncates float32 -> bfloat16 where torch and the GPU round; there the
    rounding is done in integer ops, which makes every path agree bit for bit (NaN stays NaN).
    A compiled kernel converts in one instruction (`cvt.rn`, the same bits).
    """
    if ty == tl.bfloat16:
        if INTERPRETED:
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            bits = tl.where(v != v, 0x7FFF, bits)
            return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return v.to(ty, fp_downcast_rounding="rtne")
    elif ty == tl.float8e4nv:
        # Saturating at e4m3's largest finite value, as torch's cast does (e4m3 has no infinity;
        # NaN stays NaN).
        v = tl.minimum(tl.maximum(v, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0,
                       propagate_nan=tl.PropagateNan.ALL)
        if INTERPRETED:
            # The interpreter rounds ties away from zero: round onto the e4m3 grid here, in
            # float32, so its cast is exact. The grid step is 2^(e - 3) for an exponent e >= -6
            # (3 mantissa bits), 2^-9 below (subnormals); dividing by a power of two is exact,
            # and adding and taking away 2^23 rounds the magnitude's quotient to an integer,
            # ties even. The sign goes back on by its bit, so a value rounded to zero keeps it;
            # NaN, which the interpreter's cast would turn into a number, is e4m3's NaN pattern.
            bits = v.to(tl.uint32, bitcast=True)
            exponent = ((bits >> 23) & 0xFF).to(tl.int32) - 127
            step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
            magnitude = ((tl.abs(v) / step + 8388608.0) - 8388608.0) * step
            rounded = magnitude.to(tl.uint32, bitcast=True) | (bits & 0x80000000)
            nan = (((bits >> 24) & 0x80) | 0x7F).to(tl.uint8).to(ty, bitcast=True)
            return tl.where(v != v, nan, rounded.to(tl.float32, bitcast=True).to(ty))
        else:
            return v.to(ty, fp_downcast_rounding="rtne")
    else:
        return v.to(ty)


@triton.jit
def _to_cache(v, cache_ty: tl.constexpr):
    """A K or V value of the model dtype as the cache stores it: itself, or (a float8 cache,
    `capture.model.kv_cache`) rounded to nearest even from its float32 widening."""
    if v.dtype == cache_ty:
        return v
    else:
        return _round_to(v.to(tl.float32), cache_ty)


# One compiled variant for every row count (n only bounds a gathered row index).
@triton.jit(do_not_specialize=("n",))
def _rms_norm_kernel(
    x_ptr,  # [n, HIDDEN]
    res_ptr,  # [n, HIDDEN] residual (unused unless HAS_RESIDUAL)
    w_ptr,  # [HIDDEN]
    out_ptr,  # [m, HIDDEN] normed (m = n without GATHER)
    res_out_ptr,  # [n, HIDDEN] x + residual (HAS_RESIDUAL and not GATHER); may alias x or residual
    rows_ptr,  # [m] the rows of x to normalize (GATHER)
    n,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= HIDDEN: one program holds a whole row
    HAS_RESIDUAL: tl.constexpr,
    GATHER: tl.constexpr,
):
    dst = tl.program_id(0).to(tl.int64) * HIDDEN
    if GATHER:
        # An index outside x reads row 0: its result is unspecified, never memory outside.
        src_row = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
        row = tl.where((src_row >= 0) & (src_row < n), src_row, 0) * HIDDEN
    else:
        row = dst
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    dtype = out_ptr.dtype.element_ty
    h = tl.load(x_ptr + row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The add happens in the model dtype, like the model's `x = x + attn_out`. Each element
        # is stored after it is loaded, so residual_out may alias x or the residual.
        r = tl.load(res_ptr + row + cols, mask=mask, other=0.0)
        h = _round_to(h.to(tl.float32) + r.to(tl.float32), dtype)
        if not GATHER:
            tl.store(res_out_ptr + row + cols, h, mask=mask)
    hf = h.to(tl.float32)
    mean_sq = tl.sum(hf * hf, axis=0) / HIDDEN
    # IEEE sqrt and divide, as torch's CPU rsqrt (tl.rsqrt is an approximation on the GPU).
    rstd = tl.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))
    normed = _round_to(hf * rstd, dtype)  # `.to(x.dtype)` before the weight, Llama's order
    w = tl.load(w_ptr + cols, mask=mask)
    tl.store(out_ptr + dst + cols, _round_to(w.to(tl.float32) * normed.to(tl.float32), dtype), mask=mask)


# pos and slot are one scalar per row: their alignment buys nothing, and prefill passes rows of
# one staging tensor that start at any offset (each new alignment would compile a new variant).
@triton.jit(do_not_specialize_on_alignment=("pos_ptr", "slot_ptr"))
def _rotary_cache_kernel(
    qkv_ptr,  # [n, (H + 2 KVH) * D]: q heads, then k heads, then v heads
    cos_ptr,  # [table_rows, D] float32
    sin_ptr,  # [table_rows, D] float32
    pos_ptr,  # [n] int32/int64
    slot_ptr,  # [n] int32/int64
    q_ptr,  # [n, H, D] rotated q
    k_cache_ptr,  # [cache_rows, seq_len, KVH, D]
    v_cache_ptr,  # [cache_rows, seq_len, KVH, D]
    table_rows,
    cache_rows,
    seq_len,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    QK_BLOCK: tl.constexpr,  # next power of two >= H + KVH: q and k heads in one tile
    V_BLOCK: tl.constexpr,  # next power of two >= KVH
    D_BLOCK: tl.constexpr,  # next power of two >= D
):
    i = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + i).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    # An index the caller failed to validate goes to padding row 0 instead of writing outside
    # the cache (or into another request's row); the torch twin raises instead.
    ok = (slot >= 0) & (slot < cache_rows) & (pos >= 0) & (pos < seq_len) & (pos < table_rows)
    pos = tl.where(ok, pos, 0)
    slot = tl.where(ok, slot, 0)

    d = tl.arange(0, D_BLOCK)[None, :]  # [1, D_BLOCK]
    d_ok = d < D
    first_half = d < D // 2
    # Half-split pairing: rotated = cat(-x2, x1), i.e. element d pairs with d +- D/2.
    partner = tl.where(first_half, d + D // 2, d - D // 2)
    sign = tl.where(first_half, -1.0, 1.0)
    cos = tl.load(cos_ptr + pos * D + d, mask=d_ok)  # [1, D_BLOCK]
    sin = tl.load(sin_ptr + pos * D + d, mask=d_ok)

    src = qkv_ptr + i * ((H + 2 * KVH) * D)
    head = tl.arange(0, QK_BLOCK)[:, None]  # [QK_BLOCK, 1]: 0..H-1 are q heads, H.. k heads
    qk_ok = (head < H + KVH) & d_ok
    x = tl.load(src + head * D + d, mask=qk_ok).to(tl.float32)
    x_partner = tl.load(src + head * D + partner, mask=qk_ok).to(tl.float32)
    # torch's ops in torch's order: x*cos, rotated*sin, then the add (no FMA: see the launch).
    out = _round_to(x * cos + (x_partner * sign) * sin, q_ptr.dtype.element_ty)

    cache_row = (slot * seq_len + pos) * (KVH * D)
    tl.store(q_ptr + i * (H * D) + head * D + d, out, mask=(head < H) & d_ok)
    tl.store(k_cache_ptr + cache_row + (head - H) * D + d, _to_cache(out, k_cache_ptr.dtype.element_ty),
             mask=(head >= H) & qk_ok)

    v_head = tl.arange(0, V_BLOCK)[:, None]
    v_ok = (v_head < KVH) & d_ok
    v = tl.load(src + (H + KVH) * D + v_head * D + d, mask=v_ok)
    tl.store(v_cache_ptr + cache_row + v_head * D + d, _to_cache(v, v_cache_ptr.dtype.element_ty), mask=v_ok)


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [n, 2 * INTER]: gate, then up
    out_ptr,  # [n, INTER]
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * (2 * INTER) + cols, mask=mask).to(tl.float32)
    up = tl.load(gate_up_ptr + row * (2 * INTER) + INTER + cols, mask=mask).to(tl.float32)
    # torch's silu: x / (1 + exp(-x)) in float32, rounded to the model dtype; then `* up`.
    silu = _round_to(tl.div_rn(gate, 1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + row * INTER + cols, _round_to(silu.to(tl.float32) * up, dtype), mask=mask)


# ----------------------------------------------------------------------------------------------
# rms_norm


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x `[n, hidden]`, normalized in float32 and scaled in the model dtype.

    Without `residual`: returns `weight * (xf * rsqrt(mean(xf^2) + eps)).to(x.dtype)`.
    With `residual` `[n, hidden]`: h = x + residual (in the model dtype); returns
    `(rms_norm(h), h)`, so the residual add before a norm costs no node of its own.
    `out` / `residual_out` receive the results; `residual_out` may alias `x` or `residual`
    (an in-place residual update). weight `[hidden]` has x's dtype.

    rows `[m]` int32/int64 (each in 0..n-1): normalize only those rows, in that order, into
    `[m, hidden]`: `rms_norm(x[rows] (+ residual[rows]))` in one node with the gather (the
    model's last norm over the rows that sample); returns the normed rows alone (no
    residual_out: the sum is not kept).
    """
    n, hidden = _expect_2d("rms_norm x", x)
    shape, dtypes = (n, hidden), (x.dtype,)
    _expect("rms_norm x", x, shape, dtypes, x.device)
    _expect("rms_norm weight", weight, (hidden,), dtypes, x.device)
    if rows is not None:
        if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64) or rows.device != x.device:
            raise ValueError(f"rms_norm rows must be a 1-d int32/int64 tensor on {x.device}, got {rows.dtype} "
                             f"{tuple(rows.shape)} on {rows.device}")
        if residual_out is not None:
            raise ValueError("rms_norm with rows keeps no residual_out (the gathered sum is not written); drop it")
    out_shape = shape if rows is None else (rows.shape[0], hidden)
    for name, t, want in (("residual", residual, shape), ("out", out, out_shape), ("residual_out", residual_out, shape)):
        if t is not None:
            _expect(f"rms_norm {name}", t, want, dtypes, x.device)
    if residual is None and residual_out is not None:
        raise ValueError("rms_norm residual_out needs residual (it receives x + residual)")
    if _pick_backend(backend, x) == "torch":
        if rows is not None:
            x, residual = x.index_select(0, rows), None if residual is None else residual.index_select(0, rows)
            normed = _rms_norm_torch(x, weight, eps, residual, out, None)
            return normed if residual is None else normed[0]
        return _rms_norm_torch(x, weight, eps, residual, out, residual_out)

    out = x.new_empty(out_shape) if out is None else out
    if residual is not None and residual_out is None and rows is None:
        residual_out = torch.empty_like(x)
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(out_shape[0],)](
        x, x if residual is None else residual, weight, out, out if residual_out is None else residual_out,
        x if rows is None else rows, n,
        eps, HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, GATHER=rows is not None,
        num_warps=_num_warps(block),
    )
    return out if residual is None or rows is not None else (out, residual_out)


def _rms_norm_torch(x, weight, eps, residual, out, residual_out):
    """capture/model/model.py's `rms_norm`, after its `x = x + residual` when there is one."""
    if residual is not None:
        x = x + residual
        if residual_out is not None:
            x = residual_out.copy_(x)
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if out is not None:
        normed = out.copy_(normed)
    return normed if residual is None else (normed, x)


# ----------------------------------------------------------------------------------------------
# rotary_and_cache_write


def rotary_and_cache_write(
    qkv: torch.Tensor,
    rope_cos: torch.Tensor,
    rope_sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    q_out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Rotate q and k of the fused QKV projection, store k and v in the cache; returns q.

    qkv `[n, (num_heads + 2 num_kv_heads) * d]` (q, k, v heads in order, model dtype);
    rope_cos, rope_sin `[table_rows, d]` float32, gathered at `positions` `[n]` here;
    k_cache, v_cache `[cache_rows, seq_len, num_kv_heads, d]` in qkv's dtype, or both float8
    e4m3 (k and v are then rounded to it as they are stored); slots `[n]`.
    Row i's rotated k and raw v land at `[slots[i], positions[i]]`; padding rows (slot 0) land
    in scratch row 0, where duplicates are harmless. Returns rotated q `[n, num_heads, d]`
    (in `q_out` when given). Out-of-range indices: see `_rotary_cache_kernel`.
    """
    n, width = _expect_2d("rotary qkv", qkv)
    _check_rotary(n, width, qkv.dtype, qkv.device, rope_cos, rope_sin, positions, k_cache, v_cache, slots,
                  num_heads, num_kv_heads, q_out)
    _expect("rotary qkv", qkv, (n, width), (qkv.dtype,), qkv.device)
    if _pick_backend(backend, qkv) == "torch":
        return _rotary_torch(qkv, rope_cos, rope_sin, positions, k_cache, v_cache, slots, num_heads, q_out)

    cache_rows, seq_len, _, d = k_cache.shape
    table_rows = rope_cos.shape[0]
    q_out = qkv.new_empty(n, num_heads, d) if q_out is None else q_out
    qk_block = triton.next_power_of_2(num_heads + num_kv_heads)
    d_block = triton.next_power_of_2(d)
    _rotary_cache_kernel[(n,)](
        qkv, rope_cos, rope_sin, positions, slots, q_out, k_cache, v_cache,
        table_rows, cache_rows, seq_len,
        H=num_heads, KVH=num_kv_heads, D=d, QK_BLOCK=qk_block,
        V_BLOCK=triton.next_power_of_2(num_kv_heads), D_BLOCK=d_block,
        num_warps=_num_warps(qk_block * d_block),
        # NOTE: a*b + c*d contracted to an FMA would round differently from torch's separate
        # mul, mul, add kernels; without contraction the GPU result is bit-identical.
        enable_fp_fusion=False,
    )
    return q_out


def _check_rotary(n, width, dtype, dev, rope_cos, rope_sin, positions, k_cache, v_cache, slots, num_heads,
                  num_kv_heads, q_out) -> None:
    """The arguments of a rotary + cache write for `n` rows of a QKV projection `width` wide in
    `dtype` on `dev` (the projection itself is checked by the caller, or never materialized)."""
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4 or k_cache.shape[2] != num_kv_heads:
        got = list(k_cache.shape) if isinstance(k_cache, torch.Tensor) else type(k_cache).__name__
        raise ValueError(f"rotary k_cache must be [cache_rows, seq_len, {num_kv_heads}, head_dim], got {got}")
    d = k_cache.shape[3]
    if d % 2 or width != (num_heads + 2 * num_kv_heads) * d:
        raise ValueError(f"rotary qkv width {width} must be (num_heads + 2 * num_kv_heads) * head_dim "
                         f"= ({num_heads} + 2 * {num_kv_heads}) * {d}, with an even head_dim")
    # The cache holds the model dtype or float8 (capture.model.kv_cache), K and V alike.
    cache_dtypes = (k_cache.dtype,) if k_cache.dtype in (dtype, CACHE_FLOAT8) else (dtype, CACHE_FLOAT8)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _expect(f"rotary {name}", cache, tuple(k_cache.shape), cache_dtypes, dev)
    table_rows = rope_cos.shape[0] if isinstance(rope_cos, torch.Tensor) else 0
    for name, table in (("rope_cos", rope_cos), ("rope_sin", rope_sin)):
        _expect(f"rotary {name}", table, (table_rows, d), (torch.float32,), dev)
    for name, index in (("positions", positions), ("slots", slots)):
        _expect(f"rotary {name}", index, (n,), INDEX_DTYPES, dev)
    if q_out is not None:
        _expect("rotary q_out", q_out, (n, num_heads, d), (dtype,), dev)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split pairing, in float32: x `[n, heads, d]`; cos, sin `[n, d]`."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


def _rotary_torch(qkv, rope_cos, rope_sin, positions, k_cache, v_cache, slots, num_heads, q_out):
    """Split the fused projection, rotate q and k, store k and v at `[slot, position]`."""
    n = qkv.shape[0]
    seq_len, kvh, d = k_cache.shape[1:]
    q, k, v = qkv.split([num_heads * d, kvh * d, kvh * d], -1)
    q, k, v = q.view(n, num_heads, d), k.view(n, kvh, d), v.view(n, kvh, d)
    cos, sin = rope_cos.index_select(0, positions), rope_sin.index_select(0, positions)  # [n, d]
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    flat = slots.long() * seq_len + positions.long()  # rows of the [cache_rows * seq_len, kvh, d] view
    for cache, new in ((k_cache, k), (v_cache, v)):
        new = to_cache_dtype(new, cache.dtype)
        if cache.dtype == CACHE_FLOAT8:  # index_copy_ has no float8 kernel on the CPU: copy the bytes
            cache, new = cache.view(torch.uint8), new.view(torch.uint8)
        cache.view(-1, kvh, d).index_copy_(0, flat, new)
    return q if q_out is None else q_out.copy_(q)


# ----------------------------------------------------------------------------------------------
# silu_mul


def silu_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """SwiGLU's `silu(gate) * up` in the model dtype: gate_up `[n, 2 I]` (gate first, as
    `chunk(2, -1)`) -> `[n, I]` (into `out` when given)."""
    n, width = _expect_2d("silu_mul gate_up", gate_up)
    if width % 2:
        raise ValueError(f"silu_mul gate_up width must be even (gate, then up), got {width}")
    inter = width // 2
    _expect("silu_mul gate_up", gate_up, (n, width), (gate_up.dtype,), gate_up.device)
    if out is not None:
        _expect("silu_mul out", out, (n, inter), (gate_up.dtype,), gate_up.device)
    if _pick_backend(backend, gate_up) == "torch":
        gate, up = gate_up.chunk(2, dim=-1)
        result = torch.nn.functional.silu(gate) * up
        return result if out is None else out.copy_(result)

    out = gate_up.new_empty(n, inter) if out is None else out
    block = min(SILU_BLOCK, triton.next_power_of_2(inter))
    _silu_mul_kernel[(n, triton.cdiv(inter, block))](gate_up, out, INTER=inter, BLOCK=block,
                                                     num_warps=_num_warps(block))
    return out
