"""Timing: eager loops and graph replays measured with CUDA events, and the two ceilings.

Every measurement is `repeats` timed loops, reported as the median (with min and max, so the
spread is visible) per iteration. On a GPU the clock is a pair of CUDA events on one cached
stream around the whole loop: for eager code that is the launch-bound wall time an engine
pays; for a graph it is the GPU time of back-to-back replays. On CPU (smoke runs only) a host
clock stands in, so the code paths run; those numbers mean nothing.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import msgspec
import torch

from graphrelay.capture.iteration.graph_runner import GraphRunner

Step = Callable[[int], None]  # step(k): the k-th iteration of a loop

# Eager warm-up calls before timing: Triton compiles and the allocator settles on the first.
EAGER_WARMUP = 3


class Sample(msgspec.Struct, frozen=True):
    """Microseconds per iteration over the timed loops."""

    median_us: float
    min_us: float
    max_us: float


class Ceilings(msgspec.Struct, frozen=True):
    """What the device can do at best, measured in this run."""

    copy_bytes: int  # bytes read + written by the timed copy
    copy_bandwidth: float  # bytes/s, read + write
    kernel_node_us: float  # GPU time of one tiny kernel node inside a graph


class Clock:
    """Elapsed microseconds of `run()`: CUDA events on the device's stream, else the host clock."""

    def __init__(self, device: torch.device):
        self.device = device
        # NOTE: torch.cuda.current_stream() costs ~4.5 µs per call: look it up once.
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        if self.stream is not None:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def elapsed_us(self, run: Callable[[], None]) -> float:
        if self.stream is None:
            start = time.perf_counter()
            run()
            return (time.perf_counter() - start) * 1e6
        self._start.record(self.stream)
        run()
        self._end.record(self.stream)
        self._end.synchronize()
        return self._start.elapsed_time(self._end) * 1e3

    def sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


def _sample(clock: Clock, run: Callable[[], None], per_run: int, repeats: int) -> Sample:
    times = [clock.elapsed_us(run) / per_run for _ in range(repeats)]
    return Sample(statistics.median(times), min(times), max(times))


def time_eager(clock: Clock, step: Step, iters: int, repeats: int) -> Sample:
    """step(0..iters-1) launched from Python, `repeats` times: µs per iteration."""
    for k in range(EAGER_WARMUP):
        step(k)
    clock.sync()

    def loop() -> None:
        for k in range(iters):
            step(k)

    return _sample(clock, loop, iters, repeats)


def capture_steps(device: torch.device, step: Step, count: int) -> Callable[[], None]:
    """step(0..count-1) as one replayable callable: a CUDA graph's replay on a GPU, the plain
    loop on CPU. The graph (and its memory pool) lives as long as the returned callable."""

    def body(_bs: int) -> None:
        for k in range(count):
            step(k)

    # GraphRunner warms up on a side stream (Triton compiles there, and any host sync in the
    # body raises) before capturing; on CPU it captures nothing and we call the body.
    runner = GraphRunner(body, [1], max_batch=1, device=device)
    runner.capture()
    graph = runner.graph(1)
    return graph.replay if graph is not None else (lambda: body(1))


def time_captured(clock: Clock, step: Step, per_graph: int, replays: int, repeats: int) -> Sample:
    """Capture step(0..per_graph-1) as one graph, replay it `replays` times per timed loop:
    GPU µs per iteration.

    Why several iterations per graph: one replay costs ~4.7 µs of host time, more than the
    GPU time of one relay iteration, so back-to-back replays of a one-iteration graph would
    time the host. Inside one graph the nodes run back to back, as they would inside a whole
    captured decode step. Without CUDA (smoke) the body runs eagerly instead.
    """
    replay = capture_steps(clock.device, step, per_graph)
    replay()  # the first launch uploads the graph: keep it out of the numbers
    clock.sync()

    def loop() -> None:
        for _ in range(replays):
            replay()

    return _sample(clock, loop, replays * per_graph, repeats)


def measure_ceilings(clock: Clock, copy_bytes: int, per_graph: int, replays: int, repeats: int) -> Ceilings:
    """Device-to-device copy bandwidth (read + write bytes) and one tiny kernel node's GPU time."""
    src = torch.randint(0, 256, (copy_bytes,), dtype=torch.uint8, device=clock.device)
    dst = torch.empty_like(src)
    copy = time_eager(clock, lambda _k: dst.copy_(src), iters=10, repeats=repeats)
    del src, dst
    counter = torch.zeros(1, dtype=torch.int32, device=clock.device)
    node = time_captured(clock, lambda _k: counter.add_(1), per_graph, replays, repeats)
    return Ceilings(
        copy_bytes=2 * copy_bytes,
        copy_bandwidth=2 * copy_bytes / (copy.median_us * 1e-6),
        kernel_node_us=node.median_us,
    )
