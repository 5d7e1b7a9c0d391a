"""Bucket policy and the graph runner on the CPU, where it runs the step eagerly at the padded
bucket size: the shapes a GPU replay would see, without a GPU."""

from __future__ import annotations

import warnings

import pytest

from graphrelay.capture.iteration.buckets import bucket_for, check_buckets, default_buckets
from graphrelay.capture.iteration.graph_runner import GraphRunner


class RecordingStep:
    """A step function that remembers the sizes it was called with."""

    def __init__(self):
        self.calls: list[int] = []

    def __call__(self, bs: int) -> None:
        self.calls.append(bs)


# ---- buckets ----------------------------------------------------------------------------------


@pytest.mark.parametrize("max_tokens", [1, 5, 32, 100, 256, 2048, 5000])
def test_default_buckets_shape(max_tokens):
    """Dense up to 32 tokens, every 16 up to 256, then coarser, max_tokens always last, and
    padding never more than a quarter of a bucket above 32. If this failed, small iterations
    would pay for heavy padding or large ones would have no graph."""
    buckets = default_buckets(max_tokens)
    assert buckets == sorted(set(buckets))
    assert buckets[0] == 1 and buckets[-1] == max_tokens
    small = [b for b in buckets if b <= 32]
    assert small == [b for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if b < max_tokens] + ([max_tokens] if max_tokens <= 32 else [])
    for below, above in zip(buckets, buckets[1:]):
        if below >= 32:
            assert above - below <= max(16, above // 4), f"{below} -> {above} too coarse: {buckets}"
    assert all(b - a == 16 for a, b in zip(buckets, buckets[1:]) if 32 <= a and b <= 256 and b != max_tokens)


def test_default_buckets_for_2048():
    assert default_buckets(2048) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, *range(48, 257, 16), *range(320, 513, 64),
                                     *range(640, 1025, 128), *range(1280, 2049, 256)]


def test_default_buckets_rejects_nonpositive():
    with pytest.raises(ValueError, match="max_tokens"):
        default_buckets(0)


@pytest.mark.parametrize("bs, expected", [(0, 1), (1, 1), (5, 6), (6, 6), (7, 8), (16, 16), (17, None)])
def test_bucket_for(bs, expected):
    """The smallest bucket that fits, None above the largest; an empty batch takes the
    smallest bucket (a bucket of padding). If this failed, a batch would replay a graph too
    small for it (dropped requests) or needlessly large."""
    assert bucket_for([1, 2, 4, 6, 8, 16], bs) == expected


def test_check_buckets_sorts_and_dedups():
    assert check_buckets([8, 1, 4, 4, 2], 8) == [1, 2, 4, 8]


@pytest.mark.parametrize("buckets, match", [([], "empty"), ([0, 4], "bucket 0"), ([4, 9], "bucket 9"),
                                            ([2.0], "bucket 2.0")])
def test_check_buckets_errors(buckets, match):
    """Bad bucket lists fail at construction with the offending value. If this failed, a bad
    bucket would only show up as an index error in the middle of capture."""
    with pytest.raises(ValueError, match=match):
        check_buckets(buckets, 8)


# ---- the runner on the CPU ------------------------------------------------------------------


def test_cpu_runner_captures_nothing():
    """On the CPU there are no graphs and capture is a no-op that still reports."""
    step = RecordingStep()
    runner = GraphRunner(step, [4, 1, 2], 4, "cpu")
    assert not runner.use_graphs
    report = runner.capture()
    assert report.buckets == [1, 2, 4] and report.graph_memory_bytes == 0
    assert runner.graphs == {} and step.calls == []


def test_run_pads_to_the_bucket():
    """A batch runs the step at its bucket size and reports it. If this failed, eager mode
    would see shapes the graphs never do, and eager-vs-graph comparisons would be moot."""
    step = RecordingStep()
    runner = GraphRunner(step, [1, 2, 4, 8], 8, "cpu")
    runner.capture()
    assert [runner.run(bs) for bs in (1, 3, 4, 5, 8, 0)] == [1, 4, 4, 8, 8, 1]
    assert step.calls == [1, 4, 4, 8, 8, 1]
    assert runner.bucket(3) == 4 and runner.bucket(9) is None


def test_oversized_batch_warns_once_and_runs_eagerly():
    """Above the largest bucket the step runs at the batch's own size, warning only the first
    time. If this failed, an engine would crash on a burst, or flood its log every step."""
    step = RecordingStep()
    runner = GraphRunner(step, [1, 2, 4], 8, "cpu")
    with pytest.warns(UserWarning, match="batch of 6 exceeds the largest bucket 4"):
        assert runner.run(6) == 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert runner.run(8) == 8
        assert runner.run(3) == 4
    assert step.calls == [6, 8, 4]


def test_oversized_batch_raises_when_strict():
    """strict=True turns the fallback into a ValueError before the step runs."""
    step = RecordingStep()
    runner = GraphRunner(step, [1, 2, 4], 8, "cpu", strict=True)
    with pytest.raises(ValueError, match="exceeds the largest bucket 4"):
        runner.run(5)
    assert step.calls == []
    assert runner.run(4) == 4


def test_runner_rejects_bad_buckets():
    with pytest.raises(ValueError, match="max_tokens"):
        GraphRunner(RecordingStep(), [1, 16], 8, "cpu")


class VariantStep:
    """A step taking a variant, remembering (size, variant) per call."""

    def __init__(self):
        self.calls: list[tuple[int, str]] = []

    def __call__(self, bs: int, variant: str) -> None:
        self.calls.append((bs, variant))


def test_named_variants_run_the_one_asked_for_and_default_to_the_last():
    """A runner over named variants hands the step the variant of each run (the last when none
    is named) and refuses one it did not capture, before the step runs. If this failed, the
    engine's choice of a plain or controlled iteration would not reach the step."""
    step = VariantStep()
    runner = GraphRunner(step, [1, 4], 4, "cpu", variants=("plain", "controls"))
    runner.capture()
    assert runner.run(3, "plain") == 4 and runner.run(1, "controls") == 1 and runner.run(2) == 4
    with pytest.raises(ValueError, match="'spec' is not one of the captured"):
        runner.run(1, "spec")
    assert step.calls == [(4, "plain"), (1, "controls"), (4, "controls")]
