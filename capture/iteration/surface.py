"""The static input surface of a decode step: max-shape device buffers the graphs read.

The CPU prepares a batch (slots and sampling params), `load` writes it into a pinned staging
row and copies it to the device with ONE non-blocking copy, padding rows past the batch with
each field's padding value. The captured graphs read `[:bs]` views of the device buffers,
whose addresses never change.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple, Sequence

import msgspec
import torch

from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.runtime import Event

_ALIGN = 16  # bytes: every field view starts 16-byte aligned


class PrefillChunk(msgspec.Struct, frozen=True):
    """Part of a prompt to prefill: `tokens` go to positions `start ..` of `slot`; `last` marks
    the chunk that ends the prompt (its last token's output is sampled)."""

    slot: int
    tokens: list[int]
    start: int
    last: bool
    params: SamplingParams


class HostBatch(msgspec.Struct):
    """One iteration's batch as the scheduler sees it: slot and sampling params per request."""

    slots: list[int]
    params: list[SamplingParams]


class InputsView(NamedTuple):
    """`[:bs]` views of the device inputs, for one bucket."""

    slots: torch.Tensor  # [bs] int64, 0 = padding row
    temperature: torch.Tensor  # [bs] float32, 0 = greedy
    top_k: torch.Tensor  # [bs] int32, 0 = no cut
    seeds: torch.Tensor  # [bs] int64
    top_p: torch.Tensor  # [bs] float32, 1 = no nucleus cut (last: positional users predate it)


# name -> (dtype, padding value). Padding rows are greedy requests on slot 0.
_FIELDS = {
    "slots": (torch.int64, 0),
    "temperature": (torch.float32, 0.0),
    "top_k": (torch.int32, 0),
    "seeds": (torch.int64, 0),
    "top_p": (torch.float32, 1.0),
}


class DecodeInputs:
    """Device input buffers `[max_batch]` plus `depth` pinned staging rows of the same layout.

    NOTE: a staging row may be rewritten only after the copy that last read it has run; with
    `depth` rows and a loop that waits for iteration N-1 before preparing N+1, depth 2 never
    waits. If it would, `load` blocks on that copy's event and counts it in `staging_waits`.
    """

    def __init__(self, max_batch: int, device: torch.device | str, depth: int = 2):
        self.max_batch = max_batch
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        offsets, end = {}, 0
        for name, (dtype, _) in _FIELDS.items():
            offsets[name] = end
            end += -(-max_batch * dtype.itemsize // _ALIGN) * _ALIGN
        self._offsets = offsets
        self._nbytes = end
        self._device_bytes = torch.zeros(end, dtype=torch.uint8, device=self.device)
        self.buffers = self._views(self._device_bytes)
        # On the CPU the device buffers are host memory already: load writes them directly.
        depth = depth if self.on_gpu else 1
        self._staging = torch.zeros((depth, end), dtype=torch.uint8, pin_memory=self.on_gpu)
        self._staged = [self._views(self._staging[k]) for k in range(depth)]
        self._copied = [Event(device=self.device) for _ in range(depth)] if self.on_gpu else []
        self._next = 0
        self.staging_waits = 0

    def _views(self, raw: torch.Tensor) -> InputsView:
        return InputsView(
            **{
                name: raw[self._offsets[name] : self._offsets[name] + self.max_batch * dtype.itemsize].view(dtype)
                for name, (dtype, _) in _FIELDS.items()
            }
        )

    def narrow(self, bs: int) -> InputsView:
        return InputsView(*(t[:bs] for t in self.buffers))

    def load(self, batch: HostBatch, bs: int, stream=None) -> None:
        """Stage `batch` in rows 0..n-1 and padding in rows n..bs-1, then copy to the device
        on `stream` (a torch CUDA stream; ignored on the CPU) without blocking the host."""
        n = len(batch.slots)
        if len(batch.params) != n:
            raise ValueError(f"HostBatch has {n} slots but {len(batch.params)} sampling params; give one per request")
        if not n <= bs <= self.max_batch:
            raise ValueError(f"a batch of {n} requests cannot load into a bucket of {bs} (max_batch {self.max_batch})")
        k = self._next
        if self.on_gpu and not self._copied[k].query():
            self.staging_waits += 1
            self._copied[k].synchronize()
        staged = self._staged[k] if self.on_gpu else self.buffers
        columns = {
            "slots": batch.slots,
            "temperature": [p.temperature for p in batch.params],
            "top_k": [p.top_k for p in batch.params],
            "seeds": [p.seed for p in batch.params],
            "top_p": [p.top_p for p in batch.params],
        }
        for name, values in columns.items():
            _write_padded(getattr(staged, name), values, bs, _FIELDS[name][1])
        if self.on_gpu:
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                self._device_bytes.copy_(self._staging[k], non_blocking=True)
            self._copied[k].record(stream if stream is not None else torch.cuda.current_stream(self.device))
            self._next = (k + 1) % len(self._staged)


def _write_padded(dst: torch.Tensor, values: Sequence, bs: int, pad) -> None:
    n = len(values)
    if n:
        dst[:n] = torch.tensor(values, dtype=dst.dtype)
    dst[n:bs] = pad
