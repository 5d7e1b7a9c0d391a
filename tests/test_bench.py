"""`graphrelay bench`: the relay benchmark's code paths (smoke mode, on CPU), the baseline it
compares against, the floor arithmetic, and its command-line errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphrelay import FieldSpec, Relay, RelayConfig
from graphrelay.fields import relay_fields
from graphrelay.tools.bench import bench_main, floor
from graphrelay.tools.bench.baseline import PerFieldRelay
from graphrelay.tools.bench.relay import VARIANTS
from graphrelay.tools.bench.relay_workload import disagreements, fill_every_row, index_sets, random_inputs, relay_step
from graphrelay.tools.bench.results import Target
from graphrelay.tools.bench.timing import Ceilings

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def every_field_config(max_reqs: int = 16, max_batch: int = 8) -> RelayConfig:
    """Every optional field, including a 2-D one and the publish-side confidence."""
    return RelayConfig(
        max_reqs=max_reqs, max_batch=max_batch, pad_token_id=7, seq_len_fill=1,
        topk_p=FieldSpec((4,), "float32"), topk_index=FieldSpec((4,), "int64"),
        hidden=FieldSpec((24,), "bfloat16"), draft_probs=FieldSpec((3,), "float16"),
        sparse_topk=FieldSpec((2, 3), "int32"), accepted_tokens=FieldSpec((3,), "int16"),
        accept_len=FieldSpec((), "int32"), confidence=FieldSpec((3,), "float32"),
    )


# ---- smoke mode -------------------------------------------------------------------------------


def test_smoke_runs_every_variant_and_writes_json_and_png(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path, even on a GPU host
    assert bench_main(["relay", "--smoke", "--batch-sizes", "1,4", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "SMOKE RUN" in printed and "targets:" in printed

    report = json.loads((tmp_path / "relay_bench.json").read_text())
    assert report["benchmark"] == "relay" and report["smoke"] is True
    env = report["environment"]
    for key in ("device", "torch", "triton", "cuda_bindings", "python", "date"):
        assert env[key], key
    assert env["command"] == f"graphrelay bench relay --smoke --batch-sizes 1,4 --out {tmp_path}"
    assert set(report["variants"]) == set(VARIANTS)
    assert report["ceilings"]["copy_bandwidth_bytes_per_s"] > 0 and report["ceilings"]["kernel_node_us"] > 0

    rows = report["rows"]
    assert [(r["field_set"], r["batch_size"]) for r in rows] == [("plain", 1), ("plain", 4), ("eagle", 1), ("eagle", 4)]
    for r in rows:
        assert set(r["us"]) == set(VARIANTS)
        for v, us in r["us"].items():
            low, high = r["spread_us"][v]
            assert math.isfinite(us) and 0 < low <= us <= high, (r["field_set"], r["batch_size"], v)
        assert r["floor_us"] > r["bytes_us"] > 0
        assert r["speedup_vs_baseline_eager"] == pytest.approx(r["us"]["baseline_eager"] / r["us"]["graphrelay_graph"])
    eagle_row_bytes = report["field_sets"]["eagle"]["row_bytes"]
    assert eagle_row_bytes > report["field_sets"]["plain"]["row_bytes"] == 8

    targets = {t["name"]: t for t in report["targets"]}
    assert len(targets) == 3
    assert targets["graphrelay captured, EAGLE, batch 256"]["measured"] is None  # batch 256 was not run
    assert targets["graphrelay captured, EAGLE, batch 1"]["measured"] == rows[2]["us"]["graphrelay_graph"]

    png = (tmp_path / report["plot"]).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


# ---- the baseline is the same relay ---------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_per_field_baseline_computes_what_relay_computes(seed):
    config = every_field_config()
    gen = torch.Generator().manual_seed(seed)
    relay = Relay(config, CPU, backend="torch")
    baseline = PerFieldRelay(config, CPU)
    fields = relay.fields
    fill_every_row([relay, baseline], fields, config.max_reqs, config.max_batch, CPU, gen)
    for name in relay.buffers:
        assert torch.equal(relay.buffers[name], baseline.buffers[name]), name
    for bs in (1, 5, 8):  # 5 and 8 carry padding rows
        indices = index_sets(1, bs, config.max_reqs, CPU, gen)[0]
        assert disagreements(relay, baseline, indices, random_inputs(fields, bs, CPU, gen)) == []


def test_disagreements_names_the_field_that_differs():
    config = every_field_config()
    gen = torch.Generator().manual_seed(0)
    relay = Relay(config, CPU, backend="torch")
    baseline = PerFieldRelay(config, CPU)
    fill_every_row([relay, baseline], relay.fields, config.max_reqs, config.max_batch, CPU, gen)
    baseline.buffers["hidden"][3] += 1  # slot 3 now differs in one field only
    indices = torch.tensor([3, 5, 0])
    assert disagreements(relay, baseline, indices, random_inputs(relay.fields, 3, CPU, gen)) == ["resolve.hidden"]


def test_timed_steps_leave_both_relays_equal():
    """The iteration bodies the benchmark times (rotating index sets, graphrelay gathering
    into a static `out`) do the same work on both relays."""
    config = every_field_config(max_reqs=32, max_batch=8)
    gen = torch.Generator().manual_seed(1)
    relay = Relay(config, CPU, backend="torch", validate=False)
    baseline = PerFieldRelay(config, CPU)
    fill_every_row([relay, baseline], relay.fields, config.max_reqs, config.max_batch, CPU, gen)
    sets = index_sets(3, 8, config.max_reqs, CPU, gen)
    inputs = random_inputs(relay.fields, 8, CPU, gen)
    out = relay.alloc_resolved(8)
    ours, theirs = relay_step(relay, sets, inputs, out=out), relay_step(baseline, sets, inputs)
    for k in range(4):  # wraps around the three index sets
        indices = sets[k % len(sets)]
        live = indices != 0
        expected = baseline.resolve(indices)  # what this step's resolve must gather
        ours(k)
        theirs(k)
        for f in relay.fields:
            assert torch.equal(getattr(out, f.name)[live], getattr(expected, f.name)[live]), (k, f.name)
    for name in relay.buffers:
        assert torch.equal(relay.buffers[name][1:], baseline.buffers[name][1:]), name


def test_index_sets_are_distinct_live_slots_then_padding():
    gen = torch.Generator().manual_seed(0)
    for indices in index_sets(4, 16, 20, CPU, gen):
        live, pad = indices[:14], indices[14:]
        assert indices.dtype == torch.int64
        assert torch.all(pad == 0) and torch.all((live >= 1) & (live <= 20))
        assert len(set(live.tolist())) == 14


# ---- the floor ---------------------------------------------------------------------------------


def test_floor_bytes_counted_by_hand():
    config = RelayConfig.eagle(max_reqs=8, max_batch=4, topk=2, hidden_size=4)
    fields = relay_fields(config)
    # tokens int32 4 B + top-k probs 2 x 4 B + top-k ids 2 x 8 B + hidden 4 x 2 B + seq len 4 B
    assert floor.row_bytes(fields) == 4 + 8 + 16 + 8 + 4 == 40
    # per row: gather reads + writes 40 B, scatter reads + writes 40 B, two int64 index reads
    assert floor.iteration_bytes(fields, batch=3, index_itemsize=8) == 3 * (40 + 40 + 40 + 40 + 8 + 8) == 528
    ceilings = Ceilings(copy_bytes=0, copy_bandwidth=1e9, kernel_node_us=1.0)
    assert floor.floor_us(528, ceilings) == pytest.approx(0.528 + 1.0)

    plain = relay_fields(RelayConfig.plain(max_reqs=8, max_batch=4))
    assert floor.iteration_bytes(plain, batch=1, index_itemsize=4) == 4 * 8 + 2 * 4


def test_floor_matches_the_h200_figure_in_the_design():
    """EAGLE at batch 256 moves about 8.5 MB: 2.0 µs at the 4.25 TB/s measured on an H200."""
    fields = relay_fields(RelayConfig.eagle(max_reqs=1024, max_batch=512))
    nbytes = floor.iteration_bytes(fields, batch=256, index_itemsize=8)
    assert nbytes / 4.25e12 * 1e6 == pytest.approx(2.0, abs=0.01)


# ---- targets -----------------------------------------------------------------------------------


def test_targets_report_met_missed_and_margin():
    fast = Target("t", 3.5, "µs", True, 3.0)
    slow = Target("t", 3.5, "µs", True, 4.0)
    speedup = Target("s", 30.0, "x", False, 25.0)
    assert (fast.met, fast.margin) == (True, 0.5)
    assert (slow.met, slow.margin) == (False, -0.5)
    assert (speedup.met, speedup.margin) == (False, -5.0)
    assert "MISSED" in slow.line() and "0.5 µs short" in slow.line()
    unmeasured = Target("t", 3.5, "µs", True, None)
    assert unmeasured.met is None and unmeasured.as_dict()["margin"] is None


# ---- command-line errors ---------------------------------------------------------------------


@pytest.mark.parametrize("sizes, message", [
    ("1,x", "'x' is not an integer"),
    ("", "comma-separated list"),
    ("1,,4", "comma-separated list"),
    ("0,4", "0 must be >= 1"),
    ("4,5000", "out of range 1..1024"),
])
def test_bad_batch_sizes_exit_2_with_a_clear_message(sizes, message, capsys):
    assert bench_main(["relay", "--batch-sizes", sizes]) == 2
    err = capsys.readouterr().err
    assert "--batch-sizes" in err and message in err and "Traceback" not in err


def test_no_gpu_without_smoke_exits_2_and_names_the_fix(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_main(["relay", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA device" in err and "--smoke" in err
    assert not any(tmp_path.iterdir())  # nothing written


def test_unknown_benchmark_and_bare_bench_exit_2(capsys):
    assert bench_main(["nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err
    assert bench_main([]) == 2
    assert bench_main(["--help"]) == 0
    assert "relay" in capsys.readouterr().out


def test_cli_process_without_gpu_prints_one_error_line_no_traceback():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-m", "graphrelay.tools.cli", "bench", "relay"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]  # one line
    assert "needs a CUDA device" in done.stderr


# ---- on a GPU: the captured variants really replay the relay's work ------------------------


@pytest.mark.gpu
def test_captured_steps_replay_current_inputs_on_both_relays():
    """Capture both timed bodies, change the static payload in place, replay: both relays must
    hold the new values in the rows the last iteration wrote, and agree everywhere else."""
    from graphrelay.tools.bench.timing import capture_steps

    device = torch.device("cuda")
    config = RelayConfig.eagle(max_reqs=64, max_batch=8, topk=4, hidden_size=128)
    gen = torch.Generator().manual_seed(2)
    relay = Relay(config, device, validate=False)
    baseline = PerFieldRelay(config, device)
    fill_every_row([relay, baseline], relay.fields, config.max_reqs, config.max_batch, device, gen)
    sets = index_sets(2, 8, config.max_reqs, device, gen)
    inputs = random_inputs(relay.fields, 8, device, gen)
    out = relay.alloc_resolved(8)
    replays = [capture_steps(device, relay_step(r, sets, inputs, out=o), 3) for r, o in ((relay, out), (baseline, None))]
    fresh = random_inputs(relay.fields, 8, device, gen)
    inputs.payload.hidden.copy_(fresh.payload.hidden)
    inputs.seq_lens.copy_(fresh.seq_lens)
    for replay in replays:
        replay()
    torch.cuda.synchronize()
    last = sets[2 % len(sets)]
    live = last != 0
    assert torch.equal(relay.buffers["hidden"][last[live]], fresh.payload.hidden[live])
    assert torch.equal(relay.buffers["seq_lens"][last[live]], fresh.seq_lens[live])
    for name in relay.buffers:
        assert torch.equal(relay.buffers[name][1:], baseline.buffers[name][1:]), name


@pytest.mark.gpu
def test_smoke_on_gpu_captures_and_writes_results(tmp_path):
    assert bench_main(["relay", "--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "relay_bench.json").read_text())
    assert report["environment"]["device_type"] == "cuda" and report["environment"]["l2_cache_bytes"]
