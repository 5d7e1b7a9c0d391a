"""The baseline the relay is measured against: a per-field eager torch relay.

It is written the way SGLang's `FutureMap` carries values between iterations (for its
semantics; no code is taken from it): one buffer per field, one indexing op per buffer —
`buf[indices] = value.to(buf.dtype)` to scatter, `buf[indices]` to gather into a new tensor.
It holds the same fields, shapes, dtypes and padding values as `graphrelay.Relay` for the
same config, so both move the same bytes. What it does not do is protect padding row 0: a
scatter through slot 0 overwrites it, as in the original. Rows 1..max_reqs and gathers of
live slots match `Relay` exactly.
"""

from __future__ import annotations

from typing import Optional

import torch

from graphrelay.config import RelayConfig
from graphrelay.fields import STASH, RelayPayload, Resolved, relay_fields


class PerFieldRelay:
    def __init__(self, config: RelayConfig, device: torch.device | str):
        self.fields = relay_fields(config)
        self.buffers: dict[str, torch.Tensor] = {
            f.name: torch.full((config.rows, *f.shape), f.fill, dtype=f.dtype, device=device)
            for f in self.fields
        }
        self._stash_names = tuple(f.name for f in self.fields if f.group == STASH)
        self._has_confidence = any(f.name == "confidence" for f in self.fields)

    def stash(self, indices: torch.Tensor, payload: RelayPayload) -> None:
        for name in self._stash_names:
            buf = self.buffers[name]
            buf[indices] = getattr(payload, name).to(buf.dtype)

    def publish(self, indices: torch.Tensor, new_seq_lens: torch.Tensor, confidence: Optional[torch.Tensor] = None) -> None:
        seq_lens = self.buffers["seq_lens"]
        seq_lens[indices] = new_seq_lens.to(seq_lens.dtype)
        if self._has_confidence:
            conf = self.buffers["confidence"]
            conf[indices] = confidence.to(conf.dtype)

    def stash_and_publish(self, indices: torch.Tensor, payload: RelayPayload, new_seq_lens: torch.Tensor,
                          confidence: Optional[torch.Tensor] = None) -> None:
        """`Relay.stash_and_publish`'s signature, as the two per-field calls an engine makes."""
        self.stash(indices, payload)
        self.publish(indices, new_seq_lens, confidence)

    def resolve(self, indices: torch.Tensor) -> Resolved:
        return Resolved(**{f.name: self.buffers[f.name][indices] for f in self.fields})

