"""Logprobs of the sampled token and the top MAX_LOGPROBS, carried to the host like the tokens.

Semantics: the model's raw distribution, log_softmax of the logits before penalties, bias,
grammar masks and temperature (vLLM's default, "raw logprobs"). Every row gets all
MAX_LOGPROBS; the host keeps the n its request asked for.

`LogprobChannel` is a second host mirror beside `graphrelay.mirror.HostMirror`: a ring of
`depth` iterations in mapped pinned memory, written by the captured step at ring slot
`iteration % depth` and stamped `iteration`, where `iteration` is the mirror's own device
counter read before the mirror's write advances it, with its rows in the mirror's row order.
Only the step's controls variant writes it: taking the iteration from the mirror keeps the
two aligned across the plain iterations that skip it (the engine knows which ran which, and
reads no logprobs for a plain one). It has no events of its own: read iteration i after the
mirror's read of i returned (the same stream wrote both, the channel first).
"""

from __future__ import annotations

import msgspec
import torch

from graphrelay.mirror import MirrorRead
from graphrelay.runtime import PinnedRing

from .params import MAX_LOGPROBS


class TokenLogprobs(msgspec.Struct, frozen=True):
    """One token's values on the host (serve --json writes them by these names)."""

    logprob: float  # the sampled token's
    top: list[tuple[int, float]]  # (token, logprob), best first


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, width: int = MAX_LOGPROBS) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [n, 1 + width] float32: sampled token's logprob then the top `width`; ids
    [n, width] int64). Fixed shape, capturable."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    top = logits.topk(width, dim=-1)
    sampled = logits.gather(1, tokens.long()[:, None])
    return torch.cat([sampled, top.values], dim=1) - lse, top.indices


class LogprobChannel:
    def __init__(self, max_rows: int, depth: int, device: torch.device, width: int = MAX_LOGPROBS):
        self.depth, self.max_rows, self.width = depth, max_rows, width
        fields = [("stamps", torch.int64, (depth,)), ("counts", torch.int64, (depth,)), ("slots", torch.int64, (depth, max_rows)),
                  ("values", torch.float32, (depth, max_rows, 1 + width)), ("ids", torch.int64, (depth, max_rows, width))]
        offsets, end = [], 0
        for _, dtype, shape in fields:
            offsets.append(end)
            end += -(-dtype.itemsize * torch.Size(shape).numel() // 128) * 128
        self._ring = PinnedRing(end, device=device)
        self.host = {n: self._ring.host_view(dt, sh, off) for (n, dt, sh), off in zip(fields, offsets)}
        self.dev = {n: self._ring.device_view(dt, sh, off) for (n, dt, sh), off in zip(fields, offsets)}
        self.reset()

    def write(self, row_slots: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor, iteration: torch.Tensor) -> None:
        """Capturable: compute the rows' logprobs and write them at ring slot iteration % depth,
        stamped `iteration` ([1] int64 on the device: the mirror's counter, not yet advanced)."""
        n = row_slots.shape[0]
        values, ids = logprob_rows(logits, tokens, self.width)
        ring_slot = iteration.remainder(self.depth)
        self.dev["slots"][:, :n].index_copy_(0, ring_slot, row_slots.long()[None])
        self.dev["values"][:, :n].index_copy_(0, ring_slot, values[None])
        self.dev["ids"][:, :n].index_copy_(0, ring_slot, ids[None])
        self.dev["counts"].index_fill_(0, ring_slot, n)
        self.dev["stamps"].index_copy_(0, ring_slot, iteration)

    def read(self, read: MirrorRead) -> list[TokenLogprobs]:
        """The rows of the mirror's `read` (padding dropped, same order), before `fresh()`;
        call after the mirror returned `read` (its iteration finished)."""
        ring_slot = read.iteration % self.depth
        stamp = int(self.host["stamps"][ring_slot])
        if stamp != read.iteration:
            raise RuntimeError(f"LogprobChannel: ring slot {ring_slot} holds iteration {stamp}, expected {read.iteration}: "
                               "write it before the mirror's write of the same iteration and reset both together")
        slots = self.host["slots"][ring_slot, : int(self.host["counts"][ring_slot])]
        rows = (slots != 0).nonzero().flatten()
        values = self.host["values"][ring_slot, rows].tolist()
        ids = self.host["ids"][ring_slot, rows].tolist()
        return [TokenLogprobs(v[0], list(zip(i, v[1:]))) for v, i in zip(values, ids)]

    def reset(self) -> None:
        """With the mirror's reset (after warm-up and capture, the device idle)."""
        self.host["stamps"].fill_(-1)
