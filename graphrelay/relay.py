"""The relay: slot-indexed device rows that carry per-request values to the next iteration.

Every buffer is allocated here, at full shape `[max_reqs + 1, *field shape]`; nothing is
sized from a payload. Each op is fixed-shape in `len(indices)` (a bucket padded with slot
0), allocates nothing when given `out=`, and syncs nothing, so it can run inside a CUDA
graph. Outside capture every op validates its inputs first (unless validation is off) and
changes no state on error. Caller tensors may be any strided views, on either backend.
"""

from __future__ import annotations

import operator
from typing import Mapping, Optional, Sequence

import torch

from graphrelay import debug, reference, validation
from graphrelay.backend import BACKENDS, CONTIGUOUS, NUM_WARPS, Layout, chunk_bytes, strides_of, triton_module
from graphrelay.config import RelayConfig
from graphrelay.fields import STASH, Field, RelayPayload, Resolved, allocate, relay_fields
from graphrelay.runtime import to_device_async

class Relay(validation.Validating):
    """Per-slot rows for every field in `config`; row 0 is the padding row.

    backend: "triton" (one fused launch per op; the default on CUDA; Triton is imported here,
    on first use) or "torch" (the reference path; the default on CPU; needs no Triton).
    validate: check inputs on the host outside capture (reads index and payload values, so it
    syncs). The serving hot path turns it off here, or for a block with
    `with relay.validation(False): ...`; `relay.validate` reads the current setting.
    """

    def __init__(self, config: RelayConfig, device: torch.device | str = "cpu", *, backend: Optional[str] = None, validate: bool = True):
        self.config = config
        self.device = validation.check_device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        backend = backend or ("triton" if self.device.type == "cuda" else "torch")
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
        self.backend = backend
        self._kernels = triton_module("kernels") if backend == "triton" else None
        self._init_validation(validate)
        self.debug = config.debug_enabled
        self.fields: tuple[Field, ...] = relay_fields(config)
        self._ids = {f.name: i for i, f in enumerate(self.fields)}
        self._stash_ids = tuple(i for i, f in enumerate(self.fields) if f.group == STASH)
        self._all_ids = tuple(range(len(self.fields)))
        # Filled on first use, so a launch only looks things up: the field ids of each
        # `resolve(fields=...)` subset, and what a launch over a set of field ids binds.
        self._subsets: dict[tuple, tuple[int, ...]] = {}
        self._plans: dict[tuple[int, ...], _Plan] = {}

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
        # Debug bookkeeping: per slot and field a debug.* state, and the first error
        # [code, slot, field_id, 0]. Allocated always, so kernels bind one signature.
        self._state = torch.zeros((rows, len(self.fields)), dtype=torch.int8, device=self.device)
        self._error = torch.zeros(4, dtype=torch.int32, device=self.device)

    # ---- public ops ------------------------------------------------------------------------

    def stash(self, indices: torch.Tensor, payload: RelayPayload) -> None:
        """Scatter sampled tokens and every enabled speculative field to `indices` rows."""
        self._scatter(indices, self._stash_values(payload))

    def publish(self, indices: torch.Tensor, new_seq_lens: torch.Tensor, confidence: Optional[torch.Tensor] = None) -> None:
        """Scatter new seq lens (and confidence, when the config declares it)."""
        self._scatter(indices, self._publish_values(new_seq_lens, confidence))

    def stash_and_publish(self, indices: torch.Tensor, payload: RelayPayload, new_seq_lens: torch.Tensor, confidence: Optional[torch.Tensor] = None) -> None:
        """`stash` and `publish` in one kernel launch: the end of a decode step."""
        self._scatter(indices, self._stash_values(payload) + self._publish_values(new_seq_lens, confidence))

    def resolve(self, indices: torch.Tensor, out: Optional[Resolved] = None, *, fields: Optional[Sequence[str]] = None) -> Resolved:
        """Gather every enabled field, or the `fields=` subset (e.g. `("tokens",)`), for
        `indices` in one launch; the returned `Resolved` holds only the fields read.

        With `out=` (e.g. `static.resolved.narrow(bs)`) it writes those buffers, casting to
        their dtypes, and allocates nothing; without it, it allocates new tensors. In debug
        mode each field is consumed on its own, so a subset read now and another later
        (tokens before the forward, seq lens after, as SGLang does) is no double read.
        """
        ids = self._subset(fields)
        bs = indices.shape[0] if isinstance(indices, torch.Tensor) else 0
        if self._checking():
            validation.check_indices(indices, self.device, self.config.max_reqs, self.config.max_batch)
            if out is not None:
                if not isinstance(out, Resolved):
                    raise ValueError(f"out must be a graphrelay.Resolved (e.g. relay.alloc_resolved(...).narrow(bs)), got {type(out).__name__}")
                validation.check_unexpected(out, self.fields, role="out")
                for i in ids:
                    validation.check_field(self.fields[i], getattr(out, self.fields[i].name), bs, self.device, role="out")
        if out is None:
            out = allocate(Resolved, tuple(self.fields[i] for i in ids), bs, self.device)
        elif fields is not None:
            out = Resolved(**{self.fields[i].name: getattr(out, self.fields[i].name) for i in ids})
        plan = self._plan(ids)
        outs = tuple(getattr(out, name) for name in plan.names)
        if self._kernels is None:
            reference.gather(indices, plan.bufs, outs, ids, self._state, self._error, self.config.max_reqs, self.debug)
        else:
            layout = plan.layout(bs)
            widths, blocks, starts = layout
            modes, strides = plan.strides(outs)
            self._kernels.gather_kernel[(bs, layout.chunks)](
                indices, indices.stride(0), plan.bufs, outs, strides,
                self._state, self._error, self.config.max_reqs,
                OUT_MODES=modes,
                WIDTHS=widths, BLOCKS=blocks, STARTS=starts,
                FIELD_IDS=ids, N_FIELDS=len(self.fields), DEBUG=self.debug,
                num_warps=NUM_WARPS,
            )
        return out

    def admit(self, slots: Sequence[int] | torch.Tensor) -> None:
        """Slots (re)assigned to new requests: bump their generations (device and host).

        A host-side scheduling op, not captured: it runs when the scheduler hands out slots,
        and always checks its input (ints in [1, max_reqs], each once; a 1-D integer tensor
        or a sequence of ints). In debug mode the rows become UNWRITTEN, so reading them
        before a write is caught.
        """
        if validation.is_capturing(self.device):
            raise RuntimeError("Relay.admit runs outside CUDA graph capture: call it when the scheduler assigns slots")
        values = _slot_values(slots)
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

    def alloc_resolved(self, batch: Optional[int] = None, dtypes: Optional[Mapping[str, torch.dtype]] = None) -> Resolved:
        """Zeroed `[batch, ...]` buffers (default max_batch) for `resolve(out=...)`, in the
        storage dtypes unless `dtypes` names others, e.g. `{"tokens": torch.int64}` for a
        model's input ids (the gather casts on store). An integer dtype must hold every
        value of the storage dtype."""
        for name, dtype in (dtypes or {}).items():
            validation.check_dtype(self.field(name), dtype, f"alloc_resolved dtypes[{name!r}]", out=True)
        return allocate(Resolved, self.fields, batch or self.config.max_batch, self.device, dtypes)

    def alloc_payload(self, batch: Optional[int] = None) -> RelayPayload:
        """Zeroed `[batch, ...]` buffers (default max_batch) for a step's stash payload."""
        return allocate(RelayPayload, self.fields, batch or self.config.max_batch, self.device)

    def field(self, name: str) -> Field:
        """The enabled field called `name`; ValueError naming the enabled ones otherwise."""
        if name not in self._ids:
            raise ValueError(f"{name!r} is not a field of this relay; its fields are {list(self._ids)}")
        return self.fields[self._ids[name]]

    # ---- internals ------------------------------------------------------------------------

    def _subset(self, fields: Optional[Sequence[str]]) -> tuple[int, ...]:
        """Field ids, in table order, of a `resolve(fields=...)` argument (None: all)."""
        if fields is None:
            return self._all_ids
        if isinstance(fields, str):
            raise ValueError(f"fields must be a sequence of field names, e.g. ({fields!r},), not a string")
        key = tuple(fields)
        ids = self._subsets.get(key)
        if ids is None:
            if not key or len(set(key)) != len(key):
                raise ValueError(f"fields {key} must name one or more fields, each once")
            for name in key:
                self.field(name)  # raises naming the enabled fields
            ids = tuple(sorted(self._ids[name] for name in key))
            self._subsets[key] = ids
        return ids

    def _plan(self, ids: tuple[int, ...]) -> "_Plan":
        plan = self._plans.get(ids)
        if plan is None:
            plan = self._plans[ids] = _Plan(tuple(self.fields[i] for i in ids), self.buffers)
        return plan

    def _stash_values(self, payload: RelayPayload) -> list[tuple[int, torch.Tensor]]:
        if self._checking():
            if not isinstance(payload, RelayPayload):
                raise ValueError(f"payload must be a graphrelay.RelayPayload, got {type(payload).__name__}")
            validation.check_unexpected(payload, self.fields, role="payload")
        values = []
        for i in self._stash_ids:
            value = getattr(payload, self.fields[i].name)
            if value is None:
                raise ValueError(f"payload.{self.fields[i].name} is missing: the RelayConfig declares it, so every stash must carry it")
            values.append((i, value))
        return values

    def _publish_values(self, new_seq_lens: torch.Tensor, confidence: Optional[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
        values = [(self._ids["seq_lens"], new_seq_lens)]
        declared = "confidence" in self._ids
        if declared and confidence is None:
            raise ValueError("confidence is missing: the RelayConfig declares it, so every publish must carry it")
        if not declared and confidence is not None:
            raise ValueError("confidence was given but the RelayConfig does not declare it; add `confidence` to the config")
        if declared:
            values.append((self._ids["confidence"], confidence))
        return values

    def _scatter(self, indices: torch.Tensor, values: list[tuple[int, torch.Tensor]]) -> None:
        if self._checking():
            validation.check_indices(indices, self.device, self.config.max_reqs, self.config.max_batch)
            for i, value in values:
                f = self.fields[i]
                validation.check_field(f, value, indices.shape[0], self.device, role="payload" if f.group == STASH else "publish")
        ids = tuple(i for i, _ in values)
        srcs = tuple(v for _, v in values)
        plan = self._plan(ids)
        if self._kernels is None:
            reference.scatter(indices, srcs, plan.bufs, ids, self._state, self._error, self.config.max_reqs, self.debug)
        else:
            bs = indices.shape[0]
            layout = plan.layout(bs)
            widths, blocks, starts = layout
            modes, strides = plan.strides(srcs)
            self._kernels.scatter_kernel[(bs, layout.chunks)](
                indices, indices.stride(0), srcs, plan.bufs, strides,
                self._state, self._error, self.config.max_reqs,
                SRC_MODES=modes,
                WIDTHS=widths, BLOCKS=blocks, STARTS=starts,
                FIELD_IDS=ids, N_FIELDS=len(self.fields), DEBUG=self.debug,
                num_warps=NUM_WARPS,
            )


class _Plan:
    """What one launch over a fixed set of fields binds, built once per set: the field names,
    the relay's buffers, and the kernel layout per chunk size."""

    def __init__(self, fields: tuple[Field, ...], buffers: dict[str, torch.Tensor]):
        self.names = tuple(f.name for f in fields)
        self.bufs = tuple(buffers[f.name] for f in fields)
        self.shapes = tuple(f.shape for f in fields)
        self.contiguous = (CONTIGUOUS,) * len(fields)
        self._sizes = [(f.width, f.dtype.itemsize) for f in fields]
        self._layouts: dict[int, Layout] = {}

    def layout(self, bs: int) -> Layout:
        max_bytes = chunk_bytes(bs)
        layout = self._layouts.get(max_bytes)
        if layout is None:
            layout = self._layouts[max_bytes] = Layout.of(self._sizes, max_bytes)
        return layout

    def strides(self, tensors: tuple[torch.Tensor, ...]) -> tuple[tuple[int, ...], Optional[tuple]]:
        """Per caller tensor its `backend.strides_of` mode, and the stride triples the kernel
        reads, or None when every tensor is contiguous (then no stride arguments are bound)."""
        if all(t.is_contiguous() for t in tensors):
            return self.contiguous, None
        described = [strides_of(t, shape) for t, shape in zip(tensors, self.shapes)]
        return tuple(mode for mode, _ in described), tuple(triple for _, triple in described)


def _slot_values(slots) -> list[int]:
    """`admit`'s slots as Python ints: a 1-D integer tensor or a sequence of ints, nothing that
    would be silently coerced (floats truncate, bools read as 0/1)."""
    if isinstance(slots, torch.Tensor):
        if slots.dim() != 1 or slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
            raise ValueError(f"admit: slots must be a 1-D integer tensor, got a {slots.dim()}-D {slots.dtype} tensor")
        return slots.tolist()
    if slots is None or isinstance(slots, (str, bytes)) or not hasattr(slots, "__iter__"):
        raise ValueError(f"admit: slots must be a sequence of ints or a 1-D integer tensor, got {slots!r}")
    values = []
    for s in slots:
        if isinstance(s, bool) or (isinstance(s, torch.Tensor) and s.dtype == torch.bool):
            raise ValueError(f"admit: slot {s!r} is a bool, not a slot id")
        try:
            values.append(operator.index(s))
        except TypeError:
            raise ValueError(f"admit: slot {s!r} is not an int (a {type(s).__name__}); pass integer slot ids") from None
    return values
