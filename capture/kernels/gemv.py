"""Skinny GEMMs for decode-sized row counts, each fused with the element-wise ops around it.

At a few rows a projection `y = x @ w.T` streams its weight once and does almost no math, so a
captured decode step pays per node, not per byte: cuBLAS at one row costs ~3.8 us a GEMM on
the H200 although the weight streams in under 1 us. Four entry points fold a layer's
projections and their neighbours into four nodes:

    q, stream   = norm_qkv_rotary(update, attn_norm, qkv_w, eps, rotary..., residual=stream)
                                       # add + norm + QKV + rotary + K/V cache append
    stream      = linear_residual(attn, o_w, stream, out=stream)        # O + residual add
    act, stream = norm_gate_up_silu(update, mlp_norm, gate_up_w, eps, residual=stream)
                                       # add + norm + gate/up + SiLU * up
    stream      = linear_residual(act, down_w, stream, out=stream)      # down + residual add

and `norm_linear` is norm + projection alone. `residual=` is needed only when the previous
projection left its update pending, as the torch path does (`capture/model/linear_plan.py`
chains either form).

Weights stay as the model holds them, `[out, in]` row-major: a program owns BLOCK_N output
features and reads their whole contiguous weight rows (wide vector loads) once. The gate/up
pair is two row ranges of one tensor; a rotary program owns matching columns of both halves of
a head, so the rotation pairs sit in one program's registers. Accumulation is float32 (tl.dot,
IEEE for float32 inputs); every rounding the unfused path does is done here too (`_round_to`).

Programmatic dependent launch (`pdl`, Hopper and later): before `gdc_wait` a CUDA-core tile
loads its first (usually whole-K) weight tile into registers and a tensor-core tile asks L2 for
its weight rows, so the fetch overlaps the previous kernel's tail; nothing an earlier kernel
writes is read, and nothing is written, before the wait. Each program then lets the next
kernel launch. Off under the interpreter and on GPUs or Triton builds without it. The
tensor-core tiles' K loop is software-pipelined by Triton (`Tiles.stages` deep), x and weights
alike. A swapped tile (`Tiles.swap`) runs the same loop as `w @ x.T`: the weight rows take the
dot's M side, which Hopper's warpgroup MMA needs in steps of 64, however few the x rows. A
split-K tile (`Tiles.split_k`, `linear_residual` only) shares an output tile's K steps among
programs that meet in a `SplitKWorkspace`: the last to finish sums the partials in split order
(the same bits whichever finishes last) and adds the residual.

Backends as in `layer_kernels`: "triton" (default for CUDA tensors) or "torch", the unfused
path (layer_kernels' rms_norm / silu_mul / rotary_and_cache_write on their default backend
around a torch matmul) the tests hold the kernels to. Only the order of float32 sums differs,
so results agree to float32 rounding (a bf16 output within an ulp or two).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from graphrelay.capture.kernels import layer_kernels as lk
from graphrelay.capture.kernels.layer_kernels import _check_rotary, _expect, _expect_2d, _pick_backend, _round_to, _to_cache
from graphrelay.capture.kernels.gemv_tiles import SplitKWorkspace, Tiles, check_tiles, default_tiles, pipeline_stages
from graphrelay.capture.kernels.pdl import resolve_pdl

EPILOGUE_NONE, EPILOGUE_RESIDUAL, EPILOGUE_SILU_MUL, EPILOGUE_ROTARY = 0, 1, 2, 3


class Rotary(NamedTuple):
    """What `norm_qkv_rotary` needs beyond the projection (see layer_kernels.rotary_and_cache_write):
    cos, sin `[table_rows, d]` float32; positions, slots `[n]`; k_cache, v_cache
    `[cache_rows, seq_len, num_kv_heads, d]` (the model dtype, or both float8 e4m3)."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_heads: int
    num_kv_heads: int
    # positions and slots were written two or more launches before the projection (not by the
    # kernel just before it), as in every layer of a forward but the first: under PDL the kernel
    # then reads them, and the table rows they pick, before its wait (capture.kernels.pdl).
    settled: bool = False


@triton.jit
def _dot(x, w, acc, DOT_F32: tl.constexpr, FMA: tl.constexpr, SWAP: tl.constexpr):
    """acc + x @ w.T (SWAP: acc + w @ x.T, the transposed product). A 16-bit dot accumulates
    exact products in float32, so upcasting first and summing in float32 is the same
    computation. FMA (a one-row tile): products and a sum over K in float32 on the CUDA cores;
    a tensor-core dot pads the row to 16."""
    if FMA and x.shape[0] == 1:
        # One row: the product in the weight tile's own 2D layout (x [1, K] broadcasts over its
        # rows), so neither operand goes through shared memory to meet a 3D layout.
        return acc + tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
    elif FMA:
        return acc + tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    elif SWAP and DOT_F32:
        return tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    elif SWAP:
        return tl.dot(w, tl.trans(x), acc)
    elif DOT_F32:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    else:
        return tl.dot(x, tl.trans(w), acc)


@triton.jit
def _prefetch_rows_to_l2(rows_ptr, row_ok, K: tl.constexpr, LINE: tl.constexpr, LINES: tl.constexpr):
    """Start pulling whole weight rows `[BLOCK_N, K]` into L2, one request per 128-byte line
    (LINE elements), waiting for none: the loop's later K steps then read from L2."""
    at = tl.arange(0, LINES)[None, :] * LINE
    ptrs = tl.where(row_ok & (at < K), rows_ptr + at, rows_ptr)  # a masked lane re-asks for its row start
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _epilogue_inputs(add_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, rows, row64, col_a, out_ok, M, N,
                     table_rows, cache_rows, seq_len, EPILOGUE: tl.constexpr, D: tl.constexpr,
                     META: tl.constexpr):
    """What the epilogue reads besides the product: the residual tile (EPILOGUE_RESIDUAL), or
    each row's position and cache slot with cos and sin at the tile's columns of each head's two
    halves (EPILOGUE_ROTARY); zeros for what the epilogue does not use."""
    base = tl.zeros(out_ok.shape, tl.float32)
    pos = tl.zeros(rows.shape, tl.int64)
    slot = tl.zeros(rows.shape, tl.int64)
    cos_a = base
    sin_a = base
    cos_b = base
    sin_b = base
    if EPILOGUE == 1:
        # Each element is read and written by this program alone, so `add` may alias `out`.
        base = tl.load(add_ptr + row64 * N + col_a[None, :], mask=out_ok, other=0.0).to(tl.float32)
    elif EPILOGUE == 3:
        pos = tl.load(pos_ptr + rows, mask=rows < M, other=0, cache_modifier=META).to(tl.int64)
        slot = tl.load(slot_ptr + rows, mask=rows < M, other=0, cache_modifier=META).to(tl.int64)
        # As layer_kernels' rotary kernel: a bad index writes padding row 0, nothing outside.
        ok = (slot >= 0) & (slot < cache_rows) & (pos >= 0) & (pos < seq_len) & (pos < table_rows)
        pos = tl.where(ok, pos, 0)
        slot = tl.where(ok, slot, 0)
        table = pos[:, None] * D + (col_a % D)[None, :]  # column j of the head's first half
        cos_a = tl.load(cos_ptr + table, mask=out_ok, other=0.0)
        sin_a = tl.load(sin_ptr + table, mask=out_ok, other=0.0)
        cos_b = tl.load(cos_ptr + table + D // 2, mask=out_ok, other=0.0)
        sin_b = tl.load(sin_ptr + table + D // 2, mask=out_ok, other=0.0)
    return base, pos, slot, cos_a, sin_a, cos_b, sin_b


# The row count and cache sizes vary by bucket and model: one compiled variant serves them all.
@triton.jit(do_not_specialize=("M", "table_rows", "cache_rows", "seq_len"))
def _skinny_linear_kernel(
    x_ptr,  # [M, K]: the input (NORM: the residual stream, or the pending update when HAS_RESIDUAL)
    res_in_ptr,  # [M, K] residual stream added to x before the norm (HAS_RESIDUAL)
    res_out_ptr,  # [M, K] receives x + res_in (HAS_RESIDUAL); must not alias either input
    norm_w_ptr,  # [K] RMSNorm weight (NORM)
    w_ptr,  # [N, K]; [2 N, K] for SILU_MUL (gate rows, then up rows)
    add_ptr,  # [M, N] residual added to the projection (EPILOGUE_RESIDUAL); may alias out
    out_ptr,  # [M, N]; [M, I] for SILU_MUL; [M, H, D] rotated q for ROTARY
    cos_ptr,  # ROTARY: [table_rows, D] float32
    sin_ptr,
    pos_ptr,  # ROTARY: [M] int32/int64
    slot_ptr,
    k_cache_ptr,  # ROTARY: [cache_rows, seq_len, KVH, D]
    v_cache_ptr,
    part_ptr,  # SPLIT_K > 1: float32 partial products, [output tiles, SPLIT_K, BLOCK_M, BLOCK_N]
    done_ptr,  # SPLIT_K > 1: int32 per output tile, its splits done (zero between calls)
    M,
    eps,
    table_rows,
    cache_rows,
    seq_len,
    N: tl.constexpr,  # the projection's output features (SILU_MUL: of each half)
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EPILOGUE: tl.constexpr,
    H: tl.constexpr,  # ROTARY: q heads, KV heads, head dim (N = (H + 2 KVH) D)
    KVH: tl.constexpr,
    D: tl.constexpr,
    DOT_F32: tl.constexpr,  # a float32 IEEE dot (float32 inputs, or the interpreter: see _launch)
    FMA: tl.constexpr,  # one row per program, no tensor-core dot (see _launch)
    EARLY: tl.constexpr,  # epilogue inputs requested before the product (Tiles.early; always with FMA)
    SWAP: tl.constexpr,  # the tensor-core product as w @ x.T (Tiles.swap)
    SPLIT_K: tl.constexpr,  # programs per output tile, each over K_STEPS of the K steps (Tiles.split_k)
    K_STEPS: tl.constexpr,
    USE_PDL: tl.constexpr,
    SETTLED: tl.constexpr,  # ROTARY only: positions and slots settled (Rotary.settled), read before the PDL wait
    LINE: tl.constexpr,  # weight elements per 128-byte line
    LINES: tl.constexpr,  # next power of two >= the lines of one weight row
):
    pid_n = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if EPILOGUE == 3:
        # Tile column idx is element j of head `head`'s first half; its partner is D/2 on.
        head = idx // (D // 2)
        j = idx % (D // 2)
        col_a = head * D + j
        col_b = col_a + D // 2
        idx_ok = idx < N // 2
    else:
        col_a = idx
        col_b = idx + N  # SILU_MUL: the up row of gate row idx
        idx_ok = idx < N
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows[:, None] < M
    dtype = x_ptr.dtype.element_ty
    x_rows = x_ptr + rows[:, None].to(tl.int64) * K
    res_rows = res_in_ptr + rows[:, None].to(tl.int64) * K
    w_a = w_ptr + col_a[:, None].to(tl.int64) * K
    w_b = w_ptr + col_b[:, None].to(tl.int64) * K
    w_ok = idx_ok[:, None]

    if FMA:
        # The weights depend on no earlier kernel: the first (usually the whole-K) tile is
        # requested into registers before the PDL wait.
        wa = tl.load(w_a + ks[None, :], mask=w_ok & (ks[None, :] < K), other=0.0)
        if EPILOGUE >= 2:
            wb = tl.load(w_b + ks[None, :], mask=w_ok & (ks[None, :] < K), other=0.0)
    out_ok = row_ok & idx_ok[None, :]
    row64 = rows[:, None].to(tl.int64)
    if EARLY and SETTLED:
        # Positions and slots from two or more launches back, past L1 (".cg"), and the rotary
        # table rows they pick (constant): the chain of two dependent loads runs under the
        # previous kernel's tail instead of after the wait.
        base, pos, slot, cos_a, sin_a, cos_b, sin_b = _epilogue_inputs(
            add_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, rows, row64, col_a, out_ok, M, N,
            table_rows, cache_rows, seq_len, EPILOGUE, D, ".cg")
    if USE_PDL:
        # While the previous kernel finishes, the rest of the weight streams into L2 too.
        if BLOCK_K < K:
            _prefetch_rows_to_l2(w_a, w_ok, K, LINE, LINES)
            if EPILOGUE >= 2:
                _prefetch_rows_to_l2(w_b, w_ok, K, LINE, LINES)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    if EARLY and not SETTLED:
        # The epilogue inputs (residual tile; rotary positions, slots and table rows) do not
        # depend on the product: requested now, their latency hides under the dot instead of
        # following it (one row at a time, the kernel is a chain of memory latencies). Held
        # through a tensor-core tile's pipelined loop they may cost more than they save (H100:
        # +2.6% at 64 decode rows, -6% at 256), so there it is a tiling the start-up plan times.
        base, pos, slot, cos_a, sin_a, cos_b, sin_b = _epilogue_inputs(
            add_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, rows, row64, col_a, out_ok, M, N,
            table_rows, cache_rows, seq_len, EPILOGUE, D, "")

    if NORM:
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        # Unrolled (K is a constant): every step's loads issue before the first sum needs one,
        # one memory latency for the pass rather than one per step.
        for k0 in tl.static_range(0, K, BLOCK_K):
            k_ok = row_ok & (k0 + ks[None, :] < K)
            h = tl.load(x_rows + k0 + ks[None, :], mask=k_ok, other=0.0)
            if HAS_RESIDUAL:
                # The add in the model dtype, as torch's `x + residual`. One column of programs
                # stores it; res_out is a fresh buffer, so no program reads a value another wrote.
                r = tl.load(res_rows + k0 + ks[None, :], mask=k_ok, other=0.0)
                h = _round_to(h.to(tl.float32) + r.to(tl.float32), dtype)
                if pid_n == 0:
                    tl.store(res_out_ptr + rows[:, None].to(tl.int64) * K + k0 + ks[None, :], h, mask=k_ok)
            hf = h.to(tl.float32)
            sum_sq += tl.sum(hf * hf, axis=1)
        # IEEE sqrt and divide, as layer_kernels' rms_norm (tl.rsqrt is approximate on the GPU).
        rstd = tl.div_rn(1.0, tl.sqrt_rn(sum_sq / K + eps))

    if SWAP:
        acc_a = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc_a = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SPLIT_K == 1:
        k_lo = 0
        k_hi = K
    else:
        k_lo = tl.program_id(2) * (K_STEPS * BLOCK_K)
        k_hi = tl.minimum(k_lo + K_STEPS * BLOCK_K, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = row_ok & (k0 + ks[None, :] < K)
        x = tl.load(x_rows + k0 + ks[None, :], mask=k_ok, other=0.0)
        if NORM:
            if HAS_RESIDUAL:
                r = tl.load(res_rows + k0 + ks[None, :], mask=k_ok, other=0.0)
                x = _round_to(x.to(tl.float32) + r.to(tl.float32), dtype)
            # [1, BLOCK_K]: loaded in x's own layout, not converted to it.
            nw = tl.load(norm_w_ptr + k0 + ks[None, :], mask=k0 + ks[None, :] < K, other=0.0)
            # Llama's order: normalize in float32, round, then scale by the weight in the model dtype.
            normed = _round_to(x.to(tl.float32) * rstd[:, None], dtype)
            x = _round_to(nw.to(tl.float32) * normed.to(tl.float32), dtype)
        if FMA:
            acc_a = _dot(x, wa, acc_a, DOT_F32, FMA, SWAP)
            if EPILOGUE >= 2:
                acc_b = _dot(x, wb, acc_b, DOT_F32, FMA, SWAP)
            # The next step's weight tile (fully masked, so no traffic, after the last step).
            next_ok = w_ok & (k0 + BLOCK_K + ks[None, :] < K)
            wa = tl.load(w_a + k0 + BLOCK_K + ks[None, :], mask=next_ok, other=0.0)
            if EPILOGUE >= 2:
                wb = tl.load(w_b + k0 + BLOCK_K + ks[None, :], mask=next_ok, other=0.0)
        else:
            # Plain loads in the loop: Triton's pipeliner issues them `stages` steps ahead as
            # async copies, x included (a hand-written one-step weight prefetch left each step
            # waiting a memory latency for x: 1.2-2x slower at 16-256 rows on the H200).
            w_ok_k = w_ok & (k0 + ks[None, :] < K)
            wa = tl.load(w_a + k0 + ks[None, :], mask=w_ok_k, other=0.0)
            acc_a = _dot(x, wa, acc_a, DOT_F32, FMA, SWAP)
            if EPILOGUE >= 2:
                wb = tl.load(w_b + k0 + ks[None, :], mask=w_ok_k, other=0.0)
                acc_b = _dot(x, wb, acc_b, DOT_F32, FMA, SWAP)

    if SWAP:
        acc_a = tl.trans(acc_a)
        acc_b = tl.trans(acc_b)
    if SPLIT_K > 1:
        # Each split stores its partial; the last of a tile's splits to finish (an
        # acquire-release count, as varlen attention merges its key splits) sums them in split
        # order, so the result is the same whichever finishes last, and runs the epilogue.
        tile = tl.program_id(1) * tl.num_programs(0) + pid_n
        cell = part_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
        at = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(cell + tl.program_id(2) * (BLOCK_M * BLOCK_N) + at, acc_a)
        tl.debug_barrier()  # every thread's stores before the release
        if tl.atomic_add(done_ptr + tile, 1, sem="acq_rel") != SPLIT_K - 1:
            return
        tl.debug_barrier()
        tl.atomic_xchg(done_ptr + tile, 0)
        # From L2, past this SM's L1, which other SMs' stores do not update.
        acc_a = tl.load(cell + at, cache_modifier=".cg")
        for split in tl.static_range(1, SPLIT_K):
            acc_a += tl.load(cell + split * (BLOCK_M * BLOCK_N) + at, cache_modifier=".cg")
    # The projection's own outputs, rounded as torch's matmul stores them.
    ya = _round_to(acc_a, dtype).to(tl.float32)
    yb = _round_to(acc_b, dtype).to(tl.float32)
    if not EARLY:
        base, pos, slot, cos_a, sin_a, cos_b, sin_b = _epilogue_inputs(
            add_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, rows, row64, col_a, out_ok, M, N,
            table_rows, cache_rows, seq_len, EPILOGUE, D, "")
    if EPILOGUE == 3:
        # torch's ops in torch's order (x * cos + rotated * sin, rotated = cat(-x2, x1)), no FMA.
        is_qk = (head < H + KVH)[None, :]
        ra = _round_to(tl.where(is_qk, ya * cos_a + (-yb) * sin_a, ya), dtype)
        rb = _round_to(tl.where(is_qk, yb * cos_b + ya * sin_b, yb), dtype)
        q_ok = out_ok & (head < H)[None, :]
        q_at = out_ptr + row64 * (H * D) + col_a[None, :]
        tl.store(q_at, ra, mask=q_ok)
        tl.store(q_at + D // 2, rb, mask=q_ok)
        cache_row = (slot * seq_len + pos)[:, None] * (KVH * D)
        k_ok = out_ok & ((head >= H) & (head < H + KVH))[None, :]
        k_at = k_cache_ptr + cache_row + (col_a - H * D)[None, :]
        # A float8 cache (capture.model.kv_cache; K and V share its dtype) takes each value
        # rounded again, from the model dtype.
        ca = _to_cache(ra, k_cache_ptr.dtype.element_ty)
        cb = _to_cache(rb, k_cache_ptr.dtype.element_ty)
        tl.store(k_at, ca, mask=k_ok)
        tl.store(k_at + D // 2, cb, mask=k_ok)
        v_ok = out_ok & (head >= H + KVH)[None, :]
        v_at = v_cache_ptr + cache_row + (col_a - (H + KVH) * D)[None, :]
        tl.store(v_at, ca, mask=v_ok)
        tl.store(v_at + D // 2, cb, mask=v_ok)
    else:
        y = ya
        if EPILOGUE == 1:
            y = y + base
        elif EPILOGUE == 2:
            # layer_kernels.silu_mul's math: silu rounded to the model dtype, then `* up`.
            silu = _round_to(tl.div_rn(ya, 1.0 + tl.exp(-ya)), dtype)
            y = silu.to(tl.float32) * yb
        tl.store(out_ptr + row64 * N + col_a[None, :], _round_to(y, dtype), mask=out_ok)


def _launch(x, weight, out, *, n, epilogue, pdl, norm_weight=None, eps=0.0, residual=None, residual_out=None,
            add=None, rotary=None, tiles=None, workspace=None):
    m, k = x.shape
    if tiles is None:
        tiles = default_tiles(m, k)
    block_m, block_n, block_k, warps, fma, early, swap, split_k, stages = check_tiles(tiles)
    if split_k > 1 and (epilogue != EPILOGUE_RESIDUAL or norm_weight is not None):
        raise ValueError(f"split_k tilings serve linear_residual only (O and down projections), got {tiles}")
    part = done = x
    if split_k > 1:
        if workspace is None:  # eager convenience; a captured call passes the one allocated up front
            workspace = SplitKWorkspace(m, n, x.device, split_k)
        workspace.check(m, n, tiles)
        part, done = workspace.partials, workspace.done
    tile_cols = n // 2 if epilogue == EPILOGUE_ROTARY else n
    rot = rotary or Rotary(x, x, x, x, x, x, 0, 0)
    d = rot.k_cache.shape[3] if rotary else 2
    cache_rows, seq_len = rot.k_cache.shape[:2] if rotary else (0, 0)
    extra = {"launch_pdl": True} if pdl else {}
    pipeline = {} if fma else {"num_stages": pipeline_stages(tiles, x.element_size())}
    _skinny_linear_kernel[(triton.cdiv(tile_cols, block_n), triton.cdiv(m, block_m), split_k)](
        x, x if residual is None else residual, x if residual_out is None else residual_out,
        x if norm_weight is None else norm_weight, weight, out if add is None else add, out,
        rot.cos, rot.sin, rot.positions, rot.slots, rot.k_cache, rot.v_cache, part, done,
        m, eps, rot.cos.shape[0], cache_rows, seq_len,
        N=n, K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm_weight is not None,
        HAS_RESIDUAL=residual is not None, EPILOGUE=epilogue, H=rot.num_heads, KVH=rot.num_kv_heads, D=d,
        # NOTE: the interpreter multiplies bfloat16 dot operands as their raw uint16 bits: upcast there.
        DOT_F32=x.dtype == torch.float32 or not x.is_cuda, FMA=fma, EARLY=fma or early, SWAP=swap,
        SPLIT_K=split_k, K_STEPS=triton.cdiv(triton.cdiv(k, block_k), split_k), USE_PDL=pdl,
        # Without PDL "before the wait" is just earlier: the same values (so the interpreter runs it too).
        SETTLED=bool(rotary is not None and rotary.settled),
        LINE=128 // weight.element_size(), LINES=triton.next_power_of_2(triton.cdiv(k * weight.element_size(), 128)),
        num_warps=warps, **pipeline,
        # a*b + c*d contracted to an FMA would round the rotation differently from torch.
        enable_fp_fusion=epilogue != EPILOGUE_ROTARY, **extra,
    )
    return out


def _check_norm_inputs(what, x, norm_weight, weight, residual, residual_out, *, halves: int = 1) -> int:
    """Shapes for the norm-prologue kernels; returns the weight's row count."""
    m, k = _expect_2d(f"{what} x", x)
    dev, dtypes = x.device, (x.dtype,)
    _expect(f"{what} x", x, (m, k), dtypes, dev)
    _expect(f"{what} norm_weight", norm_weight, (k,), dtypes, dev)
    w_rows, _ = _expect_2d(f"{what} weight", weight)
    if w_rows % halves:
        raise ValueError(f"{what} weight has {w_rows} rows; gate/up needs an even count (gate rows, then up rows)")
    _expect(f"{what} weight", weight, (w_rows, k), dtypes, dev)
    for name, t in (("residual", residual), ("residual_out", residual_out)):
        if t is not None:
            _expect(f"{what} {name}", t, (m, k), dtypes, dev)
    if residual is None and residual_out is not None:
        raise ValueError(f"{what} residual_out needs residual (it receives x + residual)")
    if residual_out is not None and residual_out.data_ptr() in (x.data_ptr(), residual.data_ptr()):
        raise ValueError(f"{what} residual_out must not alias x or residual: other programs still read them")
    return w_rows


def _unfused_norm(x, norm_weight, eps, residual, residual_out):
    """layer_kernels' norm node: (normed, x + residual or None)."""
    if residual is None:
        return lk.rms_norm(x, norm_weight, eps), None
    return lk.rms_norm(x, norm_weight, eps, residual=residual, residual_out=residual_out)


def _fused_norm_launch(x, norm_weight, weight, eps, residual, residual_out, out, *, n, epilogue, pdl, tiles,
                       rotary=None):
    if residual is not None and residual_out is None:
        residual_out = torch.empty_like(x)
    _launch(x, weight, out, n=n, epilogue=epilogue, pdl=resolve_pdl(pdl, x), norm_weight=norm_weight, eps=eps,
            residual=residual, residual_out=residual_out, rotary=rotary, tiles=tiles)
    return out if residual is None else (out, residual_out)


# ----------------------------------------------------------------------------------------------
# (residual add +) RMSNorm + projection (+ SiLU * up, or + rotary and the K/V append)


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
    tiles: Tiles | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm(x) @ weight.T` for x `[m, k]`, weight `[n, k]`, norm_weight `[k]`.

    With `residual` `[m, k]`: h = x + residual first (the model dtype); returns
    `(rms_norm(h) @ weight.T, h)`, exactly as `layer_kernels.rms_norm(x, ..., residual=...)`
    followed by the matmul. `out` `[m, n]` / `residual_out` `[m, k]` receive the results;
    residual_out may not alias x or residual. pdl: see the module docstring (None: auto).
    tiles: the launch's tiling (None: `default_tiles`); it changes the sum order only.
    """
    n = _check_norm_inputs("norm_linear", x, norm_weight, weight, residual, residual_out)
    if out is not None:
        _expect("norm_linear out", out, (x.shape[0], n), (x.dtype,), x.device)
    if _pick_backend(backend, x) == "torch":
        h, total = _unfused_norm(x, norm_weight, eps, residual, residual_out)
        y = torch.matmul(h, weight.T, out=out)
        return y if residual is None else (y, total)
    out = x.new_empty(x.shape[0], n) if out is None else out
    return _fused_norm_launch(x, norm_weight, weight, eps, residual, residual_out, out, n=n,
                              epilogue=EPILOGUE_NONE, pdl=pdl, tiles=tiles)


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
    tiles: Tiles | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU's first half: `silu_mul(rms_norm(x) @ gate_up.T)` -> `[m, i]`, gate_up `[2 i, k]`
    (gate rows first, as the model stores it). `residual`, `out`, `residual_out`, `pdl`, `tiles` as in
    `norm_linear`."""
    inter = _check_norm_inputs("norm_gate_up_silu", x, norm_weight, gate_up, residual, residual_out, halves=2) // 2
    if out is not None:
        _expect("norm_gate_up_silu out", out, (x.shape[0], inter), (x.dtype,), x.device)
    if _pick_backend(backend, x) == "torch":
        h, total = _unfused_norm(x, norm_weight, eps, residual, residual_out)
        y = lk.silu_mul(h @ gate_up.T, out=out)
        return y if residual is None else (y, total)
    out = x.new_empty(x.shape[0], inter) if out is None else out
    return _fused_norm_launch(x, norm_weight, gate_up, eps, residual, residual_out, out, n=inter,
                              epilogue=EPILOGUE_SILU_MUL, pdl=pdl, tiles=tiles)


def norm_qkv_rotary(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    qkv: torch.Tensor,
    eps: float,
    rotary: Rotary,
    *,
    residual: torch.Tensor | None = None,
    q_out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    backend: str | None = None,
    pdl: bool | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention's input node: `rotary_and_cache_write(rms_norm(x) @ qkv.T, ...)`: returns the
    rotated q `[m, num_heads, d]` (in `q_out` when given) after appending rotated k and raw v
    to the caches at each row's `[slot, position]`. qkv `[(h + 2 kvh) d, k]` (q, k, v heads in
    order); `rotary` and the index rules as `layer_kernels.rotary_and_cache_write`; `residual`,
    `residual_out`, `pdl`, `tiles` as in `norm_linear`."""
    if not isinstance(rotary, Rotary):
        raise ValueError(f"norm_qkv_rotary rotary must be a gemv.Rotary, got {type(rotary).__name__}")
    width = _check_norm_inputs("norm_qkv_rotary", x, norm_weight, qkv, residual, residual_out)
    _check_rotary(x.shape[0], width, x.dtype, x.device, rotary.cos, rotary.sin, rotary.positions, rotary.k_cache,
                  rotary.v_cache, rotary.slots, rotary.num_heads, rotary.num_kv_heads, q_out)
    if _pick_backend(backend, x) == "torch":
        h, total = _unfused_norm(x, norm_weight, eps, residual, residual_out)
        r = rotary
        q = lk.rotary_and_cache_write(h @ qkv.T, r.cos, r.sin, r.positions, r.k_cache, r.v_cache, r.slots,
                                      r.num_heads, r.num_kv_heads, q_out=q_out)
        return q if residual is None else (q, total)
    q_out = x.new_empty(x.shape[0], rotary.num_heads, rotary.k_cache.shape[3]) if q_out is None else q_out
    return _fused_norm_launch(x, norm_weight, qkv, eps, residual, residual_out, q_out, n=width,
                              epilogue=EPILOGUE_ROTARY, pdl=pdl, rotary=rotary, tiles=tiles)


# ----------------------------------------------------------------------------------------------
# projection + residual add


def linear_residual(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    backend: str | None = None,
    pdl: bool | None = None,
    tiles: Tiles | None = None,
    workspace: SplitKWorkspace | None = None,
) -> torch.Tensor:
    """`residual + x @ weight.T` with the projection rounded to the model dtype first (as the
    model's `update = x @ w.T; stream = update + stream`): x `[m, k]`, weight `[n, k]`, residual
    `[m, n]`. `out` may be `residual` itself (an in-place update of the stream). `pdl`, `tiles`
    as in `norm_linear`; a split-K tiling uses `workspace` (one allocated per call when None,
    so pass one under capture)."""
    m, k = _expect_2d("linear_residual x", x)
    dev, dtypes = x.device, (x.dtype,)
    _expect("linear_residual x", x, (m, k), dtypes, dev)
    n, _ = _expect_2d("linear_residual weight", weight)
    _expect("linear_residual weight", weight, (n, k), dtypes, dev)
    _expect("linear_residual residual", residual, (m, n), dtypes, dev)
    if out is not None:
        _expect("linear_residual out", out, (m, n), dtypes, dev)
    if _pick_backend(backend, x) == "torch":
        return torch.add(x @ weight.T, residual, out=out)
    out = torch.empty_like(residual) if out is None else out
    return _launch(x, weight, out, n=n, epilogue=EPILOGUE_RESIDUAL, pdl=resolve_pdl(pdl, x), add=residual,
                   tiles=tiles, workspace=workspace)
