"""Which calls are capture hazards, and the fix for each: the linter's rule tables.

Three levels see different things on CPU, so each has its table:
- torch functions (a `TorchFunctionMode`): the user-facing call, e.g. `Tensor.tolist`, or a
  `.cpu()` that is a no-op on CPU and never reaches dispatch;
- aten ops (a `TorchDispatchMode`): what `bool()`, indexing or `unique` turn into, judged by
  the op's tags (`data_dependent_output`, `dynamic_output_shape`) and its index dtypes;
- plain Python functions that no mode sees (`torch.cuda.synchronize`, cudart queries): these
  are patched for the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from graphrelay.lint.report import HazardKind


@dataclass(frozen=True)
class Hazard:
    """A rule's verdict on one call: what kind, how to name the op, how to fix it."""

    kind: HazardKind
    op: str
    fix: str
    detail: str = ""


# A function-level rule may clear a call outright: its CPU implementation reads values on the
# host, but the CUDA one does not, so the aten ops it issues must not be reported either.
EXEMPT = Hazard(HazardKind.HOST_SYNC, "<exempt>", "")

_FIX_BRANCH = "branch on the device: compute both sides and select with torch.where, not a Python if"
_FIX_SCALAR = (
    "keep the value on the device as a 0-d tensor; size and index by the bucket (x.shape[0]) "
    "and by index tensors, never by Python numbers read from values"
)
_FIX_HOST_VALUES = (
    "keep the values on the device; if the host needs them, write them into the mapped pinned "
    "host ring in the step and read them after the iteration's event has fired"
)
_FIX_HOST_COPY = (
    "don't copy to pageable host memory in the step: copy into a preallocated pinned buffer "
    "with buf.copy_(x, non_blocking=True) and read it after the iteration's event has fired"
)
_FIX_PRINT = "remove the print/format of a tensor from the step: it reads the values on the host"
_FIX_SYNC = "remove it from the step; the host checks an event outside the graph (query, never block)"
_FIX_MASK = (
    "keep the full shape: torch.where(mask, x, fill), x.masked_fill(~mask, fill), or "
    "torch.nonzero_static(mask, size=bucket)"
)
_FIX_MASK_WRITE = "write with x.masked_fill_(mask, value) or torch.where(mask, value, x)"
_FIX_UNIQUE = "avoid unique in the step: keep fixed-size results (sort, then compare neighbours)"
_FIX_DYNAMIC = "replace it with a fixed-shape op sized by the bucket, not by tensor values"
_FIX_PYTHON_DATA = (
    "build the tensor once, outside the step, as a static buffer and pass it in (or fill a "
    "preallocated device buffer with tensor ops)"
)
_FIX_IMPLICIT_TENSOR = (
    "build the index tensor once, outside the step, on the device, and pass it in or keep it "
    "as state (a buffer the step's owner allocates)"
)
FIX_VALUE_DEPENDENT = (
    "make the step branch-free in input values: compute both sides and select with "
    "torch.where, and size outputs by the bucket, not by values"
)


def _sync(op: str, fix: str, detail: str = "") -> Hazard:
    return Hazard(HazardKind.HOST_SYNC, op, fix, detail)


_T = torch.Tensor
_TENSOR_METHOD_HAZARDS: dict[Callable[..., Any], Hazard] = {
    _T.item: _sync("Tensor.item", _FIX_SCALAR),
    _T.__bool__: _sync(
        "Tensor.__bool__", _FIX_BRANCH, "a tensor used as a Python bool (if/while/and/or/not)"
    ),
    _T.__int__: _sync("Tensor.__int__", _FIX_SCALAR, "int() of a tensor"),
    _T.__float__: _sync("Tensor.__float__", _FIX_SCALAR, "float() of a tensor"),
    _T.__index__: _sync("Tensor.__index__", _FIX_SCALAR, "a tensor used as a Python index or range bound"),
    _T.__contains__: _sync("Tensor.__contains__", _FIX_BRANCH, "`value in tensor`"),
    _T.tolist: _sync("Tensor.tolist", _FIX_HOST_VALUES),
    _T.numpy: _sync("Tensor.numpy", _FIX_HOST_VALUES),
    _T.__array__: _sync("Tensor.__array__", _FIX_HOST_VALUES, "numpy conversion of a tensor"),
    _T.cpu: _sync("Tensor.cpu", _FIX_HOST_COPY),
    _T.__repr__: _sync("Tensor.__repr__", _FIX_PRINT),
    _T.__format__: _sync("Tensor.__format__", _FIX_PRINT),
}
_TO_CPU = _sync("Tensor.to(\"cpu\")", _FIX_HOST_COPY)
_PYTHON_DATA_CREATORS = {
    torch.tensor: "torch.tensor",
    torch.as_tensor: "torch.as_tensor",
    torch.asarray: "torch.asarray",
    _T.new_tensor: "Tensor.new_tensor",
}
_ONE_HOT_UNSIZED = Hazard(
    HazardKind.DATA_DEPENDENT_SHAPE,
    "torch.nn.functional.one_hot",
    "pass num_classes= so the output shape is static",
    "without num_classes the width is max(value) + 1",
)


def _names_cpu(device: Any) -> bool:
    # NOTE: only a device *string* counts. On a CPU lint run `x.to(other.device)` also targets
    # the CPU, but on the GPU it stays put; a literal "cpu" is a host copy wherever it runs.
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def function_hazard(func: Callable[..., Any], args: tuple, kwargs: dict) -> Optional[Hazard]:
    """The hazard of a torch-function-level call, `EXEMPT`, or None when it is harmless."""
    hazard = _TENSOR_METHOD_HAZARDS.get(func)
    if hazard is not None:
        return hazard
    if func is _T.to:
        device = kwargs.get("device", args[1] if len(args) > 1 else None)
        return _TO_CPU if _names_cpu(device) else None
    if func in _PYTHON_DATA_CREATORS:
        data = args[1] if func is _T.new_tensor else (args[0] if args else kwargs.get("data"))
        if isinstance(data, torch.Tensor):
            return None
        return Hazard(HazardKind.PYTHON_DATA_TENSOR, _PYTHON_DATA_CREATORS[func], _FIX_PYTHON_DATA)
    if func is torch.nn.functional.one_hot:
        num_classes = kwargs.get("num_classes", args[1] if len(args) > 1 else -1)
        return _ONE_HOT_UNSIZED if num_classes == -1 else EXEMPT
    return None


_aten = torch.ops.aten
_MASK_READS = {_aten.index}
_MASK_WRITES = {_aten.index_put, _aten.index_put_, _aten._index_put_impl_}
_MASK_DTYPES = (torch.bool, torch.uint8)
_SIZED_BY_KWARG = {_aten.repeat_interleave: "output_size"}
_DYNAMIC_FIXES = {
    _aten.nonzero: _FIX_MASK,
    _aten.masked_select: _FIX_MASK,
    _aten._unique: _FIX_UNIQUE,
    _aten._unique2: _FIX_UNIQUE,
    _aten.unique_dim: _FIX_UNIQUE,
    _aten.unique_consecutive: _FIX_UNIQUE,
    _aten.repeat_interleave: "pass output_size= (a static bound) so the output shape is known",
}


# Ops whose kernels read a value on the host on CUDA, inside the op: a dispatch mode sees only
# the op itself, never the inner `.item()`.
_SYNCS_INSIDE = {
    _aten.multinomial: (
        "validates its probabilities with a host read",
        "sample on the device with the Gumbel-max trick: (probs / q.exponential_()).argmax(-1)",
    ),
}


def _has_mask_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES for i in indices or ())


def _call_name(func: Callable[..., Any]) -> Optional[str]:
    name = torch.overrides.resolve_name(func)
    return name.removeprefix("torch.") if name and name.startswith("torch.Tensor.") else name


def _implicit_tensor(fresh: torch.Tensor, caller: Optional[Callable[..., Any]], op: str) -> Optional[Hazard]:
    # `lift_fresh` marks a tensor just built from Python data. Calls that build one on purpose
    # (torch.tensor) are reported at function level; this catches the implicit ones, e.g. a
    # list, range or numpy array used as an index. On the GPU that tensor is built on the host
    # and copied from pageable memory, which capture refuses.
    # NOTE: 0-d tensors are skipped. `x[idx] = 1.0` lifts its scalar on CPU only: on the GPU it
    # is made by a device fill, and a 0-d CPU tensor reaches CUDA kernels as a plain value.
    if fresh.dim() == 0:
        return None
    return Hazard(
        HazardKind.PYTHON_DATA_TENSOR,
        (_call_name(caller) if caller is not None else None) or op,
        _FIX_IMPLICIT_TENSOR,
        f"builds a CPU {str(fresh.dtype).removeprefix('torch.')} tensor of shape {list(fresh.shape)} "
        "from Python data (a list, tuple, range or numpy array): on the GPU, a host-to-device "
        "copy from pageable memory, which capture refuses",
    )


def aten_hazard(
    func: torch._ops.OpOverload, args: tuple, kwargs: dict, caller: Optional[Callable[..., Any]] = None
) -> Optional[Hazard]:
    """The hazard of an aten op as dispatched, or None when it is harmless. `caller` is the
    torch function the step called that issued the op, when known, to name the hazard by."""
    packet = func.overloadpacket
    op = str(func)
    if packet is _aten.lift_fresh:
        return _implicit_tensor(args[0], caller, op)
    if packet in _MASK_READS or packet in _MASK_WRITES:
        if len(args) < 2 or not _has_mask_index(args[1]):
            return None
        if packet in _MASK_WRITES:
            detail = "assignment through a boolean mask"
            return Hazard(HazardKind.DATA_DEPENDENT_SHAPE, op, _FIX_MASK_WRITE, detail)
        return Hazard(HazardKind.DATA_DEPENDENT_SHAPE, op, _FIX_MASK, "indexing with a boolean mask")
    if packet in _SYNCS_INSIDE:
        detail, fix = _SYNCS_INSIDE[packet]
        return _sync(op, fix, detail)
    if torch.Tag.data_dependent_output in func.tags:
        return _sync(op, _FIX_SCALAR, "reads a tensor value on the host")
    if torch.Tag.dynamic_output_shape in func.tags:
        sizing_kwarg = _SIZED_BY_KWARG.get(packet)
        if sizing_kwarg and kwargs.get(sizing_kwarg) is not None:
            return None
        return Hazard(
            HazardKind.DATA_DEPENDENT_SHAPE,
            op,
            _DYNAMIC_FIXES.get(packet, _FIX_DYNAMIC),
            "the output shape depends on tensor values",
        )
    return None


@dataclass(frozen=True)
class PatchedCall:
    """A plain function no mode sees, replaced for the run by a recording stand-in."""

    owner: Any
    name: str
    hazard: Hazard
    # Whether the original may run: torch.cuda calls raise on a machine without CUDA.
    call_original: bool


_FIX_RAW_ALLOC = "allocate and free before capture; the step only uses preallocated buffers"
_CUDART_BLOCKING = (
    "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaEventQuery", "cudaStreamQuery",
)
_CUDART_ALLOCATING = ("cudaMalloc", "cudaHostAlloc", "cudaMallocHost", "cudaFree", "cudaFreeHost")


def patched_calls() -> list[PatchedCall]:
    """Host-blocking calls to intercept, limited to what this install has."""
    has_cuda = torch.cuda.is_available()
    from_numpy = Hazard(HazardKind.PYTHON_DATA_TENSOR, "torch.from_numpy", _FIX_PYTHON_DATA)
    calls = [
        PatchedCall(torch.cuda, "synchronize", _sync("torch.cuda.synchronize", _FIX_SYNC), has_cuda),
        PatchedCall(torch, "from_numpy", from_numpy, True),
    ]
    for owner in (torch.cuda.Stream, torch.cuda.Event):
        for name in ("synchronize", "query"):
            hazard = _sync(f"torch.cuda.{owner.__name__}.{name}", _FIX_SYNC)
            calls.append(PatchedCall(owner, name, hazard, has_cuda))
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        hazard = _sync("torch.accelerator.synchronize", _FIX_SYNC)
        calls.append(PatchedCall(accelerator, "synchronize", hazard, has_cuda))
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return calls
    # On a machine without a driver these return cudaErrorInsufficientDriver: safe to call.
    for name in _CUDART_BLOCKING:
        calls.append(PatchedCall(cudart, name, _sync(f"cudart.{name}", _FIX_SYNC), True))
    for name in _CUDART_ALLOCATING:
        hazard = _sync(f"cudart.{name}", _FIX_RAW_ALLOC, "raw allocation synchronizes the device")
        calls.append(PatchedCall(cudart, name, hazard, True))
    return calls
