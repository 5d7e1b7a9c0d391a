"""`graphrelay bench e2e`: the smoke run (every system, on CPU), split runs merged into one file,
the time budget, the targets, the floor arithmetic, the grouped-bar plot, and bad options."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench_cases import assert_needs_gpu, assert_usage_error
from graphrelay.capture.model.model import ModelConfig
from graphrelay.tools.bench import bench_main, e2e_systems, plots
from graphrelay.tools.bench.e2e import ROW_KEYS, SYSTEMS, e2e_targets, make_row, merge_rows


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path, even on a GPU host


def run_e2e(*argv: str) -> dict:
    out = argv[argv.index("--out") + 1]
    assert bench_main(["e2e", *argv]) == 0
    with open(f"{out}/e2e_bench.json") as f:
        return json.load(f)


# ---- the smoke run ----------------------------------------------------------------------------


def test_smoke_measures_every_system_and_writes_json_and_png(tmp_path, capsys):
    report = run_e2e("--smoke", "--out", str(tmp_path))
    printed = capsys.readouterr().out
    assert report["benchmark"] == "e2e" and report["smoke"] is True and report["model"] == "tiny"
    assert report["environment"]["command"] == f"graphrelay bench e2e --smoke --out {tmp_path}"
    rows = report["rows"]
    assert [(r["system"], r["batch"], r["prompt_len"]) for r in rows] == [(s, b, 8) for b in (1, 2) for s in SYSTEMS]
    for r in rows:
        assert tuple(r) == ROW_KEYS and r["output_len"] == 4
        assert r["tokens_per_s"] > 0 and r["ttft_ms"] > 0 and not r["note"].startswith(("failed", "skipped"))
        assert (r["capture_s"] is not None) == (r["iter_us_median"] is not None) == (r["system"] == "graphrelay")
    for batch in (1, 2):  # the floor belongs to the shape: every system's row carries the same one
        floors = {r["floor_us"] for r in rows if r["batch"] == batch}
        assert floors == {e2e_systems.floor_us(ModelConfig.preset("tiny"), batch, 8, 4)}
    graphrelay = [r for r in rows if r["system"] == "graphrelay"]
    for r in graphrelay:  # on CPU the step is the host interval, and says so
        assert r["decode_step_us"] == r["iter_us_median"] and "host iteration interval" in r["note"]
        assert r["decode_tokens_per_s"] == pytest.approx(r["batch"] / (r["decode_step_us"] * 1e-6))
    assert [t["measured"] for t in report["targets"]] == [None] * 8  # the targets are at prompt 128
    assert (tmp_path / report["plot"]).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert "SMOKE RUN" in printed and "end to end (prefill included)" in printed
    assert sum(line.startswith(SYSTEMS) for line in printed.splitlines()) == len(rows)  # one line per row as it ran


def test_split_runs_merge_into_one_file(tmp_path):
    out = str(tmp_path)
    first = run_e2e("--smoke", "--out", out, "--systems", "graphrelay", "--batches", "1,2")
    second = run_e2e("--smoke", "--out", out, "--systems", "hf-dynamic,graphrelay", "--batches", "2", "--merge")
    assert [(r["system"], r["batch"]) for r in second["rows"]] == [("graphrelay", 1), ("graphrelay", 2), ("hf-dynamic", 2)]
    assert second["rows"][0] == first["rows"][0]  # kept from the first run
    assert second["rows"][1] != first["rows"][1]  # measured again, replaced
    assert second["earlier_environments"] == [first["environment"]]
    third = run_e2e("--smoke", "--out", out, "--systems", "hf-dynamic", "--batches", "1")  # no --merge: a fresh file
    assert [(r["system"], r["batch"]) for r in third["rows"]] == [("hf-dynamic", 1)]


def test_merge_refuses_a_file_of_another_output_length(tmp_path, capsys):
    run_e2e("--smoke", "--out", str(tmp_path), "--systems", "hf-dynamic", "--batches", "1")
    before = (tmp_path / "e2e_bench.json").read_text()
    capsys.readouterr()  # that run's progress lines
    assert bench_main(["e2e", "--smoke", "--out", str(tmp_path), "--output-len", "6", "--merge"]) == 2
    err = capsys.readouterr().err
    assert "output length 4" in err and "drop --merge" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "e2e_bench.json").read_text() == before


def test_spent_time_budget_records_every_cell_as_skipped(tmp_path):
    report = run_e2e("--smoke", "--out", str(tmp_path), "--time-budget", "1e-9")
    assert len(report["rows"]) == 2 * len(SYSTEMS)
    for r in report["rows"]:
        assert r["note"].startswith("skipped: time budget") and r["tokens_per_s"] is None and r["floor_us"] > 0
    assert (tmp_path / "e2e_bench.png").exists()


def test_merge_never_replaces_a_measured_row_with_a_skipped_one():
    measured = make_row("hf-static", 8, 128, 128, tokens_per_s=5.0, note="ok")
    skipped = make_row("hf-static", 8, 128, 128, note="skipped: time budget")
    graphrelay = make_row("graphrelay", 8, 128, 128, tokens_per_s=9.0)
    assert merge_rows([measured], [skipped]) == [measured]
    assert merge_rows([skipped], [measured]) == [measured]
    assert merge_rows([measured], [graphrelay]) == [graphrelay, measured]  # sorted: systems in SYSTEMS order
    with pytest.raises(KeyError, match="speed"):
        make_row("graphrelay", 1, 1, 2, speed=1.0)


# ---- targets and the floor --------------------------------------------------------------------


def test_targets_read_the_prompt_128_rows_and_judge_each():
    rows = [
        make_row("graphrelay", 1, 128, 128, decode_step_us=900.0, tokens_per_s=1e3),
        make_row("hf-static", 1, 128, 128, decode_step_us=3000.0, tokens_per_s=3e2),
        make_row("graphrelay", 64, 128, 128, decode_step_us=1600.0, tokens_per_s=5e4),
        make_row("hf-static", 64, 128, 128, decode_step_us=3200.0, tokens_per_s=2e4),
        make_row("graphrelay", 256, 512, 128, decode_step_us=100.0, tokens_per_s=1e6),  # another prompt length
    ]
    by_name = {t.name: t for t in e2e_targets(rows)}
    assert len(by_name) == 8

    def verdict(fragment: str):
        (target,) = [t for name, t in by_name.items() if fragment in name]
        return target.measured, target.met

    assert verdict("graphrelay decode step, batch 1,") == (0.9, True)
    assert verdict("graphrelay decode step, batch 64,") == (1.6, False)
    assert verdict("graphrelay decode step, batch 256,") == (None, None)
    assert verdict("speedup over hf-static, batch 1,") == (pytest.approx(3000 / 900), True)
    assert verdict("speedup over hf-static, batch 64,") == (2.0, False)
    assert verdict("speedup over hf-static, batch 256,") == (None, None)
    assert verdict("tokens/s over hf-static, batch 64,") == (2.5, True)
    assert verdict("tokens/s over hf-static, batch 256,") == (None, None)


@pytest.mark.parametrize("preset", ["tiny", "smollm2-135m"])
def test_weight_bytes_count_the_same_parameters_as_the_hf_model(preset):
    from transformers import LlamaForCausalLM

    model = ModelConfig.preset(preset)
    with torch.device("meta"):  # shapes only, nothing allocated
        hf = LlamaForCausalLM(e2e_systems.hf_config(model, 256))
    itemsize = torch.empty((), dtype=model.torch_dtype).element_size()
    assert e2e_systems.weight_bytes(model) == sum(p.numel() for p in hf.parameters()) * itemsize  # tied: counted once
    assert hf.config.rope_parameters["rope_theta"] == model.rope_theta and hf.config.head_dim == model.head_dim


def test_floor_of_the_smollm2_step_at_batch_64():
    model = ModelConfig.preset("smollm2-135m")
    weights = 134_515_008 * 2
    kv = 64 * (128 + 64) * 30 * 2 * 3 * 64 * 2  # batch x mean context x layers x (K, V) x kv heads x head dim x bf16
    assert e2e_systems.floor_us(model, 64, 128, 128) == pytest.approx((weights + kv) / 4.2e12 * 1e6)


def test_prompts_depend_only_on_the_shape_and_seed():
    a = e2e_systems.prompts(512, 3, 5, seed=0)
    assert len(a) == 3 and all(len(p) == 5 and all(0 <= t < 512 for t in p) for p in a)
    assert e2e_systems.prompts(512, 3, 5, seed=0) == a and e2e_systems.prompts(512, 3, 5, seed=1) != a


# ---- the grouped-bar panel --------------------------------------------------------------------


def test_bar_panel_draws_a_group_per_category_and_skips_missing_values():
    import matplotlib.pyplot as plt

    panel = plots.BarPanel("step", "batch size", "ms", ["1", "8", "64"], [
        plots.Bars("a", [1.0, 2.0, 3.0]), plots.Bars("b", [4.0, None, 6.0]),
        plots.Bars("floor", [0.5, 0.5, None], reference=True),
    ], logy=True)
    fig = plots.figure([panel, panel, panel], "title", columns=2)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(fig.axes) == 4 and len(axes) == 3  # a 2 x 2 grid, its last cell hidden
    ax = axes[0]
    heights = [p.get_height() for p in ax.patches]
    assert sorted(h for h in heights if not math.isnan(h)) == [1.0, 2.0, 3.0, 4.0, 6.0]  # no bar for None
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "8", "64"] and ax.get_yscale() == "log"
    (floor,) = ax.collections
    assert len(floor.get_segments()) == 2  # one dashed segment per category that has a floor
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["floor", "a", "b"]
    centres = sorted(p.get_x() + p.get_width() / 2 for p in ax.patches)
    assert centres[:2] == pytest.approx([-0.2, 0.2])  # two bars side by side around category 0
    plt.close(fig)
    with pytest.raises(ValueError, match="has 2 values for 3 categories"):
        plots.figure([panel._replace(series=[plots.Bars("a", [1.0, 2.0])])], "title")


# ---- bad options ------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--batches", "1,x"], "'x' is not an integer"),
    (["--prompt-lens", "0"], "0 must be >= 1"),
    (["--systems", "hf,graphrelay"], "unknown system 'hf'"),
    (["--output-len", "2"], "--output-len must be >= 3"),
    (["--time-budget", "0"], "--time-budget must be > 0"),
    (["--batches", "4096"], "out of range 1..1024"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_options_exit_2_with_one_line(argv, message, capsys, tmp_path):
    assert_usage_error("e2e", argv, message, capsys, tmp_path)


def test_no_gpu_without_smoke_exits_2(capsys, tmp_path):
    assert_needs_gpu("e2e", capsys, tmp_path)


def test_every_system_times_its_calls_with_the_heap_frozen(tmp_path, monkeypatch):
    """The timed runs of both sides see the heap frozen, as a server's loop does (`frozen_startup_heap`),
    and the untimed warm-ups do not need it: a collection there delays no measurement."""
    import gc

    import transformers

    frozen_during: dict[str, list[int]] = {"graphrelay": [], "hf": []}
    serve, generate = e2e_systems.ServingLoop.run, transformers.LlamaForCausalLM.generate
    monkeypatch.setattr(e2e_systems.ServingLoop, "run",
                        lambda self, *a, **k: frozen_during["graphrelay"].append(gc.get_freeze_count())
                        or serve(self, *a, **k))
    monkeypatch.setattr(transformers.LlamaForCausalLM, "generate",
                        lambda self, *a, **k: frozen_during["hf"].append(gc.get_freeze_count())
                        or generate(self, *a, **k))
    run_e2e("--smoke", "--systems", "graphrelay,hf-static", "--batches", "1", "--out", str(tmp_path))
    warm, timed = frozen_during["graphrelay"]
    assert warm == 0 and timed > 0
    assert frozen_during["hf"][:3] == [0, 0, 0] and min(frozen_during["hf"][3:]) > 0  # warm-up: 3 calls, then timed
    assert gc.get_freeze_count() == 0  # handed back after each
