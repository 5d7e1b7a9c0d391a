"""`graphrelay bench iteration`: the smoke run times every shape and, with --profile, breaks each
decode shape down by what the device ran; the breakdown's arithmetic."""

from __future__ import annotations

import json

import pytest
import torch

from graphrelay.tools.bench import bench_main
from graphrelay.tools.bench.iteration import DECODES, LONG_DECODES, PROMPTS, long_decode_shape
from graphrelay.tools.bench.kernel_profile import breakdown, format_breakdown


def test_smoke_with_profile_writes_every_shape_and_a_breakdown_per_decode_shape(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path, even on a GPU host
    assert bench_main(["iteration", "--smoke", "--profile", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "iteration_bench.json").read_text())
    shapes = [r["shape"] for r in report["rows"]]
    assert shapes[: len(PROMPTS)] == list(PROMPTS) and [f"decode {n}" for n in DECODES] == shapes[3:6]
    assert shapes[-len(LONG_DECODES):] == [long_decode_shape(n) for n in LONG_DECODES]
    assert all(r["gpu_ms"] > 0 and r["tokens"] > 0 for r in report["rows"])
    profiled = [f"decode {n}" for n in DECODES] + [long_decode_shape(n) for n in LONG_DECODES]
    assert list(report["kernel_profile"]) == profiled
    for shape, profile_row in report["kernel_profile"].items():
        assert profile_row["kernels_per_iteration"] > 0 and profile_row["kernels"], shape
        assert profile_row["gpu_us_per_iteration"] == pytest.approx(
            sum(k["us_per_iteration"] for k in profile_row["kernels"]))
        # What the ops add never exceeds what they last: sequential CPU ops add all of it.
        assert 0 < profile_row["busy_us_per_iteration"] <= profile_row["gpu_us_per_iteration"] + 1e-6
        assert f"{shape}: " in printed


def test_breakdown_folds_records_per_name_and_iteration():
    # Back to back, no overlap (two iterations, a host gap between them): each adds its duration.
    events = [("gemv", 0, 4), ("attn", 4, 9), ("gemv", 9, 11),
              ("gemv", 100, 103), ("attn", 103, 110), ("head", 110, 111)]
    result = breakdown(events, iterations=2)
    assert [r["name"] for r in result["kernels"]] == ["attn", "gemv", "head"]
    attn, gemv, head = result["kernels"]
    assert (attn["calls_per_iteration"], attn["us_each"], attn["us_per_iteration"]) == (1.0, 6.0, 6.0)
    assert (gemv["calls_per_iteration"], gemv["us_each"], gemv["us_per_iteration"]) == (1.5, 3.0, 4.5)
    assert head["us_per_iteration"] == 0.5
    assert [r["adds_us_per_iteration"] for r in result["kernels"]] == [6.0, 4.5, 0.5]
    assert result["kernels_per_iteration"] == 3.0 and result["gpu_us_per_iteration"] == 11.0
    assert result["busy_us_per_iteration"] == 11.0
    assert "3 kernels, 11.0 us of kernel time, 11.0 us busy" in format_breakdown("decode 1", result)


def test_what_an_overlapped_kernel_adds_is_its_end_past_the_latest_end_before_it():
    # PDL: each kernel starts inside its predecessor, and "wait" sits wholly inside "long".
    events = [("qkv", 10, 14), ("attn", 12, 20), ("long", 19, 40), ("wait", 21, 30), ("o", 38, 43)]
    result = breakdown(events, iterations=1)
    adds = {r["name"]: r["adds_us_per_iteration"] for r in result["kernels"]}
    assert adds == {"qkv": 4.0, "attn": 6.0, "long": 20.0, "wait": 0.0, "o": 3.0}
    assert result["busy_us_per_iteration"] == 33.0  # 10 .. 43: the device's busy span
    assert result["gpu_us_per_iteration"] == 4 + 8 + 21 + 9 + 5  # durations overlap: more than the span
    assert result["kernels"][0]["name"] == "long"  # the most added first


def test_breakdown_needs_an_iteration():
    with pytest.raises(ValueError, match="iterations must be >= 1"):
        breakdown([], iterations=0)


def test_a_launch_blocked_on_a_staging_buffer_counts_as_a_wait_not_as_launch_work(monkeypatch):
    """Launches queued back to back run ahead of the GPU and then block on a staging buffer still
    being copied: that time is the GPU's pace, reported apart from the host's own launch work."""
    from types import SimpleNamespace

    from graphrelay.tools.bench import iteration

    clock = SimpleNamespace(now=0.0)  # the module's clock, advanced by the engine below: no real time
    monkeypatch.setattr(iteration, "time", SimpleNamespace(perf_counter=lambda: clock.now))

    class BlockedEngine:  # every launch works 0.1 ms and waits 10 ms for a staging copy
        on_gpu, device, stream = False, "cpu", None
        inputs = SimpleNamespace(staging_wait_s=0.0)

        def launch(self, spans):
            clock.now += 1e-4
            clock.now += 0.01
            self.inputs.staging_wait_s += 0.01
            return 0

        def read(self, iteration, block):
            return None

        def span_tokens(self, span):
            return 1

    row = iteration._time(BlockedEngine(), "blocked", [[object()]], repeats=3)
    assert row["host_wait_ms"] >= 10.0  # each launch blocked >= 10 ms
    assert 0 <= row["host_launch_ms"] < row["host_wait_ms"] / 10  # what is left is the call's own work


def test_the_shapes_and_the_ttft_are_timed_with_the_heap_frozen(tmp_path, monkeypatch):
    """As a serving process runs: no full collection of what building the engine left lands in a timing."""
    import gc

    from graphrelay.tools.bench import iteration

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    frozen: list[int] = []
    time_shape, first_token = iteration._time, iteration.time_to_first_token
    monkeypatch.setattr(iteration, "_time", lambda *a, **k: frozen.append(gc.get_freeze_count()) or time_shape(*a, **k))
    monkeypatch.setattr(iteration, "time_to_first_token",
                        lambda *a, **k: frozen.append(gc.get_freeze_count()) or first_token(*a, **k))
    assert bench_main(["iteration", "--smoke", "--out", str(tmp_path)]) == 0
    assert len(frozen) == 10 and min(frozen) > 0  # 9 shapes and the TTFT
    assert gc.get_freeze_count() == 0
