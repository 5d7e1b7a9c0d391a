"""Shared parts of the benchmark commands' tests: a smoke run on the CPU path, and the checks of
their bad-input handling."""

from __future__ import annotations

import json

import pytest
import torch

from graphrelay.tools.bench import bench_main


def smoke_report(tmp_path_factory, command: str) -> tuple:
    """`graphrelay bench COMMAND --smoke` once on the CPU path (even on a GPU host): its output
    folder and its `COMMAND_bench.json`, for a module's tests to share."""
    out = tmp_path_factory.mktemp(command)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        assert bench_main([command, "--smoke", "--out", str(out)]) == 0
    return out, json.loads((out / f"{command}_bench.json").read_text())


def assert_usage_error(command: str, argv: list[str], message: str, capsys, out_dir) -> None:
    """`graphrelay bench COMMAND --smoke ARGV` exits 2 with one line naming the problem, no
    traceback, and writes nothing."""
    assert bench_main([command, "--smoke", "--out", str(out_dir), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"graphrelay bench {command}: error: ") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not any(out_dir.iterdir())  # nothing written


def assert_needs_gpu(command: str, capsys, out_dir) -> None:
    """Without a GPU and without --smoke, COMMAND exits 2 with one line pointing at --smoke."""
    assert bench_main([command, "--out", str(out_dir)]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA device" in err and "--smoke" in err and len(err.strip().splitlines()) == 1
