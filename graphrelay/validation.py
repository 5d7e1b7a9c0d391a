"""Host-side input checks for relay ops, run outside capture before any buffer is touched.

Each check raises `ValueError` (or `IndexError` for slot values out of range) naming the
argument and the fix. Reading index values costs a device-to-host copy, which is why these
checks are skipped while a CUDA graph is being captured (debug mode checks on the device).
"""

from __future__ import annotations

import torch

from graphrelay.fields import Field

INDEX_DTYPES = (torch.int32, torch.int64)


def is_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_indices(indices, device: torch.device, max_reqs: int, max_batch: int, *, allow_padding: bool = True) -> list[int]:
    """Validate a bucket of slot indices; returns their values on the host."""
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
    low = 0 if allow_padding else 1
    bad = [v for v in values if not low <= v <= max_reqs]
    if bad:
        raise IndexError(f"slot index {bad[0]} is out of range [{low}, {max_reqs}] (slot 0 is the padding row)")
    live = [v for v in values if v != 0]
    if len(set(live)) != len(live):
        dup = next(v for v in live if live.count(v) > 1)
        raise ValueError(f"slot {dup} appears more than once in indices; each request owns one row per batch")
    return values


def check_field(field: Field, value, bs: int, device: torch.device, *, role: str) -> None:
    """Validate one field tensor `[bs, *field.shape]` (payload input or `out=` buffer)."""
    where = f"{role}.{field.name}"
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where} must be a torch.Tensor, got {type(value).__name__}")
    if value.device != device:
        raise ValueError(f"{where} is on {value.device} but the relay lives on {device}")
    expected = (bs, *field.shape)
    if tuple(value.shape) != expected:
        raise ValueError(f"{where} has shape {tuple(value.shape)}, expected {expected} ([bs, *field shape] with bs=len(indices))")
    if value.dtype.is_floating_point != field.is_float or value.dtype in (torch.float64, torch.bool):
        kind = "a float" if field.is_float else "an integer"
        raise ValueError(f"{where} dtype {value.dtype} must be {kind} dtype (stored as {field.dtype}; float64 and bool are not accepted)")
    if not value.is_contiguous():
        raise ValueError(f"{where} must be contiguous; pass {where}.contiguous() or a static buffer view")


def check_unexpected(struct, fields: tuple[Field, ...], *, role: str) -> None:
    """A struct may only carry tensors for fields the config enables."""
    enabled = {f.name for f in fields}
    for name in struct.__struct_fields__:
        if getattr(struct, name) is not None and name not in enabled:
            raise ValueError(f"{role}.{name} is set but the RelayConfig does not declare it; declare it in the config or leave it None")
