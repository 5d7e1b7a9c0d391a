"""What a serving run measures: iteration times on the host, GPU busy/idle time between
iterations from timing events, CPU scheduling time, and blocking waits.

GPU timing uses a small pool of cuda-python timing events, one set per in-flight iteration:
`turn` when the turn begins, `launch` once the engine has queued the iteration's inputs, just
before the step itself (`Engine.launch`'s `before_replay`), `end` right after it. The
iteration's GPU time is launch -> end: the step alone. The GPU sat idle from one iteration's
`end` to the next turn's `turn` mark, when nothing was queued, and from `turn` to `launch`
while the host scheduled and staged the iteration after the one before had finished (a mark
the GPU reaches late carries the host's time). Both count as idle; the second also holds the
inputs' copy and a fresh slot's relay reset, a few microseconds of GPU work. Sets are read
back with their iteration, so timing never adds a wait of its own.

Bounded memory: the HTTP server runs one `serve` for its whole life, so per-iteration figures
are kept as running sums plus a fixed-size sample (`Samples`) for the medians and p99, never as
a list per iteration. A run of up to `SAMPLE_CAP` iterations (every benchmark's) keeps every
value, so its percentiles are exact; past that, a uniform reservoir sample of the same size.

Honest about who sets the pace: the host time to launch an iteration is measured too. When an
iteration's GPU time is no longer than the host time spent launching it, the GPU was waiting
for the host inside that iteration (eager kernels launched one by one from Python):
`launch_bound_fraction` counts those iterations. A graph replay is queued whole, so a slow
host shows as the `turn` -> `launch` idle above instead (`gpu_launch_wait_fraction`).
"""

from __future__ import annotations

import random
import time
from array import array
from typing import Callable, Optional

import msgspec

from graphrelay.runtime import Event, Stream

_SETS = 8  # timing-event sets: more than the iterations ever in flight at once
_TURN, _LAUNCH, _END = 0, 1, 2
_PROGRESS_EVERY_S = 0.5
SAMPLE_CAP = 1 << 16  # values kept per figure: 512 KiB of doubles, exact for runs up to this many


class Samples:
    """Count, sum and a bounded sample of a stream of values: exact while at most `cap`
    have been added, then a uniform reservoir sample (Algorithm R, seeded: reproducible)."""

    __slots__ = ("cap", "count", "total", "kept", "_rng")

    def __init__(self, cap: Optional[int] = None):
        self.cap = SAMPLE_CAP if cap is None else cap
        self.count = 0
        self.total = 0.0
        self.kept = array("d")  # 8 bytes a value, not a Python float object's 32
        self._rng = random.Random(0)

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        if len(self.kept) < self.cap:
            self.kept.append(value)
            return
        replace = self._rng.randrange(self.count)
        if replace < self.cap:
            self.kept[replace] = value

    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def quantile(self, q: float) -> float:
        """The value at rank int(q * n) of the sorted sample (q = 0.5: the upper median), as
        the summaries have always read it; 0 when empty."""
        ordered = sorted(self.kept)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


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
    gpu_idle_fraction: Optional[float]  # GPU idle between and before iterations / total span, GPU only
    gpu_launch_wait_fraction: Optional[float]  # the part of that span the GPU waited for a turn's scheduling and launch
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
        self._launches_started = 0  # iterations whose launch began (the progress line's count)
        self._last_launch_turn: Optional[float] = None  # the last launching turn's start
        self._interval_s = Samples()  # launching turn start -> the next one
        self._busy_ms, self._busy_count = 0.0, 0  # turn mark -> end: prefills + the iteration, summed
        self._step_ms = Samples()  # launch -> end on the GPU: the iteration alone
        self._host_launch_s: dict[int, float] = {}  # iteration in flight -> host time to launch it
        self._launch_s = Samples()  # host launch times of iterations read back
        self._launch_bound = 0  # iterations read back whose GPU time <= host launch time
        self._gap_ms = 0.0  # GPU idle between consecutive iterations, summed
        self._launch_wait_ms = 0.0  # GPU idle from a turn's mark to its iteration's launch, summed
        self._sched_s = Samples()
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
            self._sched_s.add(time.perf_counter() - self._turn_t - self._turn_wait)

    def launch_start(self) -> None:
        # An iteration's interval is measured turn start to turn start, like its CPU time and
        # its GPU busy time.
        if self._last_launch_turn is not None:
            self._interval_s.add(self._turn_t - self._last_launch_turn)
        self._last_launch_turn = self._turn_t
        self._launches_started += 1
        self._launch_t = time.perf_counter()

    def replay_start(self) -> None:
        """The engine has queued the iteration's inputs; the step comes next (`Engine.launch`'s
        `before_replay`)."""
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
            self._launch_s.add(host_s)
        if which is None or not self.on_gpu:
            return
        marks = self._sets[which]
        marks[_END].synchronize()  # recorded just after the mirror's event, which fired: no real wait
        step_ms = marks[_LAUNCH].elapsed_ms(marks[_END])
        self._step_ms.add(step_ms)
        self._launch_bound += host_s is not None and step_ms <= host_s * 1e3
        self._busy_ms += marks[_TURN].elapsed_ms(marks[_END])
        self._launch_wait_ms += marks[_TURN].elapsed_ms(marks[_LAUNCH])
        self._busy_count += 1
        if self._last_done is not None and self._last_done == (which - 1) % _SETS:
            previous_end = self._sets[self._last_done][_END]
            self._gap_ms += max(0.0, previous_end.elapsed_ms(marks[_TURN]))
        self._last_done = which

    def finish(self) -> None:
        self._wall = time.perf_counter() - self._t0

    def report(self, progress: Callable[[dict], None], running: int, done: int, pending: int) -> None:
        now = time.perf_counter()
        if now - self._last_progress >= _PROGRESS_EVERY_S:
            self._last_progress = now
            progress({"iterations": self._launches_started, "running": running, "done": done, "pending": pending, "elapsed_s": now - self._t0})

    def stats(self, mode: str, graphs: bool, requests: int, tokens: int, syncs: int,
              tokens_per_request_step: float) -> LoopStats:
        iters = max(1, self._launches_started)
        interval, sched, step, busy = self._interval_s, self._sched_s, self._step_ms, self._busy_ms
        measured_gpu = self._busy_count > 0
        return LoopStats(
            mode=mode,
            device=str(self.stream.device),
            graphs=graphs,
            requests=requests,
            tokens=tokens,
            iterations=self._launches_started,
            wall_s=self._wall,
            tokens_per_s=tokens / self._wall if self._wall > 0 else 0.0,
            iter_ms_mean=interval.mean() * 1e3,
            iter_ms_median=interval.quantile(0.5) * 1e3,
            iter_ms_p99=interval.quantile(0.99) * 1e3,
            cpu_sched_us_per_iter=sched.mean() * 1e6,
            cpu_sched_us_median=sched.quantile(0.5) * 1e6,
            gpu_step_us_per_iter=step.mean() * 1e3 if step.count else None,
            gpu_step_us_median=step.quantile(0.5) * 1e3 if step.count else None,
            gpu_busy_us_per_iter=busy / self._busy_count * 1e3 if measured_gpu else None,
            # busy (turn -> end) holds the launch wait; the idle figure adds it to the gaps.
            gpu_idle_fraction=(self._gap_ms + self._launch_wait_ms) / (self._gap_ms + busy) if measured_gpu else None,
            gpu_launch_wait_fraction=self._launch_wait_ms / (self._gap_ms + busy) if measured_gpu else None,
            host_launch_us_median=self._launch_s.quantile(0.5) * 1e6,
            launch_bound_fraction=self._launch_bound / step.count if step.count else None,
            host_syncs=syncs,
            host_syncs_per_iter=syncs / iters,
            event_waits_per_iter=self._waits / iters,
            tokens_per_request_step=tokens_per_request_step,
        )

    def stored_values(self) -> int:
        """Values held for the figures: bounded by a few `SAMPLE_CAP`s plus the iterations in
        flight, however long the run (the server's memory must stay flat)."""
        kept = sum(len(s.kept) for s in (self._interval_s, self._step_ms, self._launch_s, self._sched_s))
        return kept + len(self._host_launch_s) + len(self._sets_of)
