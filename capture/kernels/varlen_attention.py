"""Varlen attention: every query token of a flat mixed batch over the static KV cache.

One iteration's T query tokens come from spans: a decode row (1 token), a speculative verify
span (k + 1 tokens) or a prefill chunk (n tokens). Token t belongs to slot `token_slot[t]` at
position `token_pos[t]` and attends keys `0 ..= token_pos[t]` of that slot; the span's own K/V
are already in the cache, so this one rule is "causal inside a span, full over its cached
prefix". Query head j reads KV head `j // (heads // kv_heads)`.

The cache `[num_slots, max_seq_len, kvh, d]` is read as pages: viewed as
`[num_slots * pages_per_slot, page, kvh, d]`, logical position p of slot s lives at physical page
`block_table[s, p // page]`, row `p % page`. The page size is `max_seq_len // pages_per_slot`
(the table's width), so a paged cache or shared prefixes need a new table, not a new kernel.
Without a table (`block_table=None`) each slot's keys are its own contiguous rows (what
`identity_block_table` maps): the kernel computes a key's row from the slot instead of loading
it, one dependent load fewer per key tile (on an H100, a 2,048-token prefill 7% faster).

Work comes in q-blocks, built on the host (`capture.kernels.q_blocks`): up to `q_block`
consecutive flat tokens of one span (`Q_BLOCK` by default; a static per-bucket choice:
decode-only buckets can use 1, so their programs do the old decode kernel's work and no more).
Grid `(num_blocks, kvh, num_splits)`: a program stacks its block's tokens x the query heads of
one KV head as the M rows of `tl.dot` (so K/V tiles are read once per group and block), walks
key tiles `split, split + S, ...` up to the block's last position with an online softmax in
float32, and masks each row at its own position. A block of length 0 is padding and returns at
once. With S > 1 the splits write normalized partials and log-sum-exps (base 2) to a
`VarlenWorkspace`, and the last of a (block, KV head)'s S programs to finish merges them: each
program counts itself done on a per-(block, KV head) counter with an acquire-release atomic
after its stores, and the one that sees S - 1 before it reads the partials (from L2, past the
SM's L1, which other SMs' stores do not update) and resets the counter for the next call. So a
split costs no second kernel (one graph node per layer fewer), and the counters are zero
between calls. S is a function of static shapes only.

Tokens that no q-block covers (padding tokens) are left untouched in `out`, by both backends.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import triton
import triton.language as tl

from graphrelay.capture.kernels.attention import (
    _LOG2E,
    BLOCK_N,
    MIN_BLOCKS_PER_SPLIT,
    TARGET_PROGRAMS_PER_SM,
    AttentionWorkspace,
    _check_cache_args,
    _check_max_len,
    _check_out,
    _sm_count,
    attend_gathered,
    pick_num_splits,
)
from graphrelay.capture.kernels.layer_kernels import CACHE_FLOAT8
from graphrelay.capture.kernels.pdl import pdl_supported
from graphrelay.capture.kernels.q_blocks import Q_BLOCK, check_q_block, max_q_blocks

DECODE_KEY_TILE = 128  # key tile of narrow decode-only grids (see key_tile)
DECODE_PROGRAMS_PER_SM = 1  # decode-only buckets split until their grid has this many per SM
WIDE_GRID_PER_SM = 4  # decode grids of at least this many programs per SM keep BLOCK_N-key tiles (see key_tile)
WIDE_DECODE_PROGRAMS_PER_SM = 6  # programs of a wide decode grid each SM is to hold at once (see register_cap)
REGISTERS_PER_SM = 65536  # 32-bit registers in one SM's register file (Ampere, Hopper)
WARPS = 4  # warps per program, every launch
PAGE = 16  # default page size of `identity_block_table`; the kernel takes any size from the table
# Key rows the reference gathers at once (per K and V): bounds its memory whatever T is.
_REFERENCE_KEY_ROWS = 1 << 16


@triton.jit
def _tile_rows(table_row, slot, max_seq_len, keys, key_ok, num_pages, PAGE: tl.constexpr, PAGED: tl.constexpr,
               CACHE: tl.constexpr):
    """Rows of the cache viewed as `[num_slots * max_seq_len]` for a tile of logical keys, through
    the slot's block table (a bad page reads page 0: its result is unspecified, never outside),
    or without one (PAGED off) the slot's own contiguous rows."""
    if PAGED:
        page = tl.load(table_row + keys // PAGE, mask=key_ok, other=0, cache_modifier=CACHE).to(tl.int64)
        page = tl.where((page >= 0) & (page < num_pages), page, 0)
        return page * PAGE + keys % PAGE
    return slot * max_seq_len + tl.where(key_ok, keys, 0)


@triton.jit
def _attend_tile(q, k_base, v_base, at, keys, key_ok, pos, d, stride_kp, stride_vp, qk_scale, m, l, acc,
                 PRECISION: tl.constexpr, NATIVE_DOT: tl.constexpr, VALUE_TY: tl.constexpr):
    """One key tile into the running online softmax (m, l, acc) of the block's rows."""
    k = tl.load(k_base + at[:, None] * stride_kp + d[None, :], mask=key_ok[:, None], other=0.0)
    # V is requested with K, not after the scores: a decode row's only tile then waits one
    # memory latency for both instead of two in a row (the dot's shared-memory barrier keeps
    # the compiler from hoisting a later load above it).
    v = tl.load(v_base + at[:, None] * stride_vp + d[None, :], mask=key_ok[:, None], other=0.0)
    # A float8 cache (capture.model.kv_cache) widens exactly to the model dtype (VALUE_TY);
    # a cache of the model dtype is left as loaded.
    k = k.to(VALUE_TY)
    v = v.to(VALUE_TY)
    if NATIVE_DOT:
        s = tl.dot(q, tl.trans(k))
    else:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION)
    s = tl.where(keys[None, :] <= pos[:, None], s * qk_scale, float("-inf"))  # [ROWS, BLOCK]
    m_new = tl.maximum(m, tl.max(s, 1))
    # A row may see no key yet: a tile past its position (earlier tokens of a prefill
    # block, or a split that starts late) or a pad row. Shift by 0 then, so exp2 gives 0
    # rather than exp2(-inf + inf) = NaN.
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - shift)
    p = tl.exp2(s - shift[:, None])
    l = l * alpha + tl.sum(p, 1)
    # Probabilities rounded to the value dtype, as the reference casts them for its einsum.
    p = p.to(v.dtype)
    if NATIVE_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision=PRECISION)
    return m_new, l, acc


@triton.jit
def _wait_then_release(ON: tl.constexpr):
    """The PDL wait for the previous kernel, then the next kernel's go-ahead. Every program
    passes here before it ends, an early exit included: a grid that ends has then seen its
    predecessor end (capture.kernels.pdl)."""
    if ON:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _varlen_split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, slot_ptr, pos_ptr, block_start_ptr, block_len_ptr,
    out_ptr, part_ptr, lse_ptr, done_ptr,
    stride_qt, stride_qh, stride_kp, stride_kh, stride_vp, stride_vh, stride_table, stride_ot,
    num_slots, max_seq_len, qk_scale,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, Q_TOKENS: tl.constexpr, ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr, SINGLE: tl.constexpr,
    SPLIT_TILES: tl.constexpr, PRECISION: tl.constexpr, NATIVE_DOT: tl.constexpr, USE_PDL: tl.constexpr,
    SETTLED: tl.constexpr, META: tl.constexpr,
):
    # Unsettled, every input (q, the cache, the q-blocks) may come from the previous kernel:
    # wait for it first, then let the next kernel (the O projection streaming its weights)
    # start filling the GPU behind this one; its own wait covers this grid's merges too.
    # SETTLED: the caller guarantees the metadata (q-blocks, slots, positions, block table) was
    # written two or more kernels before this one (capture.kernels.pdl), so the chain of
    # dependent loads from a block's length to its first tile's cache rows runs before the
    # wait, under the previous kernel's tail, from L2 (META ".cg": L1 may hold the previous
    # iteration's values). Only q and the cache (this step's K/V, just appended) wait.
    _wait_then_release(USE_PDL and not SETTLED)
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    # A length past Q_TOKENS breaks the caller's contract; the clamp keeps it to the rows built.
    # Both loads before the branch: one memory latency, not two, ahead of the slot and positions
    # they lead to (the kernel is a chain of dependent loads at decode sizes).
    count = tl.minimum(tl.load(block_len_ptr + block, cache_modifier=META).to(tl.int32), Q_TOKENS)
    first = tl.load(block_start_ptr + block, cache_modifier=META).to(tl.int64)
    if count <= 0:  # padding
        _wait_then_release(USE_PDL and SETTLED)
        return

    # Row r of the dot is token r // GROUP of the block, query head r % GROUP of this KV
    # head's group; ROWS pads Q_TOKENS * GROUP to a power of two >= 16 (pad rows: past count).
    r = tl.arange(0, ROWS)
    row_ok = r // GROUP < count
    token = first + r // GROUP
    heads = kv_head * GROUP + r % GROUP
    d = tl.arange(0, HEAD_DIM)

    # Values are the caller's contract; clamping only keeps a bad one from reading outside
    # the cache (its result is unspecified). Rows past the block see no key (position -1).
    slot = tl.load(slot_ptr + first, cache_modifier=META).to(tl.int64)
    slot = tl.where((slot >= 0) & (slot < num_slots), slot, 0)
    pos = tl.load(pos_ptr + token, mask=row_ok, other=0, cache_modifier=META).to(tl.int32)
    pos = tl.where(row_ok, tl.minimum(tl.maximum(pos, 0), max_seq_len - 1), -1)
    last = tl.max(pos, 0)
    # The block's own split count: one split per SPLIT_TILES key tiles it walks, at most the
    # grid's. A short block (a decode row early in its sequence) runs whole in split 0 and
    # writes `out` itself; a long one (a prompt chunk deep in its prompt) spreads its walk.
    if SINGLE:
        used = 1
    else:
        used = tl.minimum((last + BLOCK * SPLIT_TILES) // (BLOCK * SPLIT_TILES), num_splits)
    if split >= used:
        _wait_then_release(USE_PDL and SETTLED)
        return
    num_pages = num_slots * (max_seq_len // PAGE)
    table_row = table_ptr + slot * stride_table
    # The first tile (split <= last: every used split has one) is peeled from the loop so that
    # its cache rows are known before the wait.
    keys = split * BLOCK + tl.arange(0, BLOCK)
    key_ok = keys <= last
    at = _tile_rows(table_row, slot, max_seq_len, keys, key_ok, num_pages, PAGE, PAGED, META)
    _wait_then_release(USE_PDL and SETTLED)

    # NATIVE_DOT (bf16/fp16 on a GPU): the tensor cores take the cache dtype with float32
    # accumulation. Otherwise dots run on float32 operands: bf16/fp16 values are exact in
    # tf32, so PRECISION "tf32" gives the same products (Triton's interpreter mis-multiplies
    # bf16 dots), and float32 models use "ieee" to keep reference accuracy.
    q = tl.load(q_ptr + token[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)  # [ROWS, D]
    if not NATIVE_DOT:
        q = q.to(tl.float32)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh

    m = tl.full([ROWS], float("-inf"), tl.float32)  # running max, log2 units
    l = tl.zeros([ROWS], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    m, l, acc = _attend_tile(q, k_base, v_base, at, keys, key_ok, pos, d, stride_kp, stride_vp, qk_scale,
                             m, l, acc, PRECISION, NATIVE_DOT, out_ptr.dtype.element_ty)
    for start in range((split + used) * BLOCK, last + 1, used * BLOCK):
        keys = start + tl.arange(0, BLOCK)
        key_ok = keys <= last
        at = _tile_rows(table_row, slot, max_seq_len, keys, key_ok, num_pages, PAGE, PAGED, "")
        m, l, acc = _attend_tile(q, k_base, v_base, at, keys, key_ok, pos, d, stride_kp, stride_vp, qk_scale,
                                 m, l, acc, PRECISION, NATIVE_DOT, out_ptr.dtype.element_ty)

    seen = l > 0
    o = acc / tl.where(seen, l, 1.0)[:, None]
    out_at = out_ptr + token[:, None] * stride_ot + heads[:, None] * HEAD_DIM + d[None, :]
    # Every real row sees key 0, so l > 0 on the rows stored directly.
    if SINGLE:  # static: no workspace, no counters to compile against
        tl.store(out_at, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    elif used == 1:
        tl.store(out_at, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # A split whose tiles all lie past a row's position saw nothing: a neutral partial
        # (lse -inf, zeros) that the merge weighs by exp2(-inf) = 0.
        lse = tl.where(seen, m + tl.log2(tl.where(seen, l, 1.0)), float("-inf"))
        cell = (token * NUM_HEADS + heads) * num_splits  # split 0's cell in [T, h, S]
        tl.store(part_ptr + (cell + split)[:, None] * HEAD_DIM + d[None, :], o, mask=row_ok[:, None])
        tl.store(lse_ptr + cell + split, lse, mask=row_ok)
        # Every thread's stores before the release; the last split sees them all after its acquire.
        tl.debug_barrier()
        done = done_ptr + block * NUM_HEADS + kv_head
        if tl.atomic_add(done, 1, sem="acq_rel") == used - 1:
            tl.debug_barrier()
            tl.atomic_xchg(done, 0)
            _merge_splits(part_ptr, lse_ptr, out_ptr, cell, token, heads, row_ok, stride_ot, used,
                          HEAD_DIM, ROWS)


@triton.jit
def _merge_splits(part_ptr, lse_ptr, out_ptr, cell, token, heads, row_ok, stride_ot, used,
                  HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """The rows' `used` partials merged by their log-sum-exps into `out`. Loads bypass L1
    (".cg"): the partials were stored by other SMs."""
    d = tl.arange(0, HEAD_DIM)
    # Split 0 holds key 0, which every row sees: its finite lse anchors the running merge.
    m = tl.load(lse_ptr + cell, mask=row_ok, other=0.0, cache_modifier=".cg")
    weight = tl.full([ROWS], 1.0, tl.float32)
    acc = tl.load(part_ptr + cell[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None], other=0.0,
                  cache_modifier=".cg")
    for other in range(1, used):
        lse = tl.load(lse_ptr + cell + other, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(lse - m_new)
        part = tl.load(part_ptr + (cell + other)[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None], other=0.0,
                       cache_modifier=".cg")
        acc = acc * alpha[:, None] + beta[:, None] * part
        weight = weight * alpha + beta
        m = m_new
    tl.store(out_ptr + token[:, None] * stride_ot + heads[:, None] * HEAD_DIM + d[None, :],
             (acc / weight[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


# ----------------------------------------------------------------------------------------------
# Host helpers: block tables, split count, workspace (q-blocks: `capture.kernels.q_blocks`)


def identity_block_table(num_slots: int, max_seq_len: int, page: int = PAGE,
                         device: torch.device | str = "cpu") -> torch.Tensor:
    """`[num_slots, max_seq_len // page]` int32 table mapping each slot to its own contiguous
    rows of today's cache: page j of slot s is physical page `s * pages_per_slot + j`."""
    if page < 1 or max_seq_len % page:
        raise ValueError(f"page must divide max_seq_len={max_seq_len}, got {page}")
    pages_per_slot = max_seq_len // page
    return torch.arange(num_slots * pages_per_slot, dtype=torch.int32, device=device).view(num_slots, pages_per_slot)


def key_tile(q_block: int, num_splits: int, programs: int, sm_count: int) -> int:
    """Keys a program walks per loop step, from static shapes only (`programs`: q-blocks x KV
    heads). Buckets with prompt chunks take BLOCK_N. A decode-only bucket whose grid is narrow
    (split, or under WIDE_GRID_PER_SM programs per SM) takes DECODE_KEY_TILE: each program walks
    its keys in a shorter chain of dependent loads. On the H100 (SmolLM2-135M's heads,
    results/attention_tiles_h100.txt) one split of 128-key tiles ran 64 rows of ~300 keys in
    10.25 us a layer against 12.55 with 64-key tiles, 128 rows in 14.67 against 16.42. A wide
    grid (256 rows) keeps 64-key tiles: there 128-key tiles won at ~300 keys (27.3 against
    29.5 us) but lost at ~32 (10.0 against 7.7), and only the old choice has been timed in the
    engine. 2-warp programs, faster in that probe at 256 rows, made the engine's decode at 256
    rows 6% slower in `bench iteration`, so every launch keeps 4 warps."""
    return BLOCK_N if q_block > 1 or _wide_decode(q_block, num_splits, programs, sm_count) else DECODE_KEY_TILE


def register_cap(q_block: int, num_splits: int, programs: int, sm_count: int) -> int | None:
    """Registers per thread a launch may use (ptxas' `maxnreg`), or None for the compiler's
    choice, from static shapes only. A wide decode-only grid is capped so that
    WIDE_DECODE_PROGRAMS_PER_SM programs fit one SM's register file: on the H100 the kernel
    compiled to 96 registers, 5 programs an SM, so 256 decode rows (768 programs on 132 SMs)
    ran in 1.2 waves, the last fifth of the programs walking their keys while most SMs idled
    (Nsight Compute, 512-key contexts: 55.8 us a layer, DRAM at 58% of its peak, 26% of the
    warp slots occupied). Capped at 80, 6 fit: one wave up to 264 rows. The cap changes
    register allocation only, never the instructions' arithmetic, so results keep their bits."""
    if not _wide_decode(q_block, num_splits, programs, sm_count):
        return None
    per_thread = REGISTERS_PER_SM // (WIDE_DECODE_PROGRAMS_PER_SM * WARPS * 32)
    return per_thread // 8 * 8  # registers are allocated to a warp in steps of 8 a thread


def _wide_decode(q_block: int, num_splits: int, programs: int, sm_count: int) -> bool:
    """A decode-only grid (one token per q-block) of one split with WIDE_GRID_PER_SM or more
    programs per SM."""
    return q_block == 1 and num_splits == 1 and programs >= WIDE_GRID_PER_SM * sm_count


def pick_varlen_splits(num_blocks: int, kv_heads: int, max_len: int, sm_count: int, q_block: int = Q_BLOCK) -> int:
    """Splits in the grid per q-block, from static shapes only; each block then uses only the
    splits its own key walk needs (the kernel). Buckets with prompt chunks: the decode
    heuristic over q-blocks instead of rows (a floor of 4 splits for every bucket was measured
    on the H200 and dropped: a 1 x 2048 prompt 9% faster, but 255 decodes + a 512-token chunk 7%
    slower). Decode-only buckets (q_block 1) split only until the grid has one program per SM:
    on the H100 at 64-128 rows of 300-500 keys one split beat the old 2-3 by 0.3-3.8 us a layer
    (the merge's atomics and partials cost more than the shorter walks saved), while 16 rows
    still gain from 3-4 (results/attention_tiles_h100.txt)."""
    per_sm = TARGET_PROGRAMS_PER_SM if q_block > 1 else DECODE_PROGRAMS_PER_SM
    return pick_num_splits(num_blocks, kv_heads, max_len, sm_count, per_sm)


class VarlenWorkspace(AttentionWorkspace):
    """Float32 split scratch for `varlen_attention`, allocated once at start-up.

    A call of T tokens with S splits uses `T * S` (token, split) cells per head, the prefixes of
    the flat buffers; the workspace holds `max_tokens * max_splits` of them and at most
    `max_splits` splits. Splits happen only for buckets with few q-blocks, so size it with
    `for_buckets`, which takes the largest `T * S` the picker asks over the engine's buckets.
    Memory: `max_tokens * max_splits * heads * (head_dim + 2) * 4` bytes (partials, lse, counters).
    """

    def __init__(self, max_tokens: int, heads: int, head_dim: int, max_splits: int,
                 device: torch.device | str) -> None:
        super().__init__(max_tokens, heads, head_dim, max_splits, device)
        self.capacity = max_tokens * max_splits
        # Splits done per (q-block, KV head), at block * heads + KV head (a call has at most
        # T <= capacity blocks); zero between calls: the merging program resets its counter.
        self.done = torch.zeros(self.capacity * heads, dtype=torch.int32, device=device)

    @classmethod
    def for_buckets(cls, buckets: Iterable[tuple[int, int]], heads: int, kv_heads: int, head_dim: int,
                    max_seq_len: int, device: torch.device | str, sm_count: int | None = None) -> VarlenWorkspace:
        """Sized for every `(tokens, spans)` bucket under the automatic split count at
        `max_seq_len` keys (`sm_count`: the device's, unless given), with q-blocks of at most
        Q_BLOCK tokens (smaller ones only mean more blocks, so fewer splits)."""
        sm_count = _sm_count(torch.device(device)) if sm_count is None else sm_count
        needs = [(tokens, pick_varlen_splits(max_q_blocks(tokens, spans), kv_heads, max_seq_len, sm_count))
                 for tokens, spans in buckets]
        if not needs:
            raise ValueError("VarlenWorkspace.for_buckets needs at least one (tokens, spans) bucket")
        max_splits = max(splits for _, splits in needs)
        cells = max(tokens * splits for tokens, splits in needs)
        return cls(-(-cells // max_splits), heads, head_dim, max_splits, device)

    def views(self, tokens: int, heads: int, head_dim: int, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Partials `[T, h, S, d]` and lse `[T, h, S]`."""
        if (heads, head_dim) != (self.num_heads, self.head_dim):
            raise ValueError(f"VarlenWorkspace was built for {self.num_heads} heads x {self.head_dim} dims, "
                             f"got q with {heads} x {head_dim}")
        if num_splits > self.max_splits or tokens * num_splits > self.capacity:
            raise ValueError(f"VarlenWorkspace holds {self.capacity} token-splits and {self.max_splits} splits, "
                             f"asked for {tokens} tokens x {num_splits} splits: size it with for_buckets")
        cells = tokens * heads * num_splits
        return (self.partial[: cells * head_dim].view(tokens, heads, num_splits, head_dim),
                self.lse[:cells].view(tokens, heads, num_splits))

    def splits_that_fit(self, tokens: int, num_splits: int) -> int:
        """The split count capped to what this workspace holds (one split needs none)."""
        return max(1, min(num_splits, self.max_splits, self.capacity // tokens))


# ----------------------------------------------------------------------------------------------
# Checks, reference, kernel launch


def _check_varlen_args(q, k_cache, v_cache, block_table, token_slot, token_pos,
                       q_block_start, q_block_len, out, max_len) -> int:
    """Metadata checks (no values read); returns the static key bound."""
    _check_cache_args(q, k_cache, v_cache, {"token_slot": token_slot, "token_pos": token_pos}, 3,
                      cache_dtypes=(CACHE_FLOAT8,))
    if out is None:
        raise ValueError("out is required: a preallocated [T, heads * head_dim] tensor")
    _check_out(out, q)
    num_slots, max_seq_len = k_cache.shape[:2]
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(0) != max_seq_len * t.stride(1):
            raise ValueError(f"{name} must be contiguous over [slot, position] to be read as pages, "
                             f"got strides {t.stride()}")
    if block_table is not None and (block_table.dim() != 2 or block_table.shape[0] != num_slots
                                    or block_table.shape[1] < 1 or max_seq_len % block_table.shape[1]):
        raise ValueError(f"block_table must be [{num_slots}, pages_per_slot] with pages_per_slot dividing "
                         f"max_seq_len={max_seq_len} (see identity_block_table), got {tuple(block_table.shape)}")
    if q_block_start.dim() != 1 or q_block_start.shape != q_block_len.shape:
        raise ValueError(f"q_block_start and q_block_len must both be [num_blocks], got "
                         f"{tuple(q_block_start.shape)} and {tuple(q_block_len.shape)}")
    for name, t in (("block_table", block_table), ("q_block_start", q_block_start), ("q_block_len", q_block_len)):
        if t is None:  # no table: each slot's own contiguous rows
            continue
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    length = max_seq_len if max_len is None else max_len
    _check_max_len(length, max_seq_len, "max_len")
    return length


def _covered_tokens(num_tokens: int, q_block_start: torch.Tensor, q_block_len: torch.Tensor,
                    q_block: int) -> torch.Tensor:
    """`[T]` bool: which tokens some q-block covers. Fixed-shape: rows past a block's length
    are scattered into a spare cell T, which is dropped."""
    row = torch.arange(q_block, device=q_block_start.device)
    tokens = q_block_start.long()[:, None] + row
    tokens = torch.where(row < q_block_len.long()[:, None], tokens, num_tokens).clamp(0, num_tokens)
    covered = torch.zeros(num_tokens + 1, dtype=torch.bool, device=q_block_start.device)
    return covered.index_fill_(0, tokens.flatten(), True)[:num_tokens]


def varlen_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor | None,
    token_slot: torch.Tensor, token_pos: torch.Tensor, q_block_start: torch.Tensor,
    q_block_len: torch.Tensor, *, scale: float, out: torch.Tensor, max_len: int | None = None,
    q_block: int = Q_BLOCK,
) -> torch.Tensor:
    """Pure-torch varlen attention; fixed-shape (T tokens x `max_len` keys), no host reads.

    Each token gathers its slot's first `max_len` logical rows through the block table (None:
    the slot's own contiguous rows), then
    the decode reference's math (`attend_gathered`) runs on them, a bounded chunk of tokens at
    a time, so memory stays bounded whatever T is. Writes the
    covered tokens of `out` and returns it.
    """
    length = _check_varlen_args(q, k_cache, v_cache, block_table, token_slot, token_pos,
                                q_block_start, q_block_len, out, max_len)
    num_tokens = q.shape[0]
    kv_heads, head_dim = k_cache.shape[2:]
    check_q_block(q_block)
    covered = _covered_tokens(num_tokens, q_block_start, q_block_len, q_block)
    # Uncovered tokens may carry any value; read them as slot 0, position 0.
    slots = torch.where(covered, token_slot.long(), 0)
    positions = torch.where(covered, token_pos.long(), 0)
    keys = torch.arange(length, device=q.device)
    # Rows of the cache viewed as [num_slots * max_seq_len]; 2-D, the fastest gather.
    cache_rows = [cache.view(-1, kv_heads * head_dim) for cache in (k_cache, v_cache)]
    result = torch.empty_like(out)
    chunk = max(1, _REFERENCE_KEY_ROWS // length)
    for begin in range(0, num_tokens, chunk):
        part = slice(begin, begin + chunk)
        rows = _cache_rows(block_table, slots[part], keys, k_cache.shape[1]).flatten()
        # A float8 cache widens exactly to q's (the model's) dtype, as the kernel reads it.
        gathered = [c.index_select(0, rows).view(-1, length, kv_heads, head_dim).to(q.dtype) for c in cache_rows]
        result[part] = attend_gathered(q[part], *gathered, positions[part], scale)
    return out.copy_(torch.where(covered[:, None], result, out))


def _cache_rows(block_table: torch.Tensor | None, slots: torch.Tensor, keys: torch.Tensor,
                max_seq_len: int) -> torch.Tensor:
    """`[len(slots), len(keys)]` rows of the cache viewed as `[num_slots * max_seq_len]`."""
    if block_table is None:
        return slots[:, None] * max_seq_len + keys
    page = max_seq_len // block_table.shape[1]
    return block_table.long().index_select(0, slots)[:, keys // page] * page + keys % page


def _launch_triton(q, k_cache, v_cache, block_table, token_slot, token_pos, q_block_start,
                   q_block_len, scale, out, workspace, num_splits, q_block, split_tiles, settled, sm_count):
    num_tokens, heads, head_dim = q.shape
    num_slots, max_seq_len, kv_heads = k_cache.shape[:3]
    group = heads // kv_heads
    num_blocks = q_block_start.shape[0]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"the Triton varlen kernel needs head_dim a power of two >= 16, got {head_dim}")
    paged = block_table is not None
    table = block_table if paged else token_slot  # unread without a table
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out),
                    ("block_table", table), ("token_slot", token_slot), ("token_pos", token_pos),
                    ("q_block_start", q_block_start), ("q_block_len", q_block_len)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit-stride last dim, got strides {t.stride()}")
    if num_blocks == 0:
        return out
    if num_splits > 1:
        if workspace is None:  # eager convenience; a captured call passes the start-up one
            workspace = VarlenWorkspace(num_tokens, heads, head_dim, num_splits, q.device)
        elif workspace.partial.device != q.device:
            raise ValueError(f"workspace is on {workspace.partial.device}, q on {q.device}")
        partial, lse = workspace.views(num_tokens, heads, head_dim, num_splits)
        done = workspace.done
    else:
        partial = lse = done = out  # unused by the single-split kernel
    # Programmatic dependent launch where the GPU has it (capture.kernels.pdl): the launch of
    # each kernel overlaps the tail of the one before.
    pdl = pdl_supported(q.device)
    launch = {"launch_pdl": True} if pdl else {}
    programs = num_blocks * kv_heads
    block = key_tile(q_block, num_splits, programs, sm_count)
    cap = register_cap(q_block, num_splits, programs, sm_count)
    if cap is not None:
        launch["maxnreg"] = cap
    # split_tiles counts BLOCK_N-key tiles: the same keys per split in this launch's tiles.
    split_tiles = max(1, split_tiles * BLOCK_N // block)
    _varlen_split_kernel[(num_blocks, kv_heads, num_splits)](
        q, k_cache, v_cache, table, token_slot, token_pos, q_block_start, q_block_len,
        out, partial, lse, done,
        q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        table.stride(0) if paged else 0, out.stride(0), num_slots, max_seq_len, scale * _LOG2E,
        NUM_HEADS=heads, GROUP=group, Q_TOKENS=q_block, ROWS=max(16, triton.next_power_of_2(q_block * group)),
        HEAD_DIM=head_dim,
        BLOCK=block, PAGE=max_seq_len // block_table.shape[1] if paged else 1, PAGED=paged, SINGLE=num_splits == 1,
        SPLIT_TILES=split_tiles,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        NATIVE_DOT=q.is_cuda and q.dtype != torch.float32, USE_PDL=pdl,
        SETTLED=settled, META=".cg" if settled else "",
        num_warps=WARPS, num_stages=2, **launch,
    )
    return out


def varlen_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor | None,
    token_slot: torch.Tensor, token_pos: torch.Tensor, q_block_start: torch.Tensor,
    q_block_len: torch.Tensor, *, scale: float, out: torch.Tensor,
    workspace: VarlenWorkspace | None = None, num_splits: int | None = None,
    max_len: int | None = None, q_block: int = Q_BLOCK, backend: str | None = None,
    split_tiles: int = MIN_BLOCKS_PER_SPLIT, metadata_settled: bool = False,
) -> torch.Tensor:
    """Attention of a flat batch of T query tokens over the paged slot cache; capturable.

    q `[T, h, d]` (the model dtype; the cache holds it too, or float8 e4m3, which the kernel
    widens as it reads); token_slot, token_pos `[T]`; q_block_start,
    q_block_len `[num_blocks]` from `q_blocks` (host) padded to `max_q_blocks`, with the same
    static `q_block` (tokens per block) as given here; block_table
    `[num_slots, pages_per_slot]`, or None where each slot's keys are its own contiguous rows
    of the cache; all int32/int64 on q's device. Writes `out` `[T, h * d]`
    for the tokens the q-blocks cover and returns it.

    backend: "triton" (default on CUDA) | "torch" (`varlen_attention_reference`, elsewhere).
    max_len: static bound with every position < max_len (default the cache length): the
    reference gathers that many keys, the kernel sizes its split count by it.
    workspace: split scratch, allocated per call when missing (so pass one under capture); it
    caps the automatic split count to what it holds. num_splits: override the heuristic (tests).
    split_tiles: key tiles (of BLOCK_N keys) per split: a q-block walking t tiles uses
    min(ceil(t / split_tiles), num_splits) of its splits (tests lower it to split short blocks).
    metadata_settled: promise that block_table, token_slot, token_pos and the q-blocks were
    written two or more kernel launches before this call (not by the kernel just before it),
    as a model's forward guarantees (its QKV kernel runs in between): under programmatic
    dependent launch the kernel then reads them before waiting for the previous kernel
    (`capture.kernels.pdl`). Breaking the promise makes results unspecified; without PDL it
    changes nothing.
    """
    backend = backend or ("triton" if q.is_cuda else "torch")
    if backend == "torch":
        return varlen_attention_reference(q, k_cache, v_cache, block_table, token_slot, token_pos,
                                          q_block_start, q_block_len, scale=scale, out=out, max_len=max_len,
                                          q_block=q_block)
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
    length = _check_varlen_args(q, k_cache, v_cache, block_table, token_slot, token_pos,
                                q_block_start, q_block_len, out, max_len)
    check_q_block(q_block)
    sm_count = _sm_count(q.device)
    if num_splits is None:
        num_splits = pick_varlen_splits(q_block_start.shape[0], k_cache.shape[2], length, sm_count, q_block)
        if workspace is not None:
            num_splits = workspace.splits_that_fit(q.shape[0], num_splits)
    elif not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    if not isinstance(split_tiles, int) or isinstance(split_tiles, bool) or split_tiles < 1:
        raise ValueError(f"split_tiles must be a positive int, got {split_tiles!r}")
    return _launch_triton(q, k_cache, v_cache, block_table, token_slot, token_pos, q_block_start,
                          q_block_len, scale, out, workspace, num_splits, q_block, split_tiles,
                          bool(metadata_settled), sm_count)
