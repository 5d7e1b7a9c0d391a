"""CPU tests of the runtime layer: the no-driver path, error checking, and host-mode objects."""

import gc

import pytest
import torch
from cuda.bindings import runtime as cudart

from graphrelay import runtime
from graphrelay.runtime import Event, PinnedRing, Stream


@pytest.fixture
def no_driver(monkeypatch):
    """Pretend the CUDA driver is missing, as on a CPU-only machine (and restore afterwards)."""
    runtime._driver_status.cache_clear()
    monkeypatch.setattr(
        cudart, "cudaGetDeviceCount", lambda: (cudart.cudaError_t.cudaErrorInsufficientDriver, 0)
    )
    yield
    runtime._driver_status.cache_clear()


def test_cuda_available_agrees_with_torch():
    # On this CPU machine both are False: the real no-driver path, not a mock.
    assert runtime.cuda_available() == torch.cuda.is_available()


def test_without_driver_everything_defaults_to_host_mode(no_driver):
    assert runtime.cuda_available() is False
    assert runtime.resolve_device(None) == torch.device("cpu")
    for obj in (Stream(), Event(), PinnedRing(64)):
        assert obj.device == torch.device("cpu") and obj.on_gpu is False


@pytest.mark.parametrize("make", [Stream, Event, lambda device: PinnedRing(64, device=device)])
def test_asking_for_cuda_without_a_gpu_says_so(no_driver, make):
    with pytest.raises(RuntimeError, match="no GPU.*cudaErrorInsufficientDriver.*device='cpu'"):
        make(device="cuda")


def test_resolve_device_rejects_other_device_types():
    with pytest.raises(ValueError, match="'cuda\\[:n\\]' or 'cpu'"):
        runtime.resolve_device("meta")


def test_check_names_the_call_and_the_cuda_error():
    runtime.check(cudart.cudaError_t.cudaSuccess, "cudaNothing")  # success: no error
    with pytest.raises(RuntimeError) as info:
        runtime.check(cudart.cudaError_t.cudaErrorInsufficientDriver, "cudaStreamCreateWithFlags")
    message = str(info.value)
    assert message.startswith("cudaStreamCreateWithFlags failed: cudaErrorInsufficientDriver: ")
    assert "CUDA driver version is insufficient" in message
    with pytest.raises(RuntimeError, match="cudaEventQuery failed: cudaErrorNotReady"):
        runtime.check(600, "cudaEventQuery")  # raw ints are accepted too


def test_a_failing_call_raises_through_the_checked_wrapper():
    # Fails on every machine: no driver here, no such device on a GPU machine.
    with pytest.raises(RuntimeError, match="cudaSetDevice failed: cudaError"):
        runtime._cuda(cudart.cudaSetDevice, 100_000)


def test_host_stream_is_synchronous_and_has_no_torch_stream():
    stream = Stream("cpu")
    assert stream.handle == 0
    stream.synchronize()
    with pytest.raises(RuntimeError, match="no GPU"):
        stream.as_torch()
    with stream:
        pass
    assert stream.closed
    with pytest.raises(RuntimeError, match="Stream is closed"):
        stream.synchronize()


def test_host_event_is_always_fired_and_takes_any_stream_kind():
    event = Event(device="cpu")
    for stream in (Stream("cpu"), 0, 12345):
        event.record(stream)
        event.wait(stream)
    assert event.query() is True
    event.synchronize()
    with pytest.raises(TypeError, match="graphrelay Stream, a torch.cuda.Stream or a raw"):
        event.record("stream")
    with pytest.raises(TypeError):
        event.wait(True)  # a bool is not a handle
    closed = Stream("cpu")
    closed.close()
    with pytest.raises(RuntimeError, match="closed"):
        event.record(closed)
    event.close()
    with pytest.raises(RuntimeError, match="Event is closed"):
        event.query()


def test_timing_is_gpu_only():
    start, end = Event(timing=True, device="cpu"), Event(timing=True, device="cpu")
    start.record(0)
    end.record(0)
    with pytest.raises(RuntimeError, match="no GPU: Event.elapsed_ms"):
        start.elapsed_ms(end)


def test_host_ring_views_alias_the_same_bytes():
    ring = PinnedRing(256, device="cpu")
    words = ring.host_view(torch.int32, (4, 4), offset=64)
    words.copy_(torch.arange(16, dtype=torch.int32).view(4, 4))
    # the "device" view of a host-mode ring is host memory over the same bytes
    assert torch.equal(ring.device_view(torch.int32, (16,), offset=64), torch.arange(16, dtype=torch.int32))
    raw = ring.host_view(torch.uint8, (8,), offset=64)
    assert raw.tolist() == [0, 0, 0, 0, 1, 0, 0, 0]  # little-endian int32 0 and 1
    raw[0] = 7
    assert int(words[0, 0]) == 7
    halves = ring.host_view(torch.bfloat16, (2,), offset=0)
    halves.fill_(1.5)
    assert ring.host_view(torch.int16, (2,)).tolist() == [0x3FC0, 0x3FC0]


@pytest.mark.parametrize(
    "dtype, shape, offset, match",
    [
        (torch.int32, (4,), 2, "multiple of"),
        (torch.int64, (4,), -8, ">= 0"),
        (torch.int64, (5,), 32, "ends past"),
        (torch.int32, (0,), 0, "empty"),
    ],
)
def test_bad_views_are_rejected(dtype, shape, offset, match):
    ring = PinnedRing(64, device="cpu")
    with pytest.raises(ValueError, match=match):
        ring.host_view(dtype, shape, offset)


@pytest.mark.parametrize("nbytes", [0, -1, 1.5, True])
def test_bad_ring_size_is_rejected(nbytes):
    with pytest.raises(ValueError, match="positive int"):
        PinnedRing(nbytes, device="cpu")


def test_ring_close_frees_at_once_without_views():
    with PinnedRing(128, device="cpu") as ring:
        assert not ring.released
    assert ring.released
    with pytest.raises(RuntimeError, match="PinnedRing is closed"):
        ring.host_view(torch.uint8, (1,))


def test_ring_close_waits_for_live_views():
    ring = PinnedRing(128, device="cpu")
    view = ring.host_view(torch.int64, (16,))
    column = view[::2]  # a derived view holds the memory too
    del view
    ring.close()
    gc.collect()
    assert not ring.released  # freeing now would leave `column` dangling
    column.fill_(3)
    assert column.sum().item() == 24
    del column
    gc.collect()
    assert ring.released


def test_ring_views_keep_the_ring_alive_after_the_ring_object_dies():
    view = PinnedRing(64, device="cpu").host_view(torch.int64, (8,))
    gc.collect()
    view.fill_(5)
    assert view.tolist() == [5] * 8
