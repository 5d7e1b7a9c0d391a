"""The loop's timing statistics keep bounded memory however long a server runs: every value
(exact percentiles) up to the sample cap, a uniform reservoir sample past it, and running
sums for the means."""

from __future__ import annotations

import random

from graphrelay.capture.iteration.engine import Engine, EngineConfig
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
