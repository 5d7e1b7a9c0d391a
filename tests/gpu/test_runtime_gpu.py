"""GPU tests of the runtime layer: real events and streams ordering torch work, mapped pinned
memory seen from both sides, and the ban on creating CUDA objects during capture."""

import pytest
import torch

from graphrelay import runtime
from graphrelay.runtime import Event, PinnedRing, Stream

pytestmark = pytest.mark.gpu

LONG_SLEEP = 200_000_000  # GPU cycles (~0.1 s): long enough that the host sees work pending


def test_gpu_objects_are_real():
    assert runtime.cuda_available()
    with Stream() as stream, Event() as event:
        assert stream.on_gpu and event.on_gpu and stream.handle != 0
        assert stream.as_torch().cuda_stream == stream.handle
        assert stream.as_torch() is stream.as_torch()  # made once, then cached


def test_query_never_blocks_and_synchronize_does():
    stream, event = Stream(), Event()
    with torch.cuda.stream(stream.as_torch()):
        torch.cuda._sleep(LONG_SLEEP)
    event.record(stream)
    assert event.query() is False  # the sleep is still running: not fired, and we did not wait
    event.synchronize()
    assert event.query() is True


def test_events_order_torch_work_across_two_streams():
    producer = Stream()
    consumer = Stream.from_torch(torch.cuda.Stream())  # interop the other way: torch -> ours
    src = torch.zeros(1 << 20, device="cuda")
    out = torch.empty_like(src)
    torch.cuda.synchronize()
    done = Event()
    with torch.cuda.stream(producer.as_torch()):
        torch.cuda._sleep(LONG_SLEEP)  # without the wait below, the consumer would read zeros
        src.fill_(3.0)
    done.record(producer)
    done.wait(consumer.handle)  # a raw cudaStream_t int works too
    with torch.cuda.stream(consumer.as_torch()):
        torch.mul(src, 2, out=out)
    consumer.synchronize()
    assert torch.all(out == 6.0)


def test_an_event_recorded_on_a_torch_stream_fences_our_stream():
    ours = Stream()
    data = torch.zeros(1 << 16, device="cuda", dtype=torch.int32)
    torch.cuda.synchronize()
    ready = Event()
    torch_stream = torch.cuda.current_stream()
    torch.cuda._sleep(LONG_SLEEP)
    data.fill_(7)
    ready.record(torch_stream)  # a torch.cuda.Stream object
    ready.wait(ours)
    with torch.cuda.stream(ours.as_torch()):
        total = data.sum()
    ours.synchronize()
    assert int(total) == 7 * (1 << 16)


def test_timing_events_measure_elapsed_time():
    stream = Stream()
    start, end = Event(timing=True), Event(timing=True)
    start.record(stream)
    with torch.cuda.stream(stream.as_torch()):
        torch.cuda._sleep(LONG_SLEEP // 10)
    end.record(stream)
    end.synchronize()
    assert start.elapsed_ms(end) > 0.0
    with pytest.raises(ValueError, match="timing=True"):
        Event().elapsed_ms(end)


def test_closing_a_wrapped_torch_stream_does_not_destroy_it():
    torch_stream = torch.cuda.Stream()
    Stream.from_torch(torch_stream).close()
    with torch.cuda.stream(torch_stream):
        x = torch.ones(8, device="cuda") * 2
    torch_stream.synchronize()
    assert x.sum().item() == 16.0


def test_creating_cuda_objects_during_capture_raises():
    runtime.cuda_available()  # driver query done before capture
    x = torch.zeros(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
        for make in (Event, Stream, lambda: PinnedRing(64)):
            with pytest.raises(RuntimeError, match="capturing a CUDA graph.*before capture"):
                make()
    graph.replay()  # the capture stayed valid
    torch.cuda.synchronize()
    assert x.tolist() == [1.0] * 4


def test_pinned_ring_host_and_device_views_alias_the_same_bytes():
    ring = PinnedRing(4096)
    host = ring.host_view(torch.int32, (256,), offset=512)
    dev = ring.device_view(torch.int32, (256,), offset=512)
    assert dev.is_cuda and not host.is_cuda
    assert dev.data_ptr() == ring.device_ptr + 512 and host.data_ptr() == ring.host_ptr + 512
    print(f"mapped device pointer equals host pointer: {ring.device_ptr == ring.host_ptr}")

    host.copy_(torch.arange(256, dtype=torch.int32))
    assert torch.equal(dev.cpu(), torch.arange(256, dtype=torch.int32))  # device reads host writes
    dev.mul_(3)  # a kernel writing mapped memory
    torch.cuda.synchronize()
    assert torch.equal(host, torch.arange(256, dtype=torch.int32) * 3)  # host reads device writes

    halves = ring.device_view(torch.bfloat16, (4,), offset=0)  # a dtype numpy cannot name
    halves.fill_(1.5)
    torch.cuda.synchronize()
    assert ring.host_view(torch.int16, (4,)).tolist() == [0x3FC0] * 4


def test_pinned_ring_is_freed_at_close_and_after_its_last_view():
    ring = PinnedRing(1 << 20)
    view = ring.device_view(torch.uint8, (16,))
    ring.close()
    assert not ring.released
    view.fill_(1)
    torch.cuda.synchronize()
    del view
    assert ring.released
    with PinnedRing(1 << 20) as other:
        pass
    assert other.released
