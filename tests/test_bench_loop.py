"""`graphrelay bench loop`: the smoke run serves every mode and writes results; bad options exit 2."""

from __future__ import annotations

import json

import torch

from graphrelay.tools.bench import bench_main
from graphrelay.tools.bench.loop import MODES, plot_panels


def test_smoke_runs_every_mode_and_writes_json_and_png(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path, even on a GPU host
    assert bench_main(["loop", "--smoke", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "loop_bench.json").read_text())
    assert report["benchmark"] == "loop" and report["smoke"] is True
    assert report["environment"]["command"] == f"graphrelay bench loop --smoke --out {tmp_path}"
    rows = report["rows"]
    assert [(r["model"], r["mode"]) for r in rows] == [("tiny", m) for m in MODES]
    requests = report["plan"]["tiny"]["requests"]
    tokens = {r["tokens"] for r in rows}
    assert len(tokens) == 1 and tokens.pop() > requests  # every mode served the same workload
    for r in rows:
        assert r["requests"] == requests and r["iterations"] > 0 and r["tokens_per_s"] > 0
        assert r["host_syncs_per_iter"] == 0 and r["gpu_step_us_per_iter"] is None  # CPU: no GPU timing
    names = [t["name"] for t in report["targets"]]
    assert names == ["tiny: overlap iteration / max(CPU, GPU)", "tiny: host syncs per iteration (overlap)"]
    assert "tiny overlap" in printed
    assert (tmp_path / report["plot"]).read_bytes().startswith(b"\x89PNG")
    (panel,) = plot_panels(rows)  # grouped bars: a group per mode, a bar per measured metric
    assert list(panel.categories) == list(MODES)
    assert [s.label for s in panel.series] == ["iteration (host, mean)", "CPU scheduling"]  # CPU: no GPU timing
    assert list(panel.series[0].values) == [r["iter_ms_mean"] * 1e3 for r in rows]


def test_unknown_model_exits_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_main(["loop", "--smoke", "--models", "huge"]) == 2
    assert "unknown model preset 'huge'" in capsys.readouterr().err
