"""Programmatic dependent launch (PDL, Hopper and later): whether this GPU and Triton have it,
and the rule the engine's kernels follow when launched with it.

A kernel launched with `launch_pdl=True` may start while the kernel before it on the stream
still runs. It must call `tl.extra.cuda.gdc_wait()` before reading anything an earlier kernel
wrote (or writing anything an earlier kernel reads): the wait returns once every earlier grid
has finished and its writes are visible. Work that depends on nothing earlier (streaming a
weight) may be issued before it. A kernel calls `gdc_launch_dependents()` to let the next
kernel start early; one that never calls it lets the next start when it ends, as without PDL.

Every program of every kernel here calls it only after its own wait, and waits before it ends
even when it has nothing to do. So a kernel that ends has seen its predecessor end, and when a
kernel starts, the kernel two launches back has finished with its writes in L2: a value written
that far back (a step's metadata, written by the iteration prologue) may be read before the
wait, bypassing L1 (`cache_modifier=".cg"`), where the caller guarantees the distance (varlen
attention's `metadata_settled`).
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

try:  # binds tl.extra.cuda (gdc_wait, gdc_launch_dependents) for the kernels; older Tritons lack it
    import triton.language.extra.cuda  # noqa: F401
except ImportError:
    pass


@functools.cache
def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch needs a Hopper-class GPU and a Triton that can launch it."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    cuda = getattr(tl.extra, "cuda", None)
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(cuda, "gdc_wait")


def resolve_pdl(pdl: bool | None, x: torch.Tensor) -> bool:
    """None: on where supported. True where unsupported is an error, not a silent fallback."""
    if pdl is None:
        return pdl_supported(x.device)
    if pdl and not pdl_supported(x.device):
        raise ValueError(f"pdl=True needs a CUDA device of compute capability 9.0+ and a Triton with "
                         f"launch_pdl; {x.device} has none: pass pdl=None (auto) or False")
    return bool(pdl)
