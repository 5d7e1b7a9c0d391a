"""The relay: slot-indexed device rows that carry per-request values to the next iteration.

Every buffer is allocated here, at full shape `[max_reqs + 1, *field shape]`; nothing is
sized from a payload. Each op is fixed-shape in `len(indices)` (a bucket padded with slot
0), allocates nothing when given `out=`, and syncs nothing, so it can run inside a CUDA
graph. Outside capture every op validates its inputs first and changes no state on error.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from graphrelay import debug, kernels, reference, validation
from graphrelay.config import RelayConfig
from graphrelay.fields import PUBLISH, STASH, Field, RelayPayload, Resolved, allocate, relay_fields
from graphrelay.runtime import to_device_async

BACKENDS = ("triton", "torch")
_GROUP_IDS = {STASH: 0, PUBLISH: 1}


_SCATTER_GROUPS = ((0,), (1,), (0, 1))  # stash, publish, both


class Relay:
    """Per-slot rows for every field in `config`; row 0 is the padding row.

    backend: "triton" (one fused launch per op; the default on CUDA) or "torch" (the
    reference path; the default on CPU). validate: check inputs on the host outside capture
    (reads index values, so it syncs; the serving hot path may turn it off).
    """

    def __init__(self, config: RelayConfig, device: torch.device | str = "cpu", *, backend: Optional[str] = None, validate: bool = True):
        self.config = config
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        backend = backend or ("triton" if self.device.type == "cuda" else "torch")
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
        self.backend = backend
        self.validate = validate
        self.debug = config.debug_enabled
        self.fields: tuple[Field, ...] = relay_fields(config)
        self._by_name = {f.name: f for f in self.fields}
        self._publish_field_id = next(i for i, f in enumerate(self.fields) if f.group == PUBLISH)
        # Kernel layouts (chunks per field), keyed by (groups, chunk bytes); None = the gather.
        self._layouts: dict[tuple, kernels.Layout] = {}
        for max_bytes in {kernels.chunk_bytes(1), kernels.chunk_bytes(config.max_batch)}:
            for groups in (None, *_SCATTER_GROUPS):
                fields = [f for f in self.fields if groups is None or _GROUP_IDS[f.group] in groups]
                self._layouts[groups, max_bytes] = kernels.Layout.of([(f.width, f.dtype.itemsize) for f in fields], max_bytes)

        rows = config.rows
        self.buffers: dict[str, torch.Tensor] = {}
        for f in self.fields:
            # Debug mode poisons every request row (-1 / NaN) so an unwritten read is visible;
            # row 0 always holds the padding value that gathers at index 0 must return.
            poison = float("nan") if f.is_float else -1
            init = poison if self.debug else f.fill
            buf = torch.full((rows, *f.shape), init, dtype=f.dtype, device=self.device)
            buf[0] = f.fill
            self.buffers[f.name] = buf
        # Per-slot generation, bumped by admit(): host mirrors use it to spot reused slots.
        self.generation = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.host_generation = torch.zeros(rows, dtype=torch.int64)
        # Debug bookkeeping: per slot and group (stash, publish) a debug.* state, and the
        # first error [code, slot, field_id, 0]. Allocated always, so kernels bind one signature.
        self._state = torch.zeros((rows, 2), dtype=torch.int8, device=self.device)
        self._error = torch.zeros(4, dtype=torch.int32, device=self.device)

    # ---- public ops ------------------------------------------------------------------------

    def stash(self, indices: torch.Tensor, payload: RelayPayload) -> None:
        """Scatter sampled tokens and every enabled speculative field to `indices` rows."""
        self._scatter(indices, self._stash_values(payload), (0,))

    def publish(self, indices: torch.Tensor, new_seq_lens: torch.Tensor, confidence: Optional[torch.Tensor] = None) -> None:
        """Scatter new seq lens (and confidence, when the config declares it)."""
        self._scatter(indices, self._publish_values(new_seq_lens, confidence), (1,))

    def stash_and_publish(self, indices: torch.Tensor, payload: RelayPayload, new_seq_lens: torch.Tensor, confidence: Optional[torch.Tensor] = None) -> None:
        """`stash` and `publish` in one kernel launch: the end of a decode step."""
        values = self._stash_values(payload) + self._publish_values(new_seq_lens, confidence)
        self._scatter(indices, values, (0, 1))

    def resolve(self, indices: torch.Tensor, out: Optional[Resolved] = None) -> Resolved:
        """Gather every enabled field for `indices` in one launch.

        With `out=` (e.g. `static.resolved.narrow(bs)`) it writes those buffers, casting to
        their dtypes, and allocates nothing; without it, it allocates a new `Resolved`.
        """
        bs = indices.shape[0] if isinstance(indices, torch.Tensor) else 0
        if self._checking():
            validation.check_indices(indices, self.device, self.config.max_reqs, self.config.max_batch)
            if out is not None:
                validation.check_unexpected(out, self.fields, role="out")
                for f in self.fields:
                    validation.check_field(f, getattr(out, f.name), bs, self.device, role="out")
        if out is None:
            out = allocate(Resolved, self.fields, bs, self.device)
        outs = tuple(getattr(out, f.name) for f in self.fields)
        bufs = tuple(self.buffers[f.name] for f in self.fields)
        if self.backend == "torch":
            reference.gather(indices, bufs, outs, self._state, self._error, self.config.max_reqs, self._publish_field_id, self.debug)
        else:
            layout = self._layouts[None, kernels.chunk_bytes(bs)]
            widths, blocks, starts = layout
            kernels.gather_kernel[(bs, layout.chunks)](
                indices, bufs, outs, self._state, self._error, self.config.max_reqs,
                WIDTHS=widths, BLOCKS=blocks, STARTS=starts,
                PUBLISH_FIELD_ID=self._publish_field_id,
                DEBUG=self.debug,
                num_warps=kernels.NUM_WARPS,
            )
        return out

    def admit(self, slots: Sequence[int] | torch.Tensor) -> None:
        """Slots (re)assigned to new requests: bump their generations (device and host).

        A host-side scheduling op, not captured: it runs when the scheduler hands out slots.
        In debug mode the rows become UNWRITTEN, so reading them before a write is caught.
        """
        if validation.is_capturing(self.device):
            raise RuntimeError("Relay.admit runs outside CUDA graph capture: call it when the scheduler assigns slots")
        values = slots.tolist() if isinstance(slots, torch.Tensor) else [int(s) for s in slots]
        if not values:
            return
        bad = [s for s in values if not 1 <= s <= self.config.max_reqs]
        if bad:
            raise IndexError(f"admit: slot {bad[0]} is out of range [1, {self.config.max_reqs}] (slot 0 is the padding row)")
        if len(set(values)) != len(values):
            raise ValueError("admit: a slot appears more than once; admit each slot once")
        host = torch.tensor(values, dtype=torch.int64)
        self.host_generation[host] += 1
        dev = to_device_async(host, self.device)
        self.generation.index_add_(0, dev, torch.ones_like(dev))
        self._state.index_fill_(0, dev, debug.UNWRITTEN)

    def check(self) -> None:
        """Debug mode: raise `RelayDebugError` for the first device-side error, then clear it.

        Call outside capture (it reads the device record, which syncs)."""
        if validation.is_capturing(self.device):
            raise RuntimeError("Relay.check reads the device error record: call it outside capture")
        code, slot, field_id, _ = self._error.tolist()
        if code == debug.ERR_NONE:
            return
        self._error.zero_()
        name = "indices" if field_id == debug.ERR_FIELD_INDICES else self.fields[field_id].name
        raise debug.RelayDebugError(code, slot, name)

    # ---- static buffers for captured graphs --------------------------------------------------

    def alloc_resolved(self, batch: Optional[int] = None) -> Resolved:
        """Zeroed `[batch, ...]` buffers (default max_batch) for `resolve(out=...)`."""
        return allocate(Resolved, self.fields, batch or self.config.max_batch, self.device)

    def alloc_payload(self, batch: Optional[int] = None) -> RelayPayload:
        """Zeroed `[batch, ...]` buffers (default max_batch) for a step's stash payload."""
        return allocate(RelayPayload, self.fields, batch or self.config.max_batch, self.device)

    def field(self, name: str) -> Field:
        return self._by_name[name]

    # ---- internals ------------------------------------------------------------------------

    def _checking(self) -> bool:
        return self.validate and not validation.is_capturing(self.device)

    def _stash_values(self, payload: RelayPayload) -> list[tuple[Field, torch.Tensor]]:
        if self._checking():
            if not isinstance(payload, RelayPayload):
                raise ValueError(f"payload must be a graphrelay.RelayPayload, got {type(payload).__name__}")
            validation.check_unexpected(payload, self.fields, role="payload")
        values = []
        for f in self.fields:
            if f.group == STASH:
                value = getattr(payload, f.name)
                if value is None:
                    raise ValueError(f"payload.{f.name} is missing: the RelayConfig declares it, so every stash must carry it")
                values.append((f, value))
        return values

    def _publish_values(self, new_seq_lens: torch.Tensor, confidence: Optional[torch.Tensor]) -> list[tuple[Field, torch.Tensor]]:
        values = [(self._by_name["seq_lens"], new_seq_lens)]
        conf = self._by_name.get("confidence")
        if conf is not None and confidence is None:
            raise ValueError("confidence is missing: the RelayConfig declares it, so every publish must carry it")
        if conf is None and confidence is not None:
            raise ValueError("confidence was given but the RelayConfig does not declare it; add `confidence` to the config")
        if conf is not None:
            values.append((conf, confidence))
        return values

    def _scatter(self, indices: torch.Tensor, values: list[tuple[Field, torch.Tensor]], groups: tuple[int, ...]) -> None:
        if self._checking():
            validation.check_indices(indices, self.device, self.config.max_reqs, self.config.max_batch)
            for f, value in values:
                validation.check_field(f, value, indices.shape[0], self.device, role="payload" if f.group == STASH else "publish")
        srcs = tuple(v for _, v in values)
        bufs = tuple(self.buffers[f.name] for f, _ in values)
        if self.backend == "torch":
            reference.scatter(indices, srcs, bufs, groups, self._state, self._error, self.config.max_reqs, self.debug)
        else:
            layout = self._layouts[groups, kernels.chunk_bytes(indices.shape[0])]
            widths, blocks, starts = layout
            kernels.scatter_kernel[(indices.shape[0], layout.chunks)](
                indices, srcs, bufs, self._state, self._error, self.config.max_reqs,
                WIDTHS=widths, BLOCKS=blocks, STARTS=starts,
                GROUPS=groups,
                DEBUG=self.debug,
                num_warps=kernels.NUM_WARPS,
            )
