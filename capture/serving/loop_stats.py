"""What a serving run measures: iteration times on the host, GPU busy/idle time between
iterations from timing events, CPU scheduling time, and blocking waits.

GPU timing uses a small pool of cuda-python timing events, one set per in-flight iteration:
`turn` when the turn begins, `launch` just before the iteration's inputs are copied in, `end`
right after its launch. The iteration's GPU time is launch -> end; the GPU sat idle from one
iteration's `end` to the next turn's `turn` mark, when nothing was queued. Sets are read back
with their iteration, so timing never adds a wait of its own.

Honest about who sets the pace: the host time from `launch` to `end` is measured too. When an
iteration's GPU time is no longer than the host time spent launching it, the GPU was waiting
for the host inside that iteration (eager kernels launched one by one from Python), which idle
time between iterations cannot show: `launch_bound_fraction` counts those iterations.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import msgspec

from graphrelay.runtime import Event, Stream

_SETS = 8  # timing-event sets: more than the iterations ever in flight at once
_TURN, _LAUNCH, _END = 0, 1, 2
_PROGRESS_EVERY_S = 0.5


class LoopStats(msgspec.Struct):
    mode: str
    device: str
    graphs: bool
    requests: int
    tokens: int
    iterations: int
    wall_s: float
    tokens_per_s: float
    iter_ms_mean: float  # host time from one launching turn's start to the next
    iter_ms_median: float
    iter_ms_p99: float
    cpu_sched_us_per_iter: float  # host time per launching turn not spent waiting for the device
    cpu_sched_us_median: float
    gpu_step_us_per_iter: Optional[float]  # GPU time of one iteration (graph or eager), GPU only
    gpu_step_us_median: Optional[float]
    gpu_busy_us_per_iter: Optional[float]  # GPU time per iteration from its turn's start
    gpu_idle_fraction: Optional[float]  # GPU idle between iterations / total span, GPU only
    host_launch_us_median: float  # host time to stage and launch one iteration
    launch_bound_fraction: Optional[float]  # iterations whose GPU time <= their host launch time
    host_syncs: int  # synchronizing torch ops over the run (counted by torch's sync debug mode)
    host_syncs_per_iter: float
    event_waits_per_iter: float  # blocking waits for an iteration's results
    tokens_per_request_step: float  # tokens a request gains per decode iteration: 1, or the
    # mean accepted length (accepted drafts + 1) with speculative decoding


class IterationClock:
    """Times a serving loop's turns from the host and, on a GPU, with events recorded on
    `stream`: the one stream every iteration runs on (the engine's)."""

    def __init__(self, stream: Stream):
        self.stream = stream
        self.on_gpu = stream.on_gpu
        if self.on_gpu:
            self._sets = [[Event(timing=True, device=stream.device) for _ in range(3)] for _ in range(_SETS)]
        self._launch_times: list[float] = []
        self._busy_ms: list[float] = []  # turn mark -> end: prefills + the iteration
        self._step_ms: list[float] = []  # launch -> end on the GPU: the iteration alone
        self._host_launch_s: dict[int, float] = {}  # iteration in flight -> host time to launch it
        self._launch_s: list[float] = []  # host launch times of iterations read back
        self._launch_bound = 0  # iterations read back whose GPU time <= host launch time
        self._gap_ms: list[float] = []
        self._sched_s: list[float] = []
        self._wait_s = 0.0
        self._waits = 0
        self._last_done: Optional[int] = None  # timing set of the last decode iteration read back
        self._sets_of: dict[int, int] = {}  # decode iteration -> its timing set
        self._launches = 0
        self._last_progress = 0.0

    def begin(self) -> None:
        self._t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def turn_start(self) -> None:
        self._turn_t = time.perf_counter()
        self._turn_wait = 0.0
        if self.on_gpu:
            # Re-recorded every turn until a decode launch claims the set.
            self._mark(self._launches % _SETS, _TURN)

    def turn_end(self, launched: bool) -> None:
        # Only turns that launched count: the drain at the end schedules nothing.
        if launched:
            self._sched_s.append(time.perf_counter() - self._turn_t - self._turn_wait)

    def launch_start(self) -> None:
        # An iteration's interval is measured turn start to turn start, like its CPU time and
        # its GPU busy time.
        self._launch_times.append(self._turn_t)
        self._launch_t = time.perf_counter()
        if self.on_gpu:
            self._mark(self._launches % _SETS, _LAUNCH)

    def launch_end(self, iteration: int) -> None:
        self._host_launch_s[iteration] = time.perf_counter() - self._launch_t
        self._sets_of[iteration] = self._launches % _SETS
        if self.on_gpu:
            self._mark(self._sets_of[iteration], _END)
        self._launches += 1

    def _mark(self, which_set: int, which: int) -> None:
        self._sets[which_set][which].record(self.stream)

    def wait(self, fn):
        """Run a blocking `fn`, counting it as a wait for the device."""
        start = time.perf_counter()
        try:
            return fn()
        finally:
            spent = time.perf_counter() - start
            self._turn_wait += spent
            self._wait_s += spent
            self._waits += 1

    def iteration_done(self, iteration: int) -> None:
        """Read back an iteration's timing."""
        which = self._sets_of.pop(iteration, None)
        host_s = self._host_launch_s.pop(iteration, None)
        if host_s is not None:
            self._launch_s.append(host_s)
        if which is None or not self.on_gpu:
            return
        marks = self._sets[which]
        marks[_END].synchronize()  # recorded just after the mirror's event, which fired: no real wait
        step_ms = marks[_LAUNCH].elapsed_ms(marks[_END])
        self._step_ms.append(step_ms)
        self._launch_bound += host_s is not None and step_ms <= host_s * 1e3
        self._busy_ms.append(marks[_TURN].elapsed_ms(marks[_END]))
        if self._last_done is not None and self._last_done == (which - 1) % _SETS:
            previous_end = self._sets[self._last_done][_END]
            self._gap_ms.append(max(0.0, previous_end.elapsed_ms(marks[_TURN])))
        self._last_done = which

    def finish(self) -> None:
        self._wall = time.perf_counter() - self._t0

    def report(self, progress: Callable[[dict], None], running: int, done: int, pending: int) -> None:
        now = time.perf_counter()
        if now - self._last_progress >= _PROGRESS_EVERY_S:
            self._last_progress = now
            progress({"iterations": len(self._launch_times), "running": running, "done": done, "pending": pending, "elapsed_s": now - self._t0})

    def stats(self, mode: str, graphs: bool, requests: int, tokens: int, syncs: int,
              tokens_per_request_step: float) -> LoopStats:
        iters = max(1, len(self._launch_times))
        gaps = [b - a for a, b in zip(self._launch_times, self._launch_times[1:])]
        gaps_ms = sorted(g * 1e3 for g in gaps) or [0.0]
        busy = sum(self._busy_ms)
        step_us = sorted(ms * 1e3 for ms in self._step_ms)
        return LoopStats(
            mode=mode,
            device=str(self.stream.device),
            graphs=graphs,
            requests=requests,
            tokens=tokens,
            iterations=len(self._launch_times),
            wall_s=self._wall,
            tokens_per_s=tokens / self._wall if self._wall > 0 else 0.0,
            iter_ms_mean=sum(gaps_ms) / len(gaps_ms),
            iter_ms_median=_median(gaps_ms),
            iter_ms_p99=gaps_ms[min(len(gaps_ms) - 1, int(0.99 * len(gaps_ms)))],
            cpu_sched_us_per_iter=sum(self._sched_s) / max(1, len(self._sched_s)) * 1e6,
            cpu_sched_us_median=_median(self._sched_s) * 1e6,
            gpu_step_us_per_iter=sum(step_us) / len(step_us) if step_us else None,
            gpu_step_us_median=_median(step_us) if step_us else None,
            gpu_busy_us_per_iter=busy / len(self._busy_ms) * 1e3 if self._busy_ms else None,
            gpu_idle_fraction=(sum(self._gap_ms) / (sum(self._gap_ms) + busy)) if self._busy_ms else None,
            host_launch_us_median=_median(self._launch_s) * 1e6,
            launch_bound_fraction=self._launch_bound / len(self._step_ms) if self._step_ms else None,
            host_syncs=syncs,
            host_syncs_per_iter=syncs / iters,
            event_waits_per_iter=self._waits / iters,
            tokens_per_request_step=tokens_per_request_step,
        )


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0
