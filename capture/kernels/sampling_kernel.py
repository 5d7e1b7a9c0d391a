"""The fused sampler: three Triton launches, no torch ops, no [bs, vocab] temporaries.

A row's vocabulary is cut into fixed chunks of CHUNK logits (12 for 49152), one program per
(chunk, row), so a batch of 1 still spreads over many multiprocessors; a pass over a whole
row by one program is latency-bound at ~30 us on an H200.

  1. `_chunk_kernel`: each chunk's max and first argmax (the greedy token and the row max);
     for a row with a top-k or top-p cut, the chunk's `count` largest logits as an unsorted
     list (radix select in registers, then compaction); for top-p without top-k, the chunk's
     probability mass relative to its own max. The row's last program to finish (a counter
     per row) then selects the row's count-th largest logit from the chunk lists (the same
     radix select) and ranks the top-count entries pairwise for the nucleus: the row's keep
     threshold, once per row.
  2. `_gumbel_kernel`: the Gumbel-max over each chunk's kept logits, hashing the noise in
     registers. A chunk whose max is cut, or cannot reach the row max's lowest possible score,
     skips it.
  3. `_pick_kernel` (`pick_rows`): per row, the first best chunk wins, as torch.argmax takes
     the first. The iteration's fused epilogue runs this pass itself (`sample_chunks` then
     leaves it undone), so a plain step's sampler and relay epilogue take three launches.

Every step mirrors `capture.sampling` (the torch reference) op for op in float32: the same
integer hash on uint32 (its multiplies wrap mod 2**32, as the reference's split int64 products
do), the same uniform, `(logit - max) / T` with IEEE division, and the same cumulative test.
The nucleus sums associate differently and log/exp may round apart by an ulp; see
`capture.sampling.sample` for what that can change. CHUNK is fixed, never chosen by batch
size, so a row's token cannot depend on its batch.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

CHUNK = 4096  # logits per program
MAX_RANKED = 256  # the widest max_top_k the kernels rank
_PICK_BLOCK = 16  # rows per program of the standalone last pass
# The first pass's registers a thread (ptxas' maxnreg; None: the compiler's choice). Uncapped it
# compiled to 157 on the H100 (Triton 3.6), so one 8-warp program fit an SM and 256 rows' 3,072
# programs ran in 23 waves; at 128 two fit, without spilling. The three launches, H100, bs 64 /
# 128 / 256: greedy 9.1 / 13.6 / 22.7 us against 11.3 / 18.3 / 32.3; rows with top-k 50 and
# top-p 0.9 115 / 221 / 428 against 136 / 264 / 519; one row unchanged (4.4 and 30.7 us); the same
# tokens (results/sampler_h100.txt). Registers only: the arithmetic and its bits do not change.
CHUNK_REGISTERS: Optional[int] = 128
_OTHERS = tl.constexpr(64)  # ranked entries compared per pairwise tile
# Bounds on the Gumbel noise: u lies in [2**-24, 1 - 2**-24], so -log(-log(u)) lies in
# [-2.8116, 16.6356]. These are looser by far more than float32 rounding, which is monotonic,
# so score bounds built from them are safe.
_NOISE_MIN = tl.constexpr(-2.82)
_NOISE_MAX = tl.constexpr(16.64)


@triton.jit
def _hash32(x):
    """lowbias32 of uint32 values: capture.sampling.hash32, with wrapping uint32 multiplies."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _row_key(seed, step):
    """capture.sampling._row_keys for one row: fold the 32-bit halves of the int64 seed and
    step, low half first, into one uint32 key."""
    seed_bits = seed.to(tl.int64).to(tl.uint64, bitcast=True)
    step_bits = step.to(tl.int64).to(tl.uint64, bitcast=True)
    key = _hash32(seed_bits.to(tl.uint32))
    key = _hash32(key ^ (seed_bits >> 32).to(tl.uint32))
    key = _hash32(key ^ step_bits.to(tl.uint32))
    return _hash32(key ^ (step_bits >> 32).to(tl.uint32))


@triton.jit
def _row_cuts(temperature_ptr, top_k_ptr, top_p_ptr, vocab, width, HAS_TOP_P: tl.constexpr):
    """(temperature, has a top-k cut, count, top_p) of one row; count = min(top_k, width)
    with a top-k cut, else width; top_p is 1.0 when the batch has none."""
    k = tl.load(top_k_ptr).to(tl.int64)
    has_top_k = (k > 0) & (k < vocab)
    if HAS_TOP_P:
        top_p = tl.load(top_p_ptr)
    else:
        top_p = 1.0
    return tl.load(temperature_ptr), has_top_k, tl.where(has_top_k, tl.minimum(k, width), width), top_p


@triton.jit
def _kth_largest(x, valid, rank, LEVELS: tl.constexpr):
    """The rank-th largest of x[valid] (1 <= rank <= how many are valid), ties counted: an
    8-bit radix select on order-preserving uint32 keys, most significant byte first, over the
    LEVELS high bytes that can differ (`select_levels`): past them every key's bits are the same
    function of its sign, so they are filled in, not searched."""
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) == 1, ~bits, bits | 0x80000000)  # a larger float, a larger key
    bins = tl.arange(0, 256)
    prefix = tl.full((), 0, tl.uint32)  # the key bytes chosen so far
    remaining = rank  # how far down the keys that share `prefix` the answer lies
    for level in tl.static_range(LEVELS):
        shift = 24 - 8 * level
        if level == 0:
            same = valid
        else:
            same = valid & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
        counts = tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=same)  # [256]
        at_or_above = tl.cumsum(counts, 0, reverse=True)
        digit = tl.max(tl.where(at_or_above >= remaining, bins, 0), 0)
        remaining -= tl.sum(tl.where(bins > digit, counts, 0), 0)
        prefix |= digit.to(tl.uint32) << shift
    if LEVELS < 4:
        # The value's unsearched low bits are zero: its key's are zero too when it is positive
        # (key = bits | sign) and ones when it is negative (key = ~bits).
        prefix |= tl.where((prefix >> 31) == 1, 0, (1 << (32 - 8 * LEVELS)) - 1).to(tl.uint32)
    bits = tl.where((prefix >> 31) == 1, prefix & 0x7FFFFFFF, ~prefix)
    return bits.to(tl.float32, bitcast=True)


def select_levels(dtype: torch.dtype) -> int:
    """Radix levels (bytes, high first) that can tell float32 widenings of `dtype` apart: a
    bfloat16 value widened to float32 has 16 zero low bits, a float16 one (10 mantissa bits, its
    subnormals normalized) 13, so 2, 3 and 4 levels for bfloat16, float16 and float32. The
    ranked lists hold the logits' own values (and their -inf padding), so they need no more."""
    return {torch.bfloat16: 2, torch.float16: 3}.get(dtype, 4)


@triton.jit
def _store_above(dst, x, keep):
    """Store x[keep] to dst[0 .. n) in order; returns n."""
    keep = keep.to(tl.int32)
    tl.store(dst + tl.cumsum(keep, 0) - 1, x, mask=keep == 1)
    return tl.sum(keep, 0)


@triton.jit
def _nucleus_threshold(scratch, n_above, count, kth, top, temperature, top_p, vocab_mass, has_top_k,
                       RANKED: tl.constexpr):
    """capture.sampling.keep_threshold's top-p cut, from the top-count set: scratch[0 .. n_above)
    holds its logits above kth, the other count - n_above are kth."""
    entry = tl.arange(0, RANKED)
    in_set = entry < count
    ranked = tl.where(in_set, tl.load(scratch + entry, mask=entry < n_above, other=kth), float("-inf"))
    weights = tl.where(in_set, tl.exp(tl.math.div_rn(ranked - top, temperature)), 0.0)  # [RANKED]
    mass = tl.where(has_top_k, tl.sum(weights, 0), vocab_mass)
    # Sorted position and inclusive cumulative weight of every entry: entry o precedes entry e
    # when its logit is larger, or equal and o comes first (a total order, as a stable sort).
    position = tl.zeros([RANKED], dtype=tl.int32)
    cumulative = weights
    for first in tl.static_range(0, RANKED, _OTHERS):
        other = first + tl.arange(0, _OTHERS)  # [OTHERS]
        other_in_set = other < count
        other_logit = tl.where(other_in_set, tl.load(scratch + other, mask=other < n_above, other=kth),
                               float("-inf"))
        other_weight = tl.where(other_in_set, tl.exp(tl.math.div_rn(other_logit - top, temperature)), 0.0)
        precedes = (other_logit[:, None] > ranked[None, :]) | (
            (other_logit[:, None] == ranked[None, :]) & (other[:, None] < entry[None, :]))  # [OTHERS, RANKED]
        position += tl.sum(precedes.to(tl.int32), 0)
        cumulative += tl.sum(tl.where(precedes, other_weight[:, None], 0.0), 0)
    below = tl.sum((in_set & (tl.math.div_rn(cumulative, mass) < top_p)).to(tl.int32), 0)
    return tl.max(tl.where(in_set & (position == tl.minimum(below, count - 1)), ranked, float("-inf")), 0)


# Per-row parameters are loaded one scalar at a time, so their pointers' alignment buys nothing;
# not specializing on it keeps one compiled variant for every caller (the decode step's static
# buffers and prefill's views into one staging tensor, whose rows start at any offset).
_ROW_PARAMS = ("temperature_ptr", "top_k_ptr", "top_p_ptr")


@triton.jit(do_not_specialize_on_alignment=_ROW_PARAMS)
def _chunk_kernel(
    logits_ptr, logits_stride, temperature_ptr, temperature_stride, top_k_ptr, top_k_stride,
    top_p_ptr, top_p_stride, chunk_max_ptr, chunk_arg_ptr, chunk_mass_ptr, chunk_top_ptr, scratch_ptr,
    threshold_ptr, counter_ptr, vocab, width,
    HAS_TOP_P: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, RANKED: tl.constexpr, LEVELS: tl.constexpr,
    MERGED: tl.constexpr,
):
    chunk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    slot = row * tl.num_programs(0) + chunk  # this program's [bs, chunks] entry
    offs = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
    live = offs < vocab
    x = tl.load(logits_ptr + row * logits_stride + offs, mask=live, other=float("-inf")).to(tl.float32)
    chunk_max, chunk_arg = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(chunk_max_ptr + slot, chunk_max)
    # Clamped: a NaN row's argmax may land on a masked lane, and no id may leave the vocabulary.
    tl.store(chunk_arg_ptr + slot, tl.minimum(chunk * CHUNK + chunk_arg, vocab - 1))
    temperature, has_top_k, count, top_p = _row_cuts(
        temperature_ptr + row * temperature_stride, top_k_ptr + row * top_k_stride,
        top_p_ptr + row * top_p_stride, vocab, width, HAS_TOP_P)
    if (temperature > 0) & (has_top_k | (top_p < 1)):
        # The chunk's `rank` largest logits (all of them if it has fewer): those above the
        # rank-th largest, then copies of it, then -inf up to RANKED.
        rank = tl.minimum(count, tl.minimum(vocab - chunk * CHUNK, CHUNK))
        kth = _kth_largest(x, live, rank, LEVELS)
        top_list = chunk_top_ptr + slot * RANKED
        n_above = _store_above(top_list, x, live & (x > kth))
        entry = tl.arange(0, RANKED)
        tl.store(top_list + entry, tl.where(entry < rank, kth, float("-inf")), mask=entry >= n_above)
        if (has_top_k == 0) & (top_p < 1):
            # -inf logits weigh 0 (and an all -inf chunk must not make NaN from -inf - -inf).
            weights = tl.where(x > float("-inf"), tl.exp(tl.math.div_rn(x - chunk_max, temperature)), 0.0)
            tl.store(chunk_mass_ptr + slot, tl.sum(weights, 0))
        # The row's last program to finish sets the row's threshold from every chunk's results:
        # one select per row, not one per chunk program of the next pass. Every thread's stores
        # before the release; the last program sees them all after its acquire, and zeroes the
        # counter for the next call.
        tl.debug_barrier()
        counter = counter_ptr + row
        if tl.atomic_add(counter, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            tl.debug_barrier()
            tl.atomic_xchg(counter, 0)
            threshold = _row_threshold(row, tl.num_programs(0), count, has_top_k, top_p, temperature, chunk_max_ptr,
                                       chunk_mass_ptr, chunk_top_ptr, scratch_ptr, CHUNKS, RANKED, LEVELS, MERGED)
            tl.store(threshold_ptr + row, threshold)


@triton.jit
def _row_threshold(row, n_chunks, count, has_top_k, top_p, temperature, chunk_max_ptr, chunk_mass_ptr,
                   chunk_top_ptr, scratch_ptr, CHUNKS: tl.constexpr, RANKED: tl.constexpr, LEVELS: tl.constexpr,
                   MERGED: tl.constexpr):
    """A cut row's keep threshold (capture.sampling.keep_threshold) from its chunks' maxima,
    lists and masses, which other programs stored: read past the SM's L1 (".cg"). scratch:
    the row's RANKED floats of the nucleus's own."""
    row_first = row * n_chunks  # the row's first [bs, chunks] entry
    c = tl.arange(0, CHUNKS)
    chunk_max = tl.load(chunk_max_ptr + row_first + c, mask=c < n_chunks, other=float("-inf"),
                        cache_modifier=".cg")  # [CHUNKS]
    top = tl.max(chunk_max, 0)
    # The row's count largest logits are among the chunks' count largest.
    pos = tl.arange(0, MERGED)
    listed = pos < n_chunks * RANKED
    candidates = tl.load(chunk_top_ptr + row_first * RANKED + pos, mask=listed, other=float("-inf"),
                         cache_modifier=".cg")
    kth = _kth_largest(candidates, listed, count, LEVELS)
    threshold = tl.where(has_top_k, kth, float("-inf"))
    if top_p < 1:
        scratch = scratch_ptr + row * RANKED
        n_above = _store_above(scratch, candidates, listed & (candidates > kth))
        tl.debug_barrier()  # other threads of this program read those stores back
        vocab_mass = tl.full((), 0.0, tl.float32)
        if has_top_k == 0:  # the vocabulary's mass: each chunk's, rescaled to the row max
            partial = tl.load(chunk_mass_ptr + row_first + c, mask=c < n_chunks, other=0.0, cache_modifier=".cg")
            scale = tl.where(chunk_max > float("-inf"), tl.exp(tl.math.div_rn(chunk_max - top, temperature)), 0.0)
            vocab_mass = tl.sum(partial * scale, 0)
        threshold = _nucleus_threshold(scratch, n_above, count, kth, top, temperature, top_p, vocab_mass, has_top_k,
                                       RANKED)
    return threshold


@triton.jit(do_not_specialize_on_alignment=(*_ROW_PARAMS, "seeds_ptr", "steps_ptr"))
def _gumbel_kernel(
    logits_ptr, logits_stride, temperature_ptr, temperature_stride, top_k_ptr, top_k_stride,
    top_p_ptr, top_p_stride, seeds_ptr, seeds_stride, steps_ptr, steps_stride,
    chunk_max_ptr, threshold_ptr, score_ptr, score_arg_ptr, vocab, width,
    HAS_TOP_P: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
):
    chunk = tl.program_id(0)
    n_chunks = tl.num_programs(0)
    row = tl.program_id(1).to(tl.int64)
    row_first = row * n_chunks  # the row's first [bs, chunks] entry
    temperature, has_top_k, _, top_p = _row_cuts(
        temperature_ptr + row * temperature_stride, top_k_ptr + row * top_k_stride,
        top_p_ptr + row * top_p_stride, vocab, width, HAS_TOP_P)
    # Tensors, not constants: the `if` below reassigns them.
    best_score = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int32) + chunk * CHUNK
    if temperature > 0:
        c = tl.arange(0, CHUNKS)
        chunk_max = tl.load(chunk_max_ptr + row_first + c, mask=c < n_chunks, other=float("-inf"))  # [CHUNKS]
        top = tl.max(chunk_max, 0)
        threshold = tl.full((), float("-inf"), tl.float32)
        if has_top_k | (top_p < 1):  # the first pass's last program of the row set it
            threshold = tl.load(threshold_ptr + row)
        own_max = tl.load(chunk_max_ptr + row_first + chunk)
        # The row max is kept and scores at least _NOISE_MIN: skip a chunk that cannot beat it.
        reachable = tl.math.div_rn(own_max - top, temperature) + _NOISE_MAX >= _NOISE_MIN
        if (own_max >= threshold) & reachable:
            offs = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
            x = tl.load(logits_ptr + row * logits_stride + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
            key = _row_key(tl.load(seeds_ptr + row * seeds_stride), tl.load(steps_ptr + row * steps_stride))
            bits = _hash32(key ^ _hash32(offs.to(tl.uint32)))
            # 23 random bits + 0.5, exact in float32: u strictly inside (0, 1).
            uniform = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
            noise = -tl.log(-tl.log(uniform))
            kept = (offs < vocab) & (x >= threshold)
            score = tl.where(kept, tl.math.div_rn(x - top, temperature), float("-inf")) + noise
            best_score, best_arg = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
            best_index = chunk * CHUNK + best_arg
    tl.store(score_ptr + row_first + chunk, best_score)
    tl.store(score_arg_ptr + row_first + chunk, tl.minimum(best_index, vocab - 1))


@triton.jit
def pick_rows(rows, live, temperature_ptr, temperature_stride, chunk_max_ptr, chunk_arg_ptr, score_ptr, score_arg_ptr,
              n_chunks, CHUNKS: tl.constexpr):
    """The sampler's last pass for a block of rows `rows` ([BLOCK] int64, `live` those that
    exist): each row's token, int64. Sampled rows pick by Gumbel score, greedy rows by logit;
    ties go to the first chunk, as torch.argmax takes the first. Shared by `_pick_kernel` and
    the iteration's fused epilogue (`capture.kernels.iteration_epilogue`)."""
    c = tl.arange(0, CHUNKS)
    cell = rows[:, None] * n_chunks + c[None, :]  # [BLOCK, CHUNKS]
    ok = live[:, None] & (c[None, :] < n_chunks)
    sampled = tl.load(temperature_ptr + rows * temperature_stride, mask=live, other=0.0) > 0
    values = tl.where(sampled[:, None], tl.load(score_ptr + cell, mask=ok, other=float("-inf")),
                      tl.load(chunk_max_ptr + cell, mask=ok, other=float("-inf")))
    _, best = tl.max(values, 1, return_indices=True, return_indices_tie_break_left=True)
    # A row of NaN logits may point the max at a masked lane: stay among the row's chunks.
    at = rows * n_chunks + tl.minimum(best, n_chunks - 1)
    token = tl.where(sampled, tl.load(score_arg_ptr + at, mask=live, other=0),
                     tl.load(chunk_arg_ptr + at, mask=live, other=0))
    return token.to(tl.int64)


@triton.jit(do_not_specialize_on_alignment=("temperature_ptr", "out_ptr"))
def _pick_kernel(temperature_ptr, temperature_stride, chunk_max_ptr, chunk_arg_ptr, score_ptr, score_arg_ptr,
                 out_ptr, out_stride, bs, n_chunks, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = rows < bs
    token = pick_rows(rows, live, temperature_ptr, temperature_stride, chunk_max_ptr, chunk_arg_ptr, score_ptr,
                      score_arg_ptr, n_chunks, CHUNKS)
    tl.store(out_ptr + rows * out_stride, token, mask=live)


class ChunkResults(NamedTuple):
    """What the sampler's first two passes leave for its last (`pick_rows`): per (row, chunk)
    the max logit and its index, and the best Gumbel score and its index; [bs, n_chunks] each,
    beside the rows' temperatures [bs] (which of the two a row picks by)."""

    temperature: torch.Tensor
    chunk_max: torch.Tensor
    chunk_arg: torch.Tensor
    score: torch.Tensor
    score_arg: torch.Tensor

    @property
    def n_chunks(self) -> int:
        return self.chunk_max.shape[1]

    @property
    def chunks(self) -> int:
        """n_chunks rounded up to a power of two: a block's width in `pick_rows`."""
        return triton.next_power_of_2(self.n_chunks)


def sample_chunks(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: Optional[torch.Tensor],
    seeds: torch.Tensor,
    steps: torch.Tensor,
    width: int,
    *,
    chunk: int = CHUNK,
    counters: Optional[torch.Tensor] = None,
) -> ChunkResults:
    """The sampler's first two passes (two launches): what `pick_rows` needs to pick each row's
    token. `sample_triton`'s arguments, without `out`."""
    bs, vocab = logits.shape
    ranked = max(triton.next_power_of_2(width), _OTHERS.value)  # list width; entries >= count are -inf
    n_chunks = triton.cdiv(vocab, chunk)
    chunks = triton.next_power_of_2(n_chunks)
    device = logits.device
    if counters is None:
        counters = torch.zeros(bs, dtype=torch.int32, device=device)
    elif counters.shape != (bs,) or counters.dtype != torch.int32 or counters.device != device or counters.stride(0) != 1:
        raise ValueError(f"sampler counters must be a contiguous int32 [{bs}] tensor on {device}, zero between calls "
                         f"(see sample_triton), got {counters.dtype} {tuple(counters.shape)} on {counters.device}")
    # Scratch, [bs, chunks] per chunk result; every entry a kernel reads, an earlier one wrote.
    stats = torch.empty((3, bs, n_chunks), dtype=torch.float32, device=device)  # max, mass, score
    args = torch.empty((2, bs, n_chunks), dtype=torch.int32, device=device)  # argmax, score argmax
    tops = torch.empty((bs, n_chunks, ranked), dtype=torch.float32, device=device)  # each chunk's top list
    nucleus = torch.empty((bs, ranked), dtype=torch.float32, device=device)  # a row's ranked entries
    thresholds = torch.empty(bs, dtype=torch.float32, device=device)
    # top_p None compiles the nucleus away; the pointer passed in its place is never read.
    top_p_arg = top_p if top_p is not None else temperature
    row_params = (logits, logits.stride(0), temperature, temperature.stride(0), top_k, top_k.stride(0),
                  top_p_arg, top_p_arg.stride(0))
    cap = {} if CHUNK_REGISTERS is None else {"maxnreg": CHUNK_REGISTERS}
    levels = select_levels(logits.dtype)
    _chunk_kernel[(n_chunks, bs)](
        *row_params, stats[0], args[0], stats[1], tops, nucleus, thresholds, counters, vocab, width,
        HAS_TOP_P=top_p is not None, CHUNK=chunk, CHUNKS=chunks, RANKED=ranked, LEVELS=levels,
        MERGED=triton.next_power_of_2(n_chunks * ranked), num_warps=8, **cap,
    )
    _gumbel_kernel[(n_chunks, bs)](
        *row_params, seeds, seeds.stride(0), steps, steps.stride(0), stats[0], thresholds, stats[2], args[1],
        vocab, width, HAS_TOP_P=top_p is not None, CHUNK=chunk, CHUNKS=chunks, num_warps=8,
    )
    return ChunkResults(temperature, stats[0], args[0], stats[2], args[1])


def pick_tokens(results: ChunkResults, out: torch.Tensor) -> torch.Tensor:
    """The sampler's last pass (one launch): each row's token into `out` [bs] int64."""
    bs = results.chunk_max.shape[0]
    _pick_kernel[(triton.cdiv(bs, _PICK_BLOCK),)](
        results.temperature, results.temperature.stride(0), results.chunk_max, results.chunk_arg, results.score,
        results.score_arg, out, out.stride(0), bs, results.n_chunks, CHUNKS=results.chunks, BLOCK=_PICK_BLOCK,
        num_warps=1,
    )
    return out


def sample_triton(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: Optional[torch.Tensor],
                  seeds: torch.Tensor, steps: torch.Tensor, out: torch.Tensor, width: int, *,
                  chunk: int = CHUNK, counters: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Write one token per row into `out` [bs] int64 and return it: three launches.

    logits [bs, V] float32, or 16-bit (widened exactly as they are read), with contiguous
    rows; the [bs] params and `width` (the ranked
    width, <= MAX_RANKED) as `capture.sampling.sample` takes and checks them. `chunk` (a
    power of 2) is the logits per program; tests shrink it to cut a small vocabulary into
    several chunks. counters: `[bs]` int32, zero, which the first pass counts its finished
    programs on and leaves zero again; a caller under capture passes one allocated up front
    (else each call allocates and zeroes its own: one more graph node).
    """
    return pick_tokens(sample_chunks(logits, temperature, top_k, top_p, seeds, steps, width, chunk=chunk,
                                     counters=counters), out)
