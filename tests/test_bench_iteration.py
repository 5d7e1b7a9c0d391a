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
        assert f"{shape}: " in printed


def test_breakdown_folds_records_per_name_and_iteration_largest_first():
    events = [("gemv", 4.0), ("attn", 5.0), ("gemv", 2.0), ("gemv", 3.0), ("attn", 7.0), ("head", 1.0)]
    result = breakdown(events, iterations=2)
    assert [r["name"] for r in result["kernels"]] == ["attn", "gemv", "head"]
    attn, gemv, head = result["kernels"]
    assert (attn["calls_per_iteration"], attn["us_each"], attn["us_per_iteration"]) == (1.0, 6.0, 6.0)
    assert (gemv["calls_per_iteration"], gemv["us_each"], gemv["us_per_iteration"]) == (1.5, 3.0, 4.5)
    assert head["us_per_iteration"] == 0.5
    assert result["kernels_per_iteration"] == 3.0 and result["gpu_us_per_iteration"] == 11.0
    assert "3 kernels, 11.0 us" in format_breakdown("decode 1", result)


def test_breakdown_needs_an_iteration():
    with pytest.raises(ValueError, match="iterations must be >= 1"):
        breakdown([], iterations=0)
