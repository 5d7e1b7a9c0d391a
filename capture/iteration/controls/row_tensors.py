"""The one shape rule every controls Triton launch shares for its per-row tensors."""

from __future__ import annotations

import torch


def check_row_tensors(kernel: str, n: int, **rows: torch.Tensor) -> None:
    """The Triton launches read each per-row tensor as `ptr + row`: each must be [n] with unit
    stride (a broadcast view, stride 0, would read past its one element). Metadata only, so
    capturable."""
    for name, t in rows.items():
        if t.shape != (n,) or (n > 1 and t.stride(0) != 1):
            raise ValueError(f"{kernel}: {name} must be [{n}] with unit stride, got {tuple(t.shape)} "
                             f"strides {t.stride()}: pass .contiguous()")
