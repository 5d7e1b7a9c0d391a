"""The loop's timing statistics keep bounded memory however long a server runs: every value
(exact percentiles) up to the sample cap, a uniform reservoir sample past it, and running
sums for the means."""

from __future__ import annotations

import random

from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.iteration.spans import prefill_span
from graphrelay.capture.model.model import ModelConfig
from graphrelay.capture.serving import loop_stats
from graphrelay.capture.serving.loop import ServingLoop
from graphrelay.capture.serving.loop_stats import Samples
from graphrelay.capture.serving.workloads import SyntheticWorkload


def test_samples_are_exact_up_to_the_cap():
    values = [random.Random(1).expovariate(1.0) for _ in range(999)]
    samples = Samples(cap=1000)
    for v in values:
        samples.add(v)
    ordered = sorted(values)
    # The ranks the summaries have always read: ordered[n // 2], ordered[min(n - 1, int(0.99 n))].
    assert samples.quantile(0.5) == ordered[len(ordered) // 2]
    assert samples.quantile(0.99) == ordered[int(0.99 * len(ordered))]
    assert abs(samples.mean() - sum(values) / len(values)) < 1e-12
    assert Samples().quantile(0.5) == 0.0 and Samples().mean() == 0.0


def test_past_the_cap_the_sample_stays_that_size_and_uniform():
    rng = random.Random(2)
    samples = Samples(cap=2000)
    n = 200_000
    for i in range(n):
        samples.add(i / n + rng.random() * 1e-9)  # a rising ramp: a sample biased to recent values would show it
    assert len(samples.kept) == 2000 and samples.count == n
    assert abs(samples.mean() - 0.5) < 1e-3  # the mean is a running sum: exact
    assert abs(samples.quantile(0.5) - 0.5) < 0.05
    assert samples.quantile(0.99) > 0.95


def test_a_long_serve_keeps_its_statistics_bounded(monkeypatch):
    """Thousands of iterations through one `serve` with a small cap: the clock holds at most
    the cap per figure, while counts and means still cover every iteration."""
    cap = 64
    monkeypatch.setattr(loop_stats, "SAMPLE_CAP", cap)
    model = ModelConfig.preset("tiny")
    engine = Engine(EngineConfig(model, max_reqs=3, max_batch=2, device="cpu", max_tokens=24, use_graphs=False,
                                 buckets=(24,)))
    engine.capture()
    requests = SyntheticWorkload(num_requests=120, prompt_len=(1, 4), output_len=(8, 24), vocab_size=model.vocab_size,
                                 seed=4).requests()
    loop = ServingLoop(engine, "overlap")
    stats = loop.run(requests).stats
    clock = loop._run.clock
    assert stats.iterations > 10 * cap
    assert clock.stored_values() <= 4 * cap + 8  # four sampled figures, plus at most the iterations in flight
    assert clock._sched_s.count == clock._interval_s.count + 1 == stats.iterations  # every iteration counted
    assert 0 < stats.iter_ms_median <= stats.iter_ms_p99 and 0 < stats.cpu_sched_us_median
    assert stats.tokens == sum(r.max_new_tokens for r in requests)


class _GpuClock:
    """The GPU's timeline in a test: a timing event is stamped with `now` when recorded (as a
    mark the GPU reaches at once would be)."""

    def __init__(self):
        self.now = 0.0


class _FakeEvent:
    def __init__(self, gpu: _GpuClock):
        self.gpu, self.stamp = gpu, None

    def record(self, stream) -> None:
        self.stamp = self.gpu.now

    def synchronize(self) -> None:
        pass

    def elapsed_ms(self, other: "_FakeEvent") -> float:
        return other.stamp - self.stamp


class _FakeGpuStream:
    on_gpu = True
    device = "cuda:0"


def _timed_clock(monkeypatch) -> tuple[loop_stats.IterationClock, _GpuClock]:
    gpu = _GpuClock()
    monkeypatch.setattr(loop_stats, "Event", lambda timing, device: _FakeEvent(gpu))
    clock = loop_stats.IterationClock(_FakeGpuStream())
    clock.begin()
    return clock, gpu


def _iteration(clock: loop_stats.IterationClock, gpu: _GpuClock, iteration: int, turn: float, launch: float,
               end: float) -> None:
    """One launching turn whose marks the GPU reaches at `turn`, `launch` and `end` (ms)."""
    gpu.now = turn
    clock.turn_start()
    clock.launch_start()
    gpu.now = launch
    clock.replay_start()
    gpu.now = end
    clock.launch_end(iteration)
    clock.iteration_done(iteration)
    clock.turn_end(True)


def test_the_gpu_waiting_for_a_slow_launch_is_idle_time_not_step_time(monkeypatch):
    """A host that stages an iteration after the GPU finished the one before leaves the GPU idle
    from the turn's mark to the launch mark: that wait counts as idle, and the step is the
    replay alone (launch -> end), as fast as a prompt host's."""
    clock, gpu = _timed_clock(monkeypatch)
    _iteration(clock, gpu, 0, turn=0.0, launch=0.5, end=1.5)  # waited 0.5 ms for its launch
    _iteration(clock, gpu, 1, turn=1.5, launch=1.5, end=2.5)  # launched while the GPU was busy
    _iteration(clock, gpu, 2, turn=3.0, launch=3.0, end=4.0)  # nothing queued for 0.5 ms before its turn
    clock.finish()
    stats = clock.stats("overlap", True, requests=1, tokens=3, syncs=0, tokens_per_request_step=1.0)
    assert stats.gpu_step_us_median == stats.gpu_step_us_per_iter == 1000.0
    # The span from the first turn to the last end is 4 ms: 0.5 ms waiting for a launch, 0.5 ms with nothing queued.
    assert abs(stats.gpu_launch_wait_fraction - 0.5 / 4.0) < 1e-12
    assert abs(stats.gpu_idle_fraction - 1.0 / 4.0) < 1e-12
    assert abs(stats.gpu_busy_us_per_iter - 1000 * 3.5 / 3) < 1e-9  # turn -> end, the wait included


def test_the_engine_calls_before_replay_once_its_inputs_are_queued(monkeypatch):
    """`Engine.launch` calls `before_replay` after the inputs' copy is queued and before the step
    runs, once per launch: the serving loop's launch mark sits between the two."""
    model = ModelConfig.preset("tiny")
    engine = Engine(EngineConfig(model, max_reqs=2, max_batch=2, device="cpu", max_tokens=16, use_graphs=False,
                                 buckets=(16,)))
    engine.capture()
    calls: list[str] = []
    load, run = engine.inputs.load, engine.runner.run
    monkeypatch.setattr(engine.inputs, "load", lambda *a, **k: (calls.append("load"), load(*a, **k))[1])
    monkeypatch.setattr(engine.runner, "run", lambda *a, **k: (calls.append("run"), run(*a, **k))[1])
    monkeypatch.setattr(loop_stats.IterationClock, "replay_start", lambda self: calls.append("mark"))
    requests = SyntheticWorkload(num_requests=3, prompt_len=(1, 4), output_len=(2, 4), vocab_size=model.vocab_size,
                                 seed=5).requests()
    stats = ServingLoop(engine, "overlap").run(requests).stats
    assert stats.iterations > 2 and calls == ["load", "mark", "run"] * stats.iterations
    calls.clear()
    engine.launch([prefill_span(1, SamplingParams(), [1, 2], 0, True)])  # no mark asked: none made
    assert calls == ["load", "run"]
