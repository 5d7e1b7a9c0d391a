"""`graphrelay bench sampler` on a machine without a GPU: a smoke run through the whole code path
(the fused sampler in Triton's interpreter, the torch reference, the table and the JSON), and
its command-line errors."""

from __future__ import annotations

import pytest
import torch

from bench_cases import assert_needs_gpu, assert_usage_error, smoke_report
from graphrelay.tools.bench import sampler


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return smoke_report(tmp_path_factory, "sampler")[1]


def test_the_smoke_run_times_every_kind_at_every_batch_and_both_backends_agree(report):
    cells = {(row["rows"], row["kind"]) for row in report["rows"]}
    assert cells == {(bs, kind) for bs in sampler.SMOKE["rows"] for kind in sampler.KINDS}
    assert all(row["triton_us"] > 0 and row["torch_us"] > 0 for row in report["rows"])
    # The same logits, seeds and steps: the fused sampler draws the reference's tokens.
    assert all(row["same_tokens"] == row["rows"] for row in report["rows"])
    assert report["vocab"] == sampler.SMOKE["vocab"] and report["max_top_k"] == sampler.MAX_TOP_K
    assert report["environment"]["device_type"] == "cpu"


def test_row_params_ask_for_the_kind_with_a_seed_per_row():
    params = sampler.row_params(3, "top-k 50 + top-p 0.9", torch.device("cpu"))
    assert params["temperature"].tolist() == pytest.approx([0.8] * 3)
    assert params["top_k"].tolist() == [50] * 3 and params["top_p"].tolist() == pytest.approx([0.9] * 3)
    assert len(set(params["seeds"].tolist())) == 3


def test_bad_options_are_one_line_errors(capsys, tmp_path):
    for argv, message in ((["--rows", "0"], "--rows"), (["--vocab", "1"], "--vocab"),
                          (["--max-top-k", "300"], "at most 256")):
        out = tmp_path / argv[0].strip("-")
        out.mkdir()
        assert_usage_error("sampler", argv, message, capsys, out)


def test_without_a_gpu_it_says_so(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_needs_gpu("sampler", capsys, tmp_path)


def test_a_cpu_smoke_run_without_the_interpreter_says_how_to_run_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert_usage_error("sampler", [], "TRITON_INTERPRET=1", capsys, tmp_path)
