"""Backend selection and the host side of a Triton launch, importable without Triton.

The Triton kernel modules (`graphrelay.kernels`, `graphrelay.mirror_kernels`) are imported
only when a relay or mirror first picks the Triton backend, so `import graphrelay` works on a
machine without Triton or a CUDA driver (the torch backend is pure torch). What a launch needs
on the host -- the chunk layout and each tensor's stride descriptor -- is computed here, so
building it never imports Triton either.
"""

from __future__ import annotations

import importlib

import torch

BACKENDS = ("triton", "torch")
NUM_WARPS = 4  # per program

# Stride descriptor modes, shared with the kernels (a constexpr per tensor picks the address
# arithmetic, so the common contiguous case compiles exactly as if strides did not exist).
CONTIGUOUS = -1  # rows of `width` elements back to back: element k of row i at i * width + k
FLAT = 0  # element k of row i at i * s0 + k * s2 (the row's elements are evenly spaced)
# A mode n > 0: a 2-D row of inner rows of n elements, at i * s0 + (k // n) * s1 + (k % n) * s2.


def triton_module(name: str):
    """`graphrelay.<name>`, a Triton kernel module, imported on first use."""
    try:
        return importlib.import_module(f"graphrelay.{name}")
    except ImportError as exc:
        raise ImportError(
            f"graphrelay's Triton backend could not be loaded ({exc}); install triton, or use "
            "the pure-torch path: Relay(..., backend='torch') / HostMirror(..., use_triton=False)"
        ) from exc


def chunk_bytes(bs: int) -> int:
    """Bytes one program copies. Small batches want many programs (a batch of 1 would leave
    most of the GPU idle); large ones want fewer, fatter programs (less block scheduling).
    Measured on an H200, EAGLE fields: 2 KiB is best up to ~64 rows, 4 KiB above."""
    return 2048 if bs <= 64 else 4096


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class Layout(tuple):
    """(WIDTHS, BLOCKS, STARTS) constexpr tuples for a list of (width, itemsize) fields split in
    chunks of at most `max_bytes`, and the grid's chunk count `STARTS[-1]`."""

    @classmethod
    def of(cls, fields: list[tuple[int, int]], max_bytes: int) -> "Layout":
        widths = tuple(w for w, _ in fields)
        blocks = tuple(min(next_power_of_2(w), max(1, max_bytes // size)) for w, size in fields)
        starts = [0]
        for w, b in zip(widths, blocks):
            starts.append(starts[-1] + -(-w // b))
        return cls((widths, blocks, tuple(starts)))

    @property
    def chunks(self) -> int:
        return self[2][-1]


_NO_STRIDES = (0, 0, 0)


def strides_of(t: torch.Tensor, shape: tuple[int, ...]) -> tuple[int, tuple[int, int, int]]:
    """(mode, (s0, s1, s2)) addressing element k (row-major within a row) of row i of `t`, a
    `[n, *shape]` tensor with 0 to 2 per-row dims, in any strided layout."""
    if t.is_contiguous():
        return CONTIGUOUS, _NO_STRIDES
    s0 = t.stride(0)
    # Size-1 dims never advance, so their strides do not matter.
    inner = [(n, s) for n, s in zip(shape, t.stride()[1:]) if n != 1]
    if not inner:
        return FLAT, (s0, 0, 0)
    if len(inner) == 1:
        return FLAT, (s0, 0, inner[0][1])
    (_, outer), (n, s2) = inner
    if outer == n * s2:  # the two dims collapse into one evenly spaced run
        return FLAT, (s0, 0, s2)
    return n, (s0, outer, s2)
