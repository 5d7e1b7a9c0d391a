"""N-gram (prompt-lookup) drafting on the device: a static per-slot token history and a
fixed-shape proposer, both capturable inside the decode step's CUDA graph.

History convention: row `slot` of the table holds the request's tokens by position, the
current (latest sampled, not yet cached) token included, so a request with `seq_len` cached
tokens has history length `seq_len + 1`. Row 0 is the padding slot's scratch: padded batch
rows (slot 0) read and write there and never touch a request's row.

`propose` looks for the most recent earlier occurrence of the row's last n tokens (n from
max_n down to min_n, the first n that matches wins) and drafts the up-to-k tokens that
followed it. Two backends compute it: one Triton launch (the CUDA default) and plain torch
ops (the CPU default and the reference), both fixed-shape in (bs, k, max_seq_len, max_n);
neither reads values on the host or branches on them there.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import msgspec
import torch
import triton
import triton.language as tl


# Left padding for the torch backend's shifted rows: tokens are >= 0, so a comparison
# reaching before position 0 never matches.
_BEFORE_START = -1
_SCAN_BLOCK = 1024  # occurrence ends per kernel iteration: 4 iterations cover 4096 positions


class SpecConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """n-gram (prompt lookup) speculation: propose `k` tokens after the most recent earlier
    occurrence of the last n tokens, n from `max_n` down to `min_n`."""

    k: int = 4
    min_n: int = 1
    max_n: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or not 1 <= self.k <= 16:
            raise ValueError(f"SpecConfig.k (draft tokens per iteration) must be an int in 1..16, got {self.k!r}")
        if not isinstance(self.min_n, int) or not isinstance(self.max_n, int) or not 1 <= self.min_n <= self.max_n <= 8:
            raise ValueError(f"SpecConfig needs 1 <= min_n <= max_n <= 8, got min_n={self.min_n!r} max_n={self.max_n!r}")

    @property
    def rows(self) -> int:
        """Query rows per request in the verify forward."""
        return self.k + 1


class Drafts(NamedTuple):
    """What `propose` returns: tokens [bs, k] int64 (0 past num_drafts) and num_drafts [bs]."""

    tokens: torch.Tensor
    num_drafts: torch.Tensor


class TokenHistory:
    """Every live request's tokens, `[max_reqs + 1, max_seq_len]`, allocated once on device."""

    def __init__(self, max_reqs: int, max_seq_len: int, device: torch.device | str, dtype: torch.dtype = torch.int32):
        if not isinstance(max_reqs, int) or max_reqs < 1:
            raise ValueError(f"TokenHistory max_reqs must be a positive int, got {max_reqs!r}")
        if not isinstance(max_seq_len, int) or max_seq_len < 2:
            raise ValueError(f"TokenHistory max_seq_len must be an int >= 2, got {max_seq_len!r}")
        if dtype not in (torch.int32, torch.int64):
            raise ValueError(f"TokenHistory dtype must be int32 or int64, got {dtype}")
        self.max_reqs, self.max_seq_len = max_reqs, max_seq_len
        self.tokens = torch.zeros((max_reqs + 1, max_seq_len), dtype=dtype, device=device)
        self.device = self.tokens.device

    def write_tokens(self, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        """Capturable: token i becomes position `positions[i]` of row `slots[i]` (a flat batch's
        known tokens; slot 0 rows land in the scratch row). slots, positions, tokens: [n]
        integer, positions within 0..max_seq_len-1."""
        n = tokens.shape[0]
        for name, t in (("slots", slots), ("positions", positions), ("tokens", tokens)):
            if t.shape != (n,) or t.dtype not in (torch.int32, torch.int64) or t.device != self.device:
                raise ValueError(f"write_tokens {name} must be int32/int64 [{n}] on {self.device}, got {t.dtype} {tuple(t.shape)}")
        flat = slots.long() * self.max_seq_len + positions.long()
        self.tokens.view(-1).index_copy_(0, flat, tokens.to(self.tokens.dtype))

    def append(self, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Capturable: row i writes `tokens[i, :counts[i]]` at positions `positions[i]..` of
        row `slots[i]`.

        slots, positions, counts: [bs] int32/int64; tokens: [bs, m]. All m columns are written
        (fixed shape): a column at or past counts[i], or one that would land outside
        0..max_seq_len-1, goes to the scratch row 0 instead, so no request's row sees it and no
        index leaves the table.
        NOTE: live rows must name distinct slots; duplicate scratch writes race (harmlessly).
        """
        bs, m = tokens.shape
        for name, t in (("slots", slots), ("positions", positions), ("counts", counts)):
            if t.shape != (bs,) or t.dtype not in (torch.int32, torch.int64) or t.device != self.device:
                raise ValueError(f"append {name} must be int32/int64 [{bs}] on {self.device}, got {t.dtype} {tuple(t.shape)}")
        columns = positions.long()[:, None] + torch.arange(m, device=self.device)  # [bs, m]
        inside = (columns >= 0) & (columns < self.max_seq_len)  # [bs, m]
        keep = (torch.arange(m, device=self.device) < counts[:, None]) & inside  # [bs, m]
        rows = torch.where(keep, slots.long()[:, None], 0)  # [bs, m]
        flat = rows * self.max_seq_len + columns.clamp(0, self.max_seq_len - 1)  # [bs, m]
        self.tokens.view(-1).index_copy_(0, flat.view(-1), tokens.reshape(-1).to(self.tokens.dtype))


@triton.jit
def _propose_kernel(
    history_ptr, history_stride, slots_ptr, slots_stride, lengths_ptr, lengths_stride, tokens_ptr, num_drafts_ptr,
    MAX_SEQ_LEN: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
    MIN_N: tl.constexpr, MAX_N: tl.constexpr, N_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per batch row: scan occurrence ends e = 0..L-2 in blocks of BLOCK, keep the
    latest matching end for every n, then gather the draft of the longest n that matched."""
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row * slots_stride).to(tl.int64)
    length = tl.minimum(tl.maximum(tl.load(lengths_ptr + row * lengths_stride).to(tl.int32), 0), MAX_SEQ_LEN)
    base = history_ptr + slot * history_stride
    n_index = tl.arange(0, N_PAD)  # entry n - 1 holds the latest end matching the last n tokens
    latest = tl.full((N_PAD,), -1, tl.int32)
    # NOTE: a static bound, not the row's length nor a runtime int: older Triton interpreters
    # reject a loaded or passed value as a range bound. The mask drops ends past L - 2.
    for start in range(0, MAX_SEQ_LEN - 1, BLOCK):
        ends = start + tl.arange(0, BLOCK)  # [BLOCK]
        run = ends <= length - 2
        for t in tl.static_range(MAX_N):
            # The row's t-th token from the end against the token t before each end; an end
            # with fewer than t tokens before it drops out (and then so does L <= t).
            run = run & (ends >= t)
            tail = tl.load(base + tl.maximum(length - 1 - t, 0))
            before = tl.load(base + ends - t, mask=run, other=0)
            run = run & (before == tail)
            if t + 1 >= MIN_N:
                found = tl.max(tl.where(run, ends, -1), axis=0)
                latest = tl.where(n_index == t, tl.maximum(latest, found), latest)
    longest = tl.max(tl.where(latest >= 0, n_index, -1), axis=0)
    end = tl.max(tl.where(n_index == longest, latest, -1), axis=0)  # -1 when nothing matched
    steps = tl.arange(0, K_PAD)
    source = end + 1 + steps
    # source > steps says end >= 0 (a match), as a vector: the interpreter rejects a mask
    # built from a scalar comparison.
    valid = (source > steps) & (steps < K) & (source < length) & (length + steps < MAX_SEQ_LEN)
    drafts = tl.load(base + source, mask=valid, other=0)
    tl.store(tokens_ptr + row * K + steps, drafts.to(tl.int64), mask=steps < K)
    tl.store(num_drafts_ptr + row, tl.sum(valid.to(tl.int32), axis=0))


def propose(
    history: TokenHistory,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    min_n: int,
    max_n: int,
    out: Optional[Drafts] = None,
    *,
    backend: Optional[str] = None,
) -> Drafts:
    """Draft up to k tokens per row by prompt lookup. Capturable.

    slots, lengths: [bs] int32/int64; row i's tokens are `history.tokens[slots[i], :lengths[i]]`
    (lengths clamped to 0..max_seq_len). For n = max_n down to min_n, the row's last n tokens
    are searched for at earlier starts s < length - n; the latest such occurrence wins and its
    continuation `tokens[s+n : s+n+k]` (only indices < length) is the draft. num_drafts is
    also capped at max_seq_len - length, so every draft has a cache position to be verified
    at (draft j lands at position length + j). No match: num_drafts 0. Drafts past num_drafts
    are 0. `out` (contiguous int64 tokens [bs, k], contiguous integer num_drafts [bs])
    receives the results.

    backend: "triton" (the CUDA default: one launch, no temporaries) or "torch" (the CPU
    default and the reference; about 6 * max_n ops over [bs, max_seq_len]).
    """
    if not (isinstance(k, int) and isinstance(min_n, int) and isinstance(max_n, int) and k >= 1 and 1 <= min_n <= max_n):
        raise ValueError(f"propose needs ints k >= 1 and 1 <= min_n <= max_n, got k={k!r}, min_n={min_n!r}, max_n={max_n!r}")
    bs = slots.shape[0]
    for name, t in (("slots", slots), ("lengths", lengths)):
        if t.shape != (bs,) or t.dtype not in (torch.int32, torch.int64) or t.device != history.device:
            raise ValueError(f"propose {name} must be int32/int64 [{bs}] on {history.device}, got {t.dtype} {tuple(t.shape)}")
    if out is not None and not (
        out.tokens.shape == (bs, k) and out.tokens.dtype == torch.int64 and out.tokens.is_contiguous()
        and out.num_drafts.shape == (bs,) and not out.num_drafts.dtype.is_floating_point and out.num_drafts.is_contiguous()
    ):
        raise ValueError(f"propose out must be Drafts(contiguous int64 [{bs}, {k}], contiguous integer [{bs}])")
    backend = backend or ("triton" if history.device.type == "cuda" else "torch")
    if backend == "torch":
        drafts = _propose_torch(history, slots, lengths, k, min_n, max_n)
        if out is None:
            return drafts
        out.tokens.copy_(drafts.tokens)
        out.num_drafts.copy_(drafts.num_drafts)
        return out
    if backend != "triton":
        raise ValueError(f"propose backend must be 'triton' or 'torch', got {backend!r}")
    if out is None:
        out = Drafts(torch.empty((bs, k), dtype=torch.int64, device=history.device),
                     torch.empty(bs, dtype=torch.int64, device=history.device))
    if bs:
        _propose_kernel[(bs,)](
            history.tokens, history.tokens.stride(0), slots, slots.stride(0), lengths, lengths.stride(0),
            out.tokens, out.num_drafts, MAX_SEQ_LEN=history.max_seq_len, K=k, K_PAD=triton.next_power_of_2(k),
            MIN_N=min_n, MAX_N=max_n, N_PAD=triton.next_power_of_2(max_n),
            BLOCK=min(_SCAN_BLOCK, triton.next_power_of_2(history.max_seq_len)),
        )
    return out


def _propose_torch(
    history: TokenHistory, slots: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int, max_n: int
) -> Drafts:
    size = history.max_seq_len
    device = history.device
    rows = history.tokens.index_select(0, slots.long())  # [bs, S]
    length = lengths.long().clamp(0, size)  # [bs]
    # An occurrence is named by its END position e (its last token), so extending n by one
    # only adds one comparison per e: the token t = n - 1 before e against the row's t-th
    # token from the end. before[:, (max_n - 1 - t) + e] = rows[:, e - t].
    before = torch.nn.functional.pad(rows, (max_n - 1, 0), value=_BEFORE_START)  # [bs, S + max_n - 1]
    ends = torch.arange(size, device=device)  # [S]
    # The occurrence must end before the row's last position: e <= L - 2.
    run = ends[None, :] <= length[:, None] - 2  # [bs, S]
    end = torch.full_like(length, -1)  # [bs]: latest matching end of the longest n so far
    for t in range(max_n):
        # A tail index below 0 (L <= t) is clamped garbage, but then every e <= L - 2 reaches
        # before position 0 at this t and cannot match.
        tail = rows.gather(1, (length - 1 - t).clamp(0, size - 1)[:, None])  # [bs, 1]
        run = run & (before[:, max_n - 1 - t : max_n - 1 - t + size] == tail)  # n = t + 1 tokens match
        if t + 1 >= min_n:
            found = torch.where(run, ends, -1).amax(dim=1)  # [bs]
            end = torch.where(found >= 0, found, end)  # n rises, so a longer match overrides

    # Draft j is the token after position end + j: it must exist (< L) and have a cache
    # position to be verified at (L + j < S).
    steps = torch.arange(k, device=device)  # [k]
    source = end[:, None] + 1 + steps  # [bs, k]
    valid = (end[:, None] >= 0) & (source < length[:, None]) & (length[:, None] + steps < size)  # [bs, k]
    tokens = torch.where(valid, rows.gather(1, source.clamp(0, size - 1)), 0).long()  # [bs, k]
    return Drafts(tokens, valid.sum(dim=1))  # valid is a prefix of each row
