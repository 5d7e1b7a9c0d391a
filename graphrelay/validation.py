"""Host-side input checks for relay and mirror ops, run outside capture before any buffer is
touched, and the switch that turns them on and off.

Each check raises `ValueError` (or `IndexError` for slot values out of range) naming the
argument and the fix. Reading index and payload values costs a device-to-host copy, which is
why these checks are skipped while a CUDA graph is being captured (debug mode checks on the
device) and can be turned off for hot paths that validated their inputs upstream.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from graphrelay.fields import Field

INDEX_DTYPES = (torch.int32, torch.int64)


def is_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def require_bool(name: str, value) -> None:
    """Flags are real bools: a string such as "false" would otherwise read as true."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_device(device) -> torch.device:
    """`device` as a torch.device; a CUDA one must exist (torch's own check is a bare assert)."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: this torch sees no CUDA device (a CPU-only build, or no GPU); "
                         f"use device='cpu'")
    return device


class Validating:
    """Host-side checks, on unless turned off by the constructor's `validate=False` or for one
    block by `with obj.validation(False): ...`; never run during CUDA graph capture."""

    device: torch.device

    def _init_validation(self, validate: bool) -> None:
        require_bool(f"{type(self).__name__}(validate=...)", validate)
        self._validate = validate

    @property
    def validate(self) -> bool:
        """Whether ops check their inputs outside capture. Read-only: use `validation(...)`."""
        return self._validate

    @contextmanager
    def validation(self, enabled: bool):
        """Turn host-side checks on or off inside a `with` block; the old setting comes back
        on exit, even on error."""
        require_bool("validation(enabled)", enabled)
        previous, self._validate = self._validate, enabled
        try:
            yield self
        finally:
            self._validate = previous

    def _checking(self) -> bool:
        return self._validate and not is_capturing(self.device)


def check_indices(indices, device: torch.device, max_reqs: int, max_batch: int) -> None:
    """Validate a bucket of slot indices (any strided 1-D view)."""
    if not isinstance(indices, torch.Tensor):
        raise ValueError(f"indices must be a torch.Tensor of slot ids, got {type(indices).__name__}")
    if indices.device != device:
        raise ValueError(f"indices are on {indices.device} but the relay lives on {device}; move them with .to({str(device)!r})")
    if indices.dtype not in INDEX_DTYPES:
        raise ValueError(f"indices dtype {indices.dtype} must be torch.int32 or torch.int64")
    if indices.dim() != 1:
        raise ValueError(f"indices must be 1-D [bs], got shape {tuple(indices.shape)}")
    bs = indices.shape[0]
    if not 1 <= bs <= max_batch:
        raise ValueError(
            f"indices has {bs} rows; a bucket holds 1..max_batch={max_batch} rows "
            "(pad an empty batch with slot 0 rather than passing none)"
        )
    values = indices.tolist()
    bad = [v for v in values if not 0 <= v <= max_reqs]
    if bad:
        raise IndexError(f"slot index {bad[0]} is out of range [0, {max_reqs}] (slot 0 is the padding row)")
    live = [v for v in values if v != 0]
    if len(set(live)) != len(live):
        dup = next(v for v in live if live.count(v) > 1)
        raise ValueError(f"slot {dup} appears more than once in indices; each request owns one row per batch")


def _dtype_setting(field: Field) -> str:
    """The config setting that picks `field`'s storage dtype."""
    return {"tokens": "RelayConfig.token_dtype", "seq_lens": "RelayConfig.seq_len_dtype"}.get(
        field.name, f"RelayConfig.{field.name}.dtype"
    )


def check_dtype(field: Field, dtype, where: str, *, out: bool) -> None:
    """A dtype the relay can cast `field` from (inputs) or into (`out=` buffers, `alloc_resolved`)."""
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where} dtype must be a torch.dtype, got {dtype!r}")
    if dtype.is_floating_point != field.is_float or dtype in (torch.float64, torch.bool) or dtype.is_complex:
        kind = "a float" if field.is_float else "an integer"
        raise ValueError(f"{where} dtype {dtype} must be {kind} dtype (stored as {field.dtype}; float64 and bool are not accepted)")
    if out and not field.is_float:
        store, have = torch.iinfo(field.dtype), torch.iinfo(dtype)
        if have.min > store.min or have.max < store.max:
            raise ValueError(
                f"{where} dtype {dtype} cannot hold every {field.dtype} value the relay stores (the cast "
                f"would truncate); use {field.dtype} or a wider integer dtype"
            )


def _check_fits(field: Field, value: torch.Tensor, where: str) -> None:
    """Integer values must fit the storage dtype: a cast on store would wrap them silently."""
    if field.is_float or value.numel() == 0:
        return
    store, have = torch.iinfo(field.dtype), torch.iinfo(value.dtype)
    if store.min <= have.min and have.max <= store.max:
        return  # every value of this dtype fits: nothing to read
    low, high = torch.stack(torch.aminmax(value)).tolist()
    if low < store.min or high > store.max:
        bad = low if low < store.min else high
        raise ValueError(
            f"{where} holds {bad}, which does not fit the relay's {field.dtype} "
            f"[{store.min}, {store.max}] and would wrap on store; pass values in range or widen "
            f"{_dtype_setting(field)}"
        )


def _self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of `t` may share memory (an expanded or overlapping view)."""
    span = 1  # elements covered by the dims seen so far, innermost first
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if stride < span:
            return True
        span += stride * (size - 1)
    return False


def check_field(field: Field, value, bs: int, device: torch.device, *, role: str) -> None:
    """Validate one field tensor `[bs, *field.shape]`, any strided view: a payload input, or
    (role "out") an `out=` buffer."""
    where = f"{role}.{field.name}"
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where} must be a torch.Tensor, got {type(value).__name__}")
    if value.device != device:
        raise ValueError(f"{where} is on {value.device} but the relay lives on {device}; move it with .to({str(device)!r})")
    expected = (bs, *field.shape)
    if tuple(value.shape) != expected:
        raise ValueError(f"{where} has shape {tuple(value.shape)}, expected {expected} ([bs, *field shape] with bs=len(indices))")
    check_dtype(field, value.dtype, where, out=role == "out")
    if role == "out":
        if _self_overlapping(value):
            raise ValueError(f"{where} has elements that share memory (an expanded view); pass a buffer with its own storage per element")
    else:
        _check_fits(field, value, where)
        if field.name == "seq_lens":
            _check_non_negative(value, where)


def _check_non_negative(value: torch.Tensor, where: str) -> None:
    """A sequence length counts tokens: a negative one fits the dtype but means nothing."""
    if value.numel() and int(value.min()) < 0:
        raise ValueError(f"{where} holds {int(value.min())}; sequence lengths must be >= 0")


def check_unexpected(struct, fields: tuple[Field, ...], *, role: str) -> None:
    """A struct may only carry tensors for fields the config enables."""
    enabled = {f.name for f in fields}
    for name in struct.__struct_fields__:
        if getattr(struct, name) is not None and name not in enabled:
            raise ValueError(f"{role}.{name} is set but the RelayConfig does not declare it; declare it in the config or leave it None")
