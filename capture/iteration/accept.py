"""Verification of n-gram drafts, on the device and capturable: the query-row layout the
target model runs, and the greedy-identical acceptance rule.

A request at position p (its current token, not yet cached, sits at p) with drafts d_0..d_{k-1}
is verified by k + 1 query rows: row j feeds token (current, d_0, ..., d_{k-1})[j] at
position p + j, and the target model samples target[j] from it, exactly as non-speculative
decoding would sample at position p + j (greedy argmax, or the seeded (seed, p + j) draw).
Draft d_j is accepted while every earlier draft was and d_j == target[j]; the emitted tokens
are then target[0 .. accepted], the same tokens plain decoding would produce one at a time.

Rows are laid out request-major: row i * (k + 1) + j belongs to request i, draft step j.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class Accepted(NamedTuple):
    """What `accept` returns: tokens [bs, k + 1] int64 (0 past accept_len) and accept_len [bs]."""

    tokens: torch.Tensor
    accept_len: torch.Tensor


def accept(
    drafts: torch.Tensor, num_drafts: torch.Tensor, target: torch.Tensor, out: Optional[Accepted] = None
) -> Accepted:
    """Accept the leading drafts the target agrees with. Capturable.

    drafts [bs, k] and target [bs, k + 1] integer; num_drafts [bs] integer (drafts at or past
    it are rejected whatever their value). accept_len = leading matches + 1, in 1..k+1: the
    target's own token after the last accepted draft is always emitted.
    """
    bs, k = drafts.shape
    if target.shape != (bs, k + 1) or num_drafts.shape != (bs,):
        raise ValueError(
            f"accept needs drafts [bs, k], num_drafts [bs], target [bs, k + 1]; got "
            f"{tuple(drafts.shape)}, {tuple(num_drafts.shape)}, {tuple(target.shape)}"
        )
    if out is not None and (out.tokens.shape != (bs, k + 1) or out.tokens.dtype != torch.int64 or out.accept_len.shape != (bs,)):
        raise ValueError(f"accept out must be Accepted(int64 [{bs}, {k + 1}], [{bs}])")
    columns = torch.arange(k + 1, device=drafts.device)  # [k + 1]
    agrees = (drafts.long() == target[:, :k].long()) & (columns[None, :k] < num_drafts[:, None])  # [bs, k]
    # Leading run of agreement: once a draft is rejected every later one is too.
    leading = torch.cumprod(agrees, dim=1, dtype=torch.int64).sum(dim=1)  # [bs]
    accept_len = leading + 1  # [bs]
    tokens = torch.where(columns[None, :] < accept_len[:, None], target.long(), 0)  # [bs, k + 1]
    if out is None:
        return Accepted(tokens, accept_len)
    out.tokens.copy_(tokens)
    out.accept_len.copy_(accept_len)
    return out


def verify_positions(positions: torch.Tensor, k: int, max_seq_len: int) -> torch.Tensor:
    """Query positions [bs, k + 1] int64: positions[i] + j, clamped to max_seq_len - 1.

    Why clamping is safe: `propose` caps num_drafts at max_seq_len - length, so every row that
    can be accepted (j <= num_drafts) already lies below max_seq_len; a clamped row is a
    rejected one whose output is discarded, and the cache position it touches (the last one)
    is only ever read by a query at that same position, whose output would be a token past
    the sequence limit. Clamping keeps its cache and rotary indices in bounds.
    """
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"verify_positions k must be an int >= 0, got {k!r}")
    steps = torch.arange(k + 1, device=positions.device)  # [k + 1]
    return (positions.long()[:, None] + steps).clamp(max=max_seq_len - 1)


class VerifyRows(NamedTuple):
    """One query row per (request, draft step), request-major: each [bs * (k + 1)] int64."""

    slots: torch.Tensor
    positions: torch.Tensor


def verify_rows(slots: torch.Tensor, positions: torch.Tensor, k: int, max_seq_len: int) -> VerifyRows:
    """(slot, position) of every query row for a decode-attention kernel that reads both per row.

    slots, positions [bs]: each request's slot and current-token position. A row whose
    position would pass the cache is also moved to the padding slot 0, so the clamped rows of
    a request near its limit never write into the request's own cache row twice.
    """
    bs = slots.shape[0]
    if positions.shape != (bs,):
        raise ValueError(f"verify_rows positions must be [{bs}] like slots, got {tuple(positions.shape)}")
    steps = torch.arange(k + 1, device=positions.device)  # [k + 1]
    inside = positions.long()[:, None] + steps < max_seq_len  # [bs, k + 1]
    row_slots = torch.where(inside, slots.long()[:, None], 0)  # [bs, k + 1]
    return VerifyRows(row_slots.view(-1), verify_positions(positions, k, max_seq_len).view(-1))


def verify_tokens(current: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Each query row's input token [bs * (k + 1)] int64: the current token, then the drafts."""
    return torch.cat((current.long()[:, None], drafts.long()), dim=1).view(-1)
