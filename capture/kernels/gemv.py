"""Skinny GEMMs for decode-sized row counts, each fused with the element-wise ops around it.

At a few rows a projection `y = x @ w.T` streams its weight once and does almost no math, so a
captured decode step pays per node, not per byte: cuBLAS at one row costs ~3.8 us a GEMM on
the H200 although the weight streams in under 1 us. Three kernels fold a layer's
projections and their neighbours into four nodes:

    qkv, stream  = norm_linear(update, attn_norm, qkv_w, eps, residual=stream)     # add + norm + QKV
    stream       = linear_residual(attn, o_w, stream, out=stream)                  # O + residual add
    act, stream  = norm_gate_up_silu(update, mlp_norm, gate_up_w, eps, residual=stream)  # norm + gate/up + SiLU*up
    stream       = linear_residual(act, down_w, stream, out=stream)               # down + residual add

(`residual=` is only needed when the previous projection left its update pending, as the torch
path does; `capture/model/linear_plan.py` chains either form).

Weights stay as the model holds them, `[out, in]` row-major: a program owns BLOCK_N output
features, so it reads whole contiguous rows of the weight (wide vector loads) once, and the
gate/up pair is two row ranges of one tensor. Accumulation is float32 (tl.dot, IEEE for float32
inputs); every rounding the torch twin does is done here too, through `_round_to`.

Programmatic dependent launch (`pdl=True`, Hopper and later): the first weight tile is loaded
before `gdc_wait`, so its fetch overlaps the previous kernel's tail; nothing written by an
earlier kernel is read, and nothing is written, before the wait. Each program then lets the
next kernel launch. Off under the interpreter and on GPUs or Triton builds without it.

Backends as in `layer_kernels`: "triton" (default for CUDA tensors) or "torch", the unfused
reference (rms_norm, matmul, silu_mul, add) the tests hold the kernels to. Only the order of
float32 sums differs, so results agree to float32 rounding (a bf16 output within an ulp or two).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from graphrelay.capture.kernels import layer_kernels as lk
from graphrelay.capture.kernels.layer_kernels import _expect, _expect_2d, _num_warps, _pick_backend, _round_to

BLOCK_N = 16  # output features per program: the smallest tl.dot tile, so the most programs
MAX_TILE = 16384  # elements of the x tile (BLOCK_M x BLOCK_K) one loop step holds
EPILOGUE_NONE, EPILOGUE_RESIDUAL, EPILOGUE_SILU_MUL = 0, 1, 2


@functools.cache
def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch needs a Hopper-class GPU and a Triton that can launch it."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(tl.extra.cuda, "gdc_wait")


@triton.jit
def _dot(x, w, acc, DOT_F32: tl.constexpr):
    """acc + x @ w.T. A 16-bit dot accumulates exact products in float32, so upcasting first
    and summing in float32 is the same computation."""
    if DOT_F32:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    else:
        return tl.dot(x, tl.trans(w), acc)


@triton.jit
def _skinny_linear_kernel(
    x_ptr,  # [M, K]: the input (NORM: the residual stream, or the pending update when HAS_RESIDUAL)
    res_in_ptr,  # [M, K] residual stream added to x before the norm (HAS_RESIDUAL)
    res_out_ptr,  # [M, K] receives x + res_in (HAS_RESIDUAL); must not alias either input
    norm_w_ptr,  # [K] RMSNorm weight (NORM)
    w_ptr,  # [N, K], or [2 N, K] for SILU_MUL (gate rows, then up rows)
    add_ptr,  # [M, N] residual added to the projection (EPILOGUE_RESIDUAL); may alias out
    out_ptr,  # [M, N]
    M,
    eps,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EPILOGUE: tl.constexpr,
    DOT_F32: tl.constexpr,  # a float32 IEEE dot (float32 inputs, or the interpreter: see _launch)
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows[:, None] < M
    col_ok = cols[:, None] < N
    dtype = out_ptr.dtype.element_ty
    x_rows = x_ptr + rows[:, None].to(tl.int64) * K
    w_rows = w_ptr + cols[:, None].to(tl.int64) * K
    up_rows = w_ptr + (cols[:, None] + N).to(tl.int64) * K

    # The weights depend on no earlier kernel: start streaming them before the PDL wait.
    w = tl.load(w_rows + ks[None, :], mask=col_ok & (ks[None, :] < K), other=0.0)
    if EPILOGUE == 2:
        w_up = tl.load(up_rows + ks[None, :], mask=col_ok & (ks[None, :] < K), other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    if NORM:
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = row_ok & (k0 + ks[None, :] < K)
            h = tl.load(x_rows + k0 + ks[None, :], mask=k_ok, other=0.0)
            if HAS_RESIDUAL:
                # The add in the model dtype, as torch's `x + residual`. One column of programs
                # stores it; res_out is a fresh buffer, so no program reads a value another wrote.
                r = tl.load(res_in_ptr + rows[:, None].to(tl.int64) * K + k0 + ks[None, :], mask=k_ok, other=0.0)
                h = _round_to(h.to(tl.float32) + r.to(tl.float32), dtype)
                if pid_n == 0:
                    tl.store(res_out_ptr + rows[:, None].to(tl.int64) * K + k0 + ks[None, :], h, mask=k_ok)
            hf = h.to(tl.float32)
            sum_sq += tl.sum(hf * hf, axis=1)
        # IEEE sqrt and divide, as layer_kernels' rms_norm (tl.rsqrt is approximate on the GPU).
        rstd = tl.div_rn(1.0, tl.sqrt_rn(sum_sq / K + eps))

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = row_ok & (k0 + ks[None, :] < K)
        x = tl.load(x_rows + k0 + ks[None, :], mask=k_ok, other=0.0)
        if NORM:
            if HAS_RESIDUAL:
                r = tl.load(res_in_ptr + rows[:, None].to(tl.int64) * K + k0 + ks[None, :], mask=k_ok, other=0.0)
                x = _round_to(x.to(tl.float32) + r.to(tl.float32), dtype)
            nw = tl.load(norm_w_ptr + k0 + ks, mask=k0 + ks < K, other=0.0)
            # Llama's order: normalize in float32, round, then scale by the weight in the model dtype.
            normed = _round_to(x.to(tl.float32) * rstd[:, None], dtype)
            x = _round_to(nw[None, :].to(tl.float32) * normed.to(tl.float32), dtype)
        acc = _dot(x, w, acc, DOT_F32)
        if EPILOGUE == 2:
            acc_up = _dot(x, w_up, acc_up, DOT_F32)
        # The next step's weight tile (fully masked, so no traffic, after the last step).
        next_ok = col_ok & (k0 + BLOCK_K + ks[None, :] < K)
        w = tl.load(w_rows + k0 + BLOCK_K + ks[None, :], mask=next_ok, other=0.0)
        if EPILOGUE == 2:
            w_up = tl.load(up_rows + k0 + BLOCK_K + ks[None, :], mask=next_ok, other=0.0)

    out_offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    out_ok = row_ok & (cols[None, :] < N)
    y = _round_to(acc, dtype)  # the projection's own output, as torch's matmul stores it
    if EPILOGUE == 1:
        # Each element is read and written by this program alone, so `add` may alias `out`.
        base = tl.load(add_ptr + out_offsets, mask=out_ok, other=0.0)
        y = _round_to(y.to(tl.float32) + base.to(tl.float32), dtype)
    elif EPILOGUE == 2:
        gate = y.to(tl.float32)
        up = _round_to(acc_up, dtype).to(tl.float32)
        # layer_kernels.silu_mul's math: silu rounded to the model dtype, then `* up`.
        silu = _round_to(tl.div_rn(gate, 1.0 + tl.exp(-gate)), dtype)
        y = _round_to(silu.to(tl.float32) * up, dtype)
    tl.store(out_ptr + out_offsets, y, mask=out_ok)


def _launch(x, res_in, res_out, norm_w, w, add, out, eps, *, n_out, norm, epilogue, pdl):
    m, k = x.shape
    block_m = max(16, min(64, triton.next_power_of_2(m)))
    block_k = max(16, min(triton.next_power_of_2(k), MAX_TILE // block_m))
    weight_tiles = 2 if epilogue == EPILOGUE_SILU_MUL else 1
    grid = (triton.cdiv(n_out, BLOCK_N), triton.cdiv(m, block_m))
    extra = {"launch_pdl": True} if pdl else {}
    # NOTE: the interpreter multiplies bfloat16 dot operands as their raw uint16 bits; DOT_F32
    # upcasts them there.
    _skinny_linear_kernel[grid](
        x, x if res_in is None else res_in, x if res_out is None else res_out, x if norm_w is None else norm_w,
        w, out if add is None else add, out, m, eps,
        N=n_out, K=k, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=block_k, NORM=norm,
        HAS_RESIDUAL=res_in is not None, EPILOGUE=epilogue, DOT_F32=x.dtype == torch.float32 or not x.is_cuda, USE_PDL=pdl,
        num_warps=_num_warps(weight_tiles * BLOCK_N * block_k + block_m * block_k), **extra,
    )
    return out


def _resolve_pdl(pdl: bool | None, x: torch.Tensor) -> bool:
    """None: on where supported. True where unsupported is an error, not a silent fallback."""
    if pdl is None:
        return pdl_supported(x.device)
    if pdl and not pdl_supported(x.device):
        raise ValueError(f"pdl=True needs a CUDA device of compute capability 9.0+ and a Triton with "
                         f"launch_pdl; {x.device} has none: pass pdl=None (auto) or False")
    return bool(pdl)


def _check_norm_inputs(what, x, norm_weight, weight, rows_per_out, residual, residual_out, out, n_out):
    """Shapes for the norm-prologue kernels; returns (m, k)."""
    m, k = _expect_2d(f"{what} x", x)
    dev, dtypes = x.device, (x.dtype,)
    _expect(f"{what} x", x, (m, k), dtypes, dev)
    _expect(f"{what} norm_weight", norm_weight, (k,), dtypes, dev)
    w_rows, _ = _expect_2d(f"{what} weight", weight)
    if w_rows % rows_per_out:
        raise ValueError(f"{what} weight has {w_rows} rows; gate/up needs an even count (gate rows, then up rows)")
    _expect(f"{what} weight", weight, (w_rows, k), dtypes, dev)
    for name, t in (("residual", residual), ("residual_out", residual_out)):
        if t is not None:
            _expect(f"{what} {name}", t, (m, k), dtypes, dev)
    if residual is None and residual_out is not None:
        raise ValueError(f"{what} residual_out needs residual (it receives x + residual)")
    if residual_out is not None and residual_out.data_ptr() in (x.data_ptr(), residual.data_ptr()):
        raise ValueError(f"{what} residual_out must not alias x or residual: other programs still read them")
    if out is not None:
        _expect(f"{what} out", out, (m, n_out(w_rows)), dtypes, dev)
    return m, k


# ----------------------------------------------------------------------------------------------
# norm_linear: (residual add +) RMSNorm + projection


def norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    backend: str | None = None,
    pdl: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm(x) @ weight.T` for x `[m, k]`, weight `[n, k]`, norm_weight `[k]`.

    With `residual` `[m, k]`: h = x + residual first (the model dtype); returns
    `(rms_norm(h) @ weight.T, h)`, exactly as `layer_kernels.rms_norm(x, ..., residual=...)`
    followed by the matmul. `out` `[m, n]` / `residual_out` `[m, k]` receive the results;
    residual_out may not alias x or residual. pdl: see the module docstring.
    """
    _check_norm_inputs("norm_linear", x, norm_weight, weight, 1, residual, residual_out, out, lambda r: r)
    return _norm_projection(x, norm_weight, weight, eps, residual, out, residual_out, backend, pdl,
                            EPILOGUE_NONE)


def norm_gate_up_silu(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    gate_up: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    backend: str | None = None,
    pdl: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU's first half: `silu_mul(rms_norm(x) @ gate_up.T)` -> `[m, i]`, gate_up `[2 i, k]`
    (gate rows first, as the model stores it). `residual`, `out`, `residual_out`, `pdl` as in
    `norm_linear`."""
    _check_norm_inputs("norm_gate_up_silu", x, norm_weight, gate_up, 2, residual, residual_out, out,
                       lambda r: r // 2)
    return _norm_projection(x, norm_weight, gate_up, eps, residual, out, residual_out, backend, pdl,
                            EPILOGUE_SILU_MUL)


def _norm_projection(x, norm_weight, weight, eps, residual, out, residual_out, backend, pdl, epilogue):
    silu = epilogue == EPILOGUE_SILU_MUL
    if _pick_backend(backend, x) == "torch":
        normed = lk.rms_norm(x, norm_weight, eps, residual=residual, residual_out=residual_out, backend="torch")
        h, total = normed if residual is not None else (normed, None)
        y = h @ weight.T
        y = lk.silu_mul(y, out=out, backend="torch") if silu else y if out is None else out.copy_(y)
        return y if residual is None else (y, total)

    pdl = _resolve_pdl(pdl, x)
    m, k = x.shape
    n_out = weight.shape[0] // 2 if silu else weight.shape[0]
    out = x.new_empty(m, n_out) if out is None else out
    if residual is not None and residual_out is None:
        residual_out = torch.empty_like(x)
    _launch(x, residual, residual_out, norm_weight, weight, None, out, eps, n_out=n_out, norm=True,
            epilogue=epilogue, pdl=pdl)
    return out if residual is None else (out, residual_out)


# ----------------------------------------------------------------------------------------------
# linear_residual: projection + residual add


def linear_residual(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    backend: str | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """`residual + x @ weight.T` with the projection rounded to the model dtype first (as the
    model's `update = x @ w.T; stream = update + stream`): x `[m, k]`, weight `[n, k]`, residual
    `[m, n]`. `out` may be `residual` itself (an in-place update of the stream)."""
    m, k = _expect_2d("linear_residual x", x)
    dev, dtypes = x.device, (x.dtype,)
    _expect("linear_residual x", x, (m, k), dtypes, dev)
    n, _ = _expect_2d("linear_residual weight", weight)
    _expect("linear_residual weight", weight, (n, k), dtypes, dev)
    _expect("linear_residual residual", residual, (m, n), dtypes, dev)
    if out is not None:
        _expect("linear_residual out", out, (m, n), dtypes, dev)
    if _pick_backend(backend, x) == "torch":
        total = x @ weight.T + residual
        return total if out is None else out.copy_(total)

    pdl = _resolve_pdl(pdl, x)
    out = torch.empty_like(residual) if out is None else out
    return _launch(x, None, None, None, weight, residual, out, 0.0, n_out=n, norm=False,
                   epilogue=EPILOGUE_RESIDUAL, pdl=pdl)
