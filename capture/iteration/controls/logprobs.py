"""Logprobs of the sampled token and the top MAX_LOGPROBS, carried to the host like the tokens.

Semantics: the model's raw distribution, log_softmax of the logits before penalties, bias,
grammar masks and temperature (vLLM's default, "raw logprobs"). A row whose request asked
gets all MAX_LOGPROBS (the host keeps the n it asked for); `write` takes a per-slot `wants`
table so that the others cost (almost) nothing: the controls variant runs for any control in
use, and the logprob work would otherwise be paid by every row of it. The ring marks each
row `asked`, and `read` reports None for the rows that did not.

`LogprobChannel` is a second host mirror beside `graphrelay.mirror.HostMirror`: a ring of
`depth` iterations in mapped pinned memory, written by the captured step at ring slot
`iteration % depth` and stamped `iteration`, where `iteration` is the mirror's own device
counter read before the mirror's write advances it, with its rows in the mirror's row order.
Only the step's controls variant writes it: taking the iteration from the mirror keeps the
two aligned across the plain iterations that skip it (the engine knows which ran which, and
reads no logprobs for a plain one). It has no events of its own: read iteration i after the
mirror's read of i returned (the same stream wrote both, the channel first).

On CUDA (or ControlsConfig.backend "triton") `write` is two Triton launches writing the ring
directly: per (row, vocabulary chunk) the chunk's max, sum of exp and local top `width`, then
per row the combined logsumexp and the top `width` of the candidates; a row that did not ask
returns at once from the first and writes only its ring bookkeeping in the second.

A top-`width` is `width` rounds of a max, and a round over a whole chunk is what the first
launch used to spend its time on (ALU-bound: every lane compares in every round). It now
rounds over much less: the chunk is cut into groups of GROUP logits, and its top `width` lie
in the `width` groups whose maxima are largest (were an element's group not among them, those
`width` maxima would be `width` distinct elements above it). So the rounds run over the group
maxima, then over the logits of the groups they picked, read again from the cache. The torch
ops
(`logprob_rows`, a topk over the whole vocabulary plus several small ops, each a graph node)
stay as the CPU path and the reference: they compute every row, and mark the same rows
`asked`. On exact ties the Triton path takes the lowest token
id first; torch.topk's order among ties is unspecified.
"""

from __future__ import annotations

from typing import Optional

import msgspec
import torch
import triton
import triton.language as tl

from graphrelay.mirror import MirrorRead
from graphrelay.runtime import PinnedRing

from .row_tensors import check_row_tensors
from .params import MAX_LOGPROBS

# Vocabulary columns per program of the first launch, its warps, and the logits per group of
# its rounds (SmolLM2's 49,152 tokens: 6 chunks a row, 512 groups a chunk).
CHUNK = 8192
CHUNK_WARPS = 8
GROUP = 16
ROW_WARPS = 1  # the second launch's rounds run over chunks * width candidates: one warp, no barriers


class TokenLogprobs(msgspec.Struct, frozen=True):
    """One token's values on the host (serve --json writes them by these names)."""

    logprob: float  # the sampled token's
    top: list[tuple[int, float]]  # (token, logprob), best first


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, width: int = MAX_LOGPROBS) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [n, 1 + width] float32: sampled token's logprob then the top `width`; ids
    [n, width] int64), from 16-bit logits as their float32 values. Fixed shape, capturable."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    top = logits.topk(width, dim=-1)
    sampled = logits.gather(1, tokens.long()[:, None])
    return torch.cat([sampled, top.values], dim=1) - lse, top.indices


@triton.jit
def _ordered(x):
    """float32 -> int32 in the same order (signed), -0.0 as +0.0: they tie as values (lowest id
    first), but their bits would order them."""
    bits = tl.where(x == 0.0, 0, x.to(tl.int32, bitcast=True))
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _keys(x, ids, alive):
    """Each lane as one int64 key, larger for a larger value and, among equal values, for a
    lower id: `_ordered` in the high half, the complement of the id in the low half; a lane not
    `alive` is the smallest key. A max over keys is then the best value and the lowest id among
    its ties in one reduction (not a max plus a min)."""
    low = 0xFFFFFFFF - ids.to(tl.int64)  # ids < 2^32: a lower id, a larger key
    return tl.where(alive, (_ordered(x.to(tl.float32)).to(tl.int64) << 32) | low, tl.full((), -(2**63), tl.int64))


@triton.jit
def _key_id(key):
    return 0xFFFFFFFF - (key & 0xFFFFFFFF)


@triton.jit
def _top_of(key, out_values, out_ids, WIDTH: tl.constexpr):
    """`WIDTH` rounds of argmax over `_keys`, lowest id first on ties; a round with no lane
    left stores -inf and id -1. Membership is the key's, not the value's, so a -inf logit is
    still a valid pick."""
    none = tl.full((), -(2**63), tl.int64)
    previous = tl.full((), 2**63 - 1, tl.int64)
    for k in range(WIDTH):
        best = tl.max(tl.where(key < previous, key, none))
        found = best != none
        high = (best >> 32).to(tl.int32)
        value = tl.where(high >= 0, high, high ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
        tl.store(out_values + k, tl.where(found, value, float("-inf")))
        tl.store(out_ids + k, tl.where(found, _key_id(best), -1))
        previous = best


@triton.jit
def _asks(row_slots_ptr, wants_ptr, row):
    """Whether the row's slot wants logprobs (without a `wants` table, None: every row)."""
    # A static branch, each side assigning: the compiler would still build a load from None
    # after an early return.
    if wants_ptr is None:
        asks = tl.full((), 1, tl.int1)
    else:
        asks = tl.load(wants_ptr + tl.load(row_slots_ptr + row)) != 0
    return asks


@triton.jit
def _chunk_kernel(logits_ptr, logits_stride, row_slots_ptr, wants_ptr, max_ptr, sum_ptr, cand_values_ptr,
                  cand_ids_ptr, vocab, chunks, WIDTH: tl.constexpr, CHUNK: tl.constexpr, GROUP: tl.constexpr,
                  PICKED: tl.constexpr):
    row = tl.program_id(0)
    if not _asks(row_slots_ptr, wants_ptr, row):
        return  # the row kernel reads none of this row's chunk results
    chunk = tl.program_id(1)
    first = chunk * CHUNK
    row_logits = logits_ptr + row * logits_stride
    ids = first + tl.arange(0, CHUNK).to(tl.int64)
    valid = ids < vocab
    x = tl.load(row_logits + ids, mask=valid, other=float("-inf")).to(tl.float32)
    m = tl.max(x)
    # Relative to a finite max: an all -inf chunk sums exp(-inf) = 0, not exp(-inf - -inf) = nan.
    s = tl.sum(tl.exp(x - tl.where(m > float("-inf"), m, 0.0)))
    at = row * chunks + chunk
    tl.store(max_ptr + at, m)
    tl.store(sum_ptr + at, s)
    # The WIDTH groups with the largest maxima (see the module docstring), as group numbers;
    # -1 past the groups holding a valid logit. A group's key is its best value's order, then
    # the complement of its first id: groups are contiguous ranges of ids, so among equal
    # values the lower group holds the lower ids, the order of its best logit's `_keys`. Built
    # per group from int32 maxima, not per logit: the pass over the chunk stays 32-bit.
    ordered = tl.where(valid, _ordered(x), -(2**31))  # a masked lane is no group's max
    group_first = first + tl.arange(0, CHUNK // GROUP).to(tl.int64) * GROUP
    group_best = tl.max(tl.reshape(ordered, (CHUNK // GROUP, GROUP)), axis=1).to(tl.int64)
    none = tl.full((), -(2**63), tl.int64)
    groups = tl.where(group_first < vocab, (group_best << 32) | (0xFFFFFFFF - group_first), none)
    previous = tl.full((), 2**63 - 1, tl.int64)
    slot = tl.arange(0, PICKED)
    picked = tl.full((PICKED,), -1, tl.int64)
    for k in range(WIDTH):
        best = tl.max(tl.where(groups < previous, groups, none))
        group = tl.where(best != none, (_key_id(best) - first) // GROUP, -1)
        picked = tl.where(slot == k, group, picked)
        previous = best
    # Their logits again (this program just read them: cache hits), and the top WIDTH of those.
    picked_ids = first + picked[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [PICKED, GROUP]
    live = (picked[:, None] >= 0) & (picked_ids < vocab)
    y = tl.load(row_logits + picked_ids, mask=live, other=float("-inf"))
    key = tl.reshape(_keys(y, picked_ids, live), (PICKED * GROUP,))
    _top_of(key, cand_values_ptr + at * WIDTH, cand_ids_ptr + at * WIDTH, WIDTH)


@triton.jit
def _row_kernel(logits_ptr, logits_stride, tokens_ptr, row_slots_ptr, wants_ptr, iteration_ptr, max_ptr, sum_ptr,
                cand_values_ptr, cand_ids_ptr, stamps_ptr, counts_ptr, slots_ptr, asked_ptr, values_ptr, ids_ptr,
                n, chunks, depth, max_rows, vocab,
                WIDTH: tl.constexpr, CHUNKS_BLOCK: tl.constexpr, WIDTH_BLOCK: tl.constexpr):
    row = tl.program_id(0)
    iteration = tl.load(iteration_ptr)
    ring_slot = iteration % depth
    out = ring_slot * max_rows + row
    # Every row's bookkeeping, asked or not: the host reader finds its rows by these.
    asks = _asks(row_slots_ptr, wants_ptr, row)
    tl.store(slots_ptr + out, tl.load(row_slots_ptr + row).to(tl.int64))
    tl.store(asked_ptr + out, asks.to(tl.int32))
    if row == 0:
        tl.store(counts_ptr + ring_slot, n)
        tl.store(stamps_ptr + ring_slot, iteration)
    if not asks:
        return  # its chunk results were not written; its values and ids are never read
    c = tl.arange(0, CHUNKS_BLOCK)
    m = tl.load(max_ptr + row * chunks + c, mask=c < chunks, other=float("-inf"))
    s = tl.load(sum_ptr + row * chunks + c, mask=c < chunks, other=0.0)
    # Each chunk's sum rescaled to the row's max (an all -inf chunk adds s = 0, rescaled by 0).
    top = tl.max(m)
    top = tl.where(top > float("-inf"), top, 0.0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - top)))
    j = tl.arange(0, WIDTH_BLOCK)
    at = (row * chunks + c[:, None]) * WIDTH + j[None, :]
    inside = (c[:, None] < chunks) & (j[None, :] < WIDTH)
    cand = tl.load(cand_values_ptr + at, mask=inside, other=float("-inf"))
    cand_ids = tl.load(cand_ids_ptr + at, mask=inside, other=-1)
    # Clamped into the vocabulary: a padding row's token is whatever its logits gave.
    token = tl.minimum(tl.maximum(tl.load(tokens_ptr + row).to(tl.int64), 0), vocab - 1)
    tl.store(values_ptr + out * (1 + WIDTH), tl.load(logits_ptr + row * logits_stride + token).to(tl.float32) - lse)
    # The candidates' ids are distinct (chunks do not overlap); -1 marks a chunk's empty round.
    _top_of(_keys(cand - lse, cand_ids, cand_ids >= 0), values_ptr + out * (1 + WIDTH) + 1, ids_ptr + out * WIDTH,
            WIDTH)


class LogprobChannel:
    def __init__(self, max_rows: int, depth: int, device: torch.device, vocab: int, backend: str = "torch",
                 width: int = MAX_LOGPROBS):
        self.depth, self.max_rows, self.width, self.vocab, self.backend = depth, max_rows, width, vocab, backend
        fields = [("stamps", torch.int64, (depth,)), ("counts", torch.int64, (depth,)), ("slots", torch.int64, (depth, max_rows)),
                  ("asked", torch.int32, (depth, max_rows)),
                  ("values", torch.float32, (depth, max_rows, 1 + width)), ("ids", torch.int64, (depth, max_rows, width))]
        offsets, end = [], 0
        for _, dtype, shape in fields:
            offsets.append(end)
            end += -(-dtype.itemsize * torch.Size(shape).numel() // 128) * 128
        self._ring = PinnedRing(end, device=device)
        self.host = {n: self._ring.host_view(dt, sh, off) for (n, dt, sh), off in zip(fields, offsets)}
        self.dev = {n: self._ring.device_view(dt, sh, off) for (n, dt, sh), off in zip(fields, offsets)}
        if backend == "triton":  # the first launch's per-chunk results, read by the second
            self.chunks = triton.cdiv(vocab, CHUNK)
            self._chunk_max = torch.empty((max_rows, self.chunks), dtype=torch.float32, device=device)
            self._chunk_sum = torch.empty((max_rows, self.chunks), dtype=torch.float32, device=device)
            self._cand_values = torch.empty((max_rows, self.chunks, width), dtype=torch.float32, device=device)
            self._cand_ids = torch.empty((max_rows, self.chunks, width), dtype=torch.int64, device=device)
        self.reset()

    def write(self, row_slots: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor, iteration: torch.Tensor,
              wants: Optional[torch.Tensor] = None) -> None:
        """Capturable: compute the rows' logprobs and write them at ring slot iteration % depth,
        stamped `iteration` ([1] int64 on the device: the mirror's counter, not yet advanced).
        wants: int32 per slot (indexed by `row_slots`), nonzero where its request asked; None:
        every row asked."""
        if self.backend == "triton":
            self._write_triton(row_slots, logits, tokens, iteration, wants)
            return
        n = row_slots.shape[0]
        values, ids = logprob_rows(logits, tokens, self.width)
        ring_slot = iteration.remainder(self.depth)
        self.dev["slots"][:, :n].index_copy_(0, ring_slot, row_slots.long()[None])
        asked = torch.ones_like(row_slots, dtype=torch.int32) if wants is None else wants.index_select(0, row_slots)
        self.dev["asked"][:, :n].index_copy_(0, ring_slot, asked[None])
        self.dev["values"][:, :n].index_copy_(0, ring_slot, values[None])
        self.dev["ids"][:, :n].index_copy_(0, ring_slot, ids[None])
        self.dev["counts"].index_fill_(0, ring_slot, n)
        self.dev["stamps"].index_copy_(0, ring_slot, iteration)

    def _write_triton(self, row_slots, logits, tokens, iteration, wants) -> None:
        """Two launches, no torch ops and no temporaries. logits [n, vocab] with unit column stride."""
        n, vocab = logits.shape
        if vocab != self.vocab or n > self.max_rows or logits.stride(1) != 1:
            raise ValueError(f"LogprobChannel: logits {tuple(logits.shape)} (strides {logits.stride()}) must be "
                             f"[<= {self.max_rows}, {self.vocab}] with contiguous rows")
        check_row_tensors("LogprobChannel.write", n, row_slots=row_slots, tokens=tokens)
        _chunk_kernel[(n, self.chunks)](logits, logits.stride(0), row_slots, wants, self._chunk_max, self._chunk_sum,
                                        self._cand_values, self._cand_ids, vocab, self.chunks, WIDTH=self.width,
                                        CHUNK=CHUNK, GROUP=GROUP, PICKED=triton.next_power_of_2(self.width),
                                        num_warps=CHUNK_WARPS)
        d = self.dev
        _row_kernel[(n,)](logits, logits.stride(0), tokens, row_slots, wants, iteration, self._chunk_max,
                          self._chunk_sum, self._cand_values, self._cand_ids, d["stamps"], d["counts"], d["slots"],
                          d["asked"], d["values"], d["ids"],
                          n, self.chunks, self.depth, self.max_rows, vocab, WIDTH=self.width,
                          CHUNKS_BLOCK=triton.next_power_of_2(self.chunks), WIDTH_BLOCK=triton.next_power_of_2(self.width),
                          num_warps=ROW_WARPS)

    def read(self, read: MirrorRead) -> list[Optional[TokenLogprobs]]:
        """The rows of the mirror's `read` (padding dropped, same order), before `fresh()`, None
        for a row whose slot did not want logprobs (its values were not computed); call after
        the mirror returned `read` (its iteration finished)."""
        ring_slot = read.iteration % self.depth
        stamp = int(self.host["stamps"][ring_slot])
        if stamp != read.iteration:
            raise RuntimeError(f"LogprobChannel: ring slot {ring_slot} holds iteration {stamp}, expected {read.iteration}: "
                               "write it before the mirror's write of the same iteration and reset both together")
        slots = self.host["slots"][ring_slot, : int(self.host["counts"][ring_slot])]
        rows = (slots != 0).nonzero().flatten()
        asked = self.host["asked"][ring_slot, rows].tolist()
        values = self.host["values"][ring_slot, rows].tolist()
        ids = self.host["ids"][ring_slot, rows].tolist()
        return [TokenLogprobs(v[0], list(zip(i, v[1:]))) if a else None for a, v, i in zip(asked, values, ids)]

    def reset(self) -> None:
        """With the mirror's reset (after warm-up and capture, the device idle)."""
        self.host["stamps"].fill_(-1)
