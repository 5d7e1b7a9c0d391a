"""cuda-python runtime layer: events, streams and mapped pinned host memory (docs/design.md §2.6).

Everything here is created *before* any CUDA graph capture and never inside one: creating an
`Event`, `Stream` or `PinnedRing` while the current stream is capturing raises.

Two modes, decided per object by its device:

- **GPU mode** (`device="cuda[:n]"`, the default when `cuda_available()`): real CUDA objects
  from `cuda.bindings.runtime` (not torch's wrappers), every call's status checked.
- **Host mode** (`device="cpu"`, the default without a CUDA driver): trivial stand-ins with
  synchronous semantics, so the same code runs on a CPU machine. Events are always fired,
  record/wait are no-ops, a `PinnedRing` is ordinary memory whose "device" view is its host
  view. GPU-only requests (timing, `as_torch()`, a CUDA device without a GPU) raise
  `RuntimeError` saying there is no GPU.

Every object knows its `.device` and `.on_gpu`. Streams are accepted as a graphrelay `Stream`,
a `torch.cuda.Stream` (anything with `.cuda_stream`) or a raw `cudaStream_t` int.
"""

from __future__ import annotations

import ctypes
import functools
import weakref

import torch
from cuda.bindings import runtime as cudart

_SUCCESS = cudart.cudaError_t.cudaSuccess
_NOT_READY = cudart.cudaError_t.cudaErrorNotReady


def check(err, call: str) -> None:
    """Raise `RuntimeError` naming `call` and the CUDA error unless `err` is cudaSuccess."""
    err = cudart.cudaError_t(err)
    if err == _SUCCESS:
        return
    _, name = cudart.cudaGetErrorName(err)
    _, text = cudart.cudaGetErrorString(err)
    raise RuntimeError(f"{call} failed: {name.decode()}: {text.decode()}")


def _cuda(fn, *args):
    """Call a `cuda.bindings.runtime` function, check its status, return its value (or None)."""
    err, *values = fn(*args)
    check(err, fn.__name__)
    return values[0] if values else None


def graph_node_count(raw_graph: int) -> int:
    """Nodes in a captured `cudaGraph_t` (torch's `CUDAGraph.raw_cuda_graph()`, kept with
    `keep_graph=True`): kernels, copies and memsets, as the GPU will run them."""
    err, _nodes, count = cudart.cudaGraphGetNodes(cudart.cudaGraph_t(init_value=raw_graph), 0)
    check(err, "cudaGraphGetNodes")
    return int(count)


@functools.cache
def _driver_status() -> tuple[int, str]:
    """(device count, why not) from the driver; count 0 means host mode."""
    err, count = cudart.cudaGetDeviceCount()
    if err != _SUCCESS:
        return 0, f"cudaGetDeviceCount returned {cudart.cudaGetErrorName(err)[1].decode()}"
    if count == 0:
        return 0, "the CUDA driver reports no devices"
    if not torch.cuda.is_available():
        return 0, "this torch build has no CUDA support"
    return count, ""


def cuda_available() -> bool:
    """True only if the CUDA driver answers with at least one device (and torch can use it).
    False is the cue for host mode, never a crash."""
    return _driver_status()[0] > 0


def resolve_device(device=None) -> torch.device:
    """The device an object lives on: None picks the current CUDA device when a GPU is present,
    else the CPU (host mode). Asking for CUDA without a GPU raises RuntimeError."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if cuda_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device must be 'cuda[:n]' or 'cpu', got {device}")
    if not cuda_available():
        raise RuntimeError(
            f"no GPU: device {device} was requested but {_driver_status()[1]}; "
            "use device='cpu' (host mode) on this machine"
        )
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _no_gpu(what: str) -> RuntimeError:
    return RuntimeError(f"no GPU: {what} needs a CUDA device, and this object is in host mode (cpu)")


def _forbid_capture(what: str) -> None:
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"cannot create a {what} while the current stream is capturing a CUDA graph: "
            "allocation belongs before capture; create it at start-up and reuse it"
        )


def _stream_handle(stream, on_gpu: bool) -> int:
    """The raw cudaStream_t of a graphrelay Stream, a torch.cuda.Stream or an int (0 in host mode)."""
    if isinstance(stream, Stream):
        stream._require_open()
        if on_gpu and not stream.on_gpu:
            raise ValueError("a host-mode (cpu) Stream cannot order GPU work; create Stream('cuda')")
        return stream.handle
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    handle = getattr(stream, "cuda_stream", None)
    if isinstance(handle, int):
        return handle
    raise TypeError(
        "expected a graphrelay Stream, a torch.cuda.Stream or a raw cudaStream_t int, "
        f"got {type(stream).__name__}"
    )


class Closeable:
    """Base of objects freed deterministically by close() / `with`, with a finalizer as a
    backstop; using one after close() raises RuntimeError."""

    _finalizer: weakref.finalize | None = None
    _closed = False

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} is closed; create a new one")

    def _finalize_with(self, destroy, *args) -> None:
        self._finalizer = weakref.finalize(self, destroy, *args)
        # NOTE: at interpreter exit the driver reclaims everything; destroying then races
        # CUDA's own teardown and can only print spurious errors.
        self._finalizer.atexit = False


class Stream(Closeable):
    """A non-blocking CUDA stream (cudaStreamCreateWithFlags), or a host-mode stand-in.

    NOTE: torch's pinned-memory allocator records an event on every stream a pinned tensor
    was copied on when that tensor is freed. If this stream is destroyed first, that record
    fails and the process terminates. Where torch pinned tensors are copied on the stream, use
    `Stream.persistent(device)` (one per device, never destroyed) or wrap one of torch's
    pooled streams with `Stream.from_torch(torch.cuda.Stream())`.
    """

    def __init__(self, device=None) -> None:
        self.device = resolve_device(device)
        self.on_gpu = self.device.type == "cuda"
        self._torch_stream = None
        self.handle = 0
        if self.on_gpu:
            _forbid_capture("Stream")
            with torch.cuda.device(self.device):
                raw = _cuda(cudart.cudaStreamCreateWithFlags, cudart.cudaStreamNonBlocking)
            self.handle = int(raw)
            self._finalize_with(_cuda, cudart.cudaStreamDestroy, raw)

    @classmethod
    def persistent(cls, device) -> "Stream":
        """The process's long-lived stream for `device`: created once with cuda-python, never
        destroyed (torch's pinned tensors copied on it may outlive any one user), the same
        object on every call. Host mode: a fresh stand-in."""
        device = resolve_device(device)
        if device.type != "cuda":
            return cls(device)
        return _persistent_stream(device.index)

    @classmethod
    def from_torch(cls, torch_stream) -> "Stream":
        """Wrap an existing torch.cuda.Stream without owning it (close() does not destroy it)."""
        stream = cls.__new__(cls)
        stream.device = torch.device(torch_stream.device)
        stream.on_gpu = True
        stream.handle = int(torch_stream.cuda_stream)
        stream._torch_stream = torch_stream
        return stream

    _persistent = False

    def close(self) -> None:
        """Destroy the stream (a persistent one stays: others hold the same object)."""
        if not self._persistent:
            super().close()

    def as_torch(self) -> torch.cuda.Stream:
        """This stream as a torch stream (an ExternalStream, made once), for `torch.cuda.stream(...)`."""
        self._require_open()
        if not self.on_gpu:
            raise _no_gpu("Stream.as_torch()")
        if self._torch_stream is None:
            self._torch_stream = torch.cuda.ExternalStream(self.handle, device=self.device)
        return self._torch_stream

    def synchronize(self) -> None:
        """Block the host until all work on this stream finished (no-op in host mode)."""
        self._require_open()
        if self.on_gpu:
            _cuda(cudart.cudaStreamSynchronize, self.handle)


@functools.cache
def _persistent_stream(index: int) -> Stream:
    stream = Stream.__new__(Stream)
    stream.device, stream.on_gpu, stream._torch_stream = torch.device("cuda", index), True, None
    stream._persistent = True
    _forbid_capture("Stream")
    with torch.cuda.device(stream.device):
        stream.handle = int(_cuda(cudart.cudaStreamCreateWithFlags, cudart.cudaStreamNonBlocking))
    return stream  # no finalizer: it lives as long as the process


class Event(Closeable):
    """A CUDA event (timing disabled unless `timing=True`), or a host-mode stand-in that is
    always fired."""

    def __init__(self, timing: bool = False, device=None) -> None:
        self.device = resolve_device(device)
        self.on_gpu = self.device.type == "cuda"
        self.timing = timing
        self._raw = None
        if self.on_gpu:
            _forbid_capture("Event")
            flags = cudart.cudaEventDefault if timing else cudart.cudaEventDisableTiming
            with torch.cuda.device(self.device):
                self._raw = _cuda(cudart.cudaEventCreateWithFlags, flags)
            self._finalize_with(_cuda, cudart.cudaEventDestroy, self._raw)

    def record(self, stream) -> None:
        """Capture the work queued on `stream` so far; the event fires when it finishes."""
        self._require_open()
        handle = _stream_handle(stream, self.on_gpu)
        if self.on_gpu:
            _cuda(cudart.cudaEventRecord, self._raw, handle)

    def wait(self, stream) -> None:
        """Make `stream` wait (on the device, not the host) until this event fired."""
        self._require_open()
        handle = _stream_handle(stream, self.on_gpu)
        if self.on_gpu:
            _cuda(cudart.cudaStreamWaitEvent, handle, self._raw, 0)

    def query(self) -> bool:
        """Whether the recorded work finished; never blocks.
        NOTE: never call this while any stream is capturing: it invalidates the capture."""
        self._require_open()
        if not self.on_gpu:
            return True
        (err,) = cudart.cudaEventQuery(self._raw)
        if err == _NOT_READY:
            return False
        check(err, "cudaEventQuery")
        return True

    def synchronize(self) -> None:
        """Block the host until the event fired."""
        self._require_open()
        if self.on_gpu:
            _cuda(cudart.cudaEventSynchronize, self._raw)

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to `end`, both recorded with timing=True and fired."""
        self._require_open()
        end._require_open()
        if not (self.on_gpu and end.on_gpu):
            raise _no_gpu("Event.elapsed_ms()")
        if not (self.timing and end.timing):
            raise ValueError("elapsed_ms needs both events created with Event(timing=True)")
        return _cuda(cudart.cudaEventElapsedTime, self._raw, end._raw)


class _HostMemory:
    """Owner of one host allocation; every view keeps it alive, so freeing waits for them."""

    def __init__(self, nbytes: int, on_gpu: bool) -> None:
        self.nbytes = nbytes
        if on_gpu:
            self.host_ptr = int(_cuda(
                cudart.cudaHostAlloc, nbytes, cudart.cudaHostAllocMapped | cudart.cudaHostAllocPortable
            ))
            self._finalizer = weakref.finalize(self, _cuda, cudart.cudaFreeHost, self.host_ptr)
            self._finalizer.atexit = False
            # NOTE: on an H200 (unified addressing) the device pointer equals the host pointer.
            self.device_ptr = int(_cuda(cudart.cudaHostGetDevicePointer, self.host_ptr, 0))
        else:
            self._buffer = (ctypes.c_uint8 * nbytes)()
            self.host_ptr = self.device_ptr = ctypes.addressof(self._buffer)


class _CudaArray:
    """A bytes range of mapped memory exposed through __cuda_array_interface__; the tensor
    torch builds from it keeps this object, and through it the memory, alive."""

    def __init__(self, memory: _HostMemory, offset: int, nbytes: int) -> None:
        self._memory = memory
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",  # bytes; dtypes numpy cannot name (bfloat16) are a .view() away
            "data": (memory.device_ptr + offset, False),
            "version": 2,
        }


class PinnedRing(Closeable):
    """`nbytes` of page-locked, device-mapped host memory (cudaHostAlloc Mapped|Portable),
    allocated once, seen as CPU tensors (`host_view`) and CUDA tensors (`device_view`) over the
    same bytes, so captured kernels can write what the host reads.

    close() (or leaving `with`) frees the memory at once when no view is alive; views hold the
    memory, so while one lives the free waits for it and no view ever dangles. `released`
    tells whether the memory went back. In host mode the memory is ordinary and
    `device_view` returns the host view.

    NOTE: freeing (cudaFreeHost) during a capture invalidates it: keep the ring and its views
    alive across capture and replay, and close it only outside capture.
    """

    def __init__(self, nbytes: int, device=None) -> None:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 1:
            raise ValueError(f"PinnedRing nbytes must be a positive int, got {nbytes!r}")
        self.device = resolve_device(device)
        self.on_gpu = self.device.type == "cuda"
        self.nbytes = nbytes
        if self.on_gpu:
            _forbid_capture("PinnedRing")
            with torch.cuda.device(self.device):
                self._memory = _HostMemory(nbytes, on_gpu=True)
        else:
            self._memory = _HostMemory(nbytes, on_gpu=False)
        self._memory_ref = weakref.ref(self._memory)
        self.host_ptr = self._memory.host_ptr
        self.device_ptr = self._memory.device_ptr

    def close(self) -> None:
        self._memory = None  # freed now unless a view still holds it
        self._closed = True

    @property
    def released(self) -> bool:
        """True once the memory was freed: the ring is closed and no view is alive."""
        return self._memory_ref() is None

    def _byte_range(self, dtype: torch.dtype, shape, offset: int) -> tuple[tuple[int, ...], int]:
        self._require_open()
        shape = tuple(shape)
        numel = 1
        for d in shape:
            numel *= d
        itemsize = dtype.itemsize
        if numel < 1:
            raise ValueError(f"PinnedRing view shape {shape} is empty; ask for at least one element")
        if offset < 0 or offset % itemsize:
            raise ValueError(
                f"PinnedRing view offset {offset} must be >= 0 and a multiple of {dtype}'s size {itemsize}"
            )
        if offset + numel * itemsize > self.nbytes:
            raise ValueError(
                f"PinnedRing view of {shape} {dtype} at offset {offset} ends past the ring's "
                f"{self.nbytes} bytes; allocate a larger ring"
            )
        return shape, numel * itemsize

    def host_view(self, dtype: torch.dtype, shape, offset: int = 0) -> torch.Tensor:
        """A CPU tensor `[*shape]` of `dtype` over the ring's bytes at `offset`."""
        shape, nbytes = self._byte_range(dtype, shape, offset)
        window = (ctypes.c_uint8 * nbytes).from_address(self.host_ptr + offset)
        window.memory = self._memory  # the tensor holds `window`, which holds the memory
        return torch.frombuffer(window, dtype=dtype).view(shape)

    def device_view(self, dtype: torch.dtype, shape, offset: int = 0) -> torch.Tensor:
        """A tensor on the ring's device over the same bytes as `host_view` (the host view
        itself in host mode). Kernels writing it are visible to the host once they finished."""
        if not self.on_gpu:
            return self.host_view(dtype, shape, offset)
        shape, nbytes = self._byte_range(dtype, shape, offset)
        try:
            import numpy  # noqa: F401  torch parses __cuda_array_interface__ with numpy
        except ImportError:
            raise RuntimeError(
                "PinnedRing.device_view needs numpy (torch reads __cuda_array_interface__ "
                "through it): pip install numpy"
            ) from None
        raw = torch.as_tensor(_CudaArray(self._memory, offset, nbytes), device=self.device)
        return raw.view(dtype).view(shape)


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to `device` without waiting for the stream's queued work.

    NOTE: a copy from pageable memory first waits for the stream to drain (a host sync in an
    overlap loop); staging through pinned memory avoids it, and torch's pinned allocator keeps
    the block alive until the copy has run. On the CPU the tensor is returned as is.
    """
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
