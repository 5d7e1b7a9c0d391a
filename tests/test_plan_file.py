"""capture.model.plan_file: a measured projection plan kept in a file is read back as the same
plan (choices and tilings), measured once only, and a file from another GPU, model shape or
bucket set, or one that is not a plan, is refused with the reason; `serve --kernel-plan`."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.kernels import gemv_tiles
from graphrelay.capture.model import plan_file
from graphrelay.capture.model.linear_plan import PROJECTIONS, LinearPlan
from graphrelay.capture.model.model import LlamaModel, ModelConfig
from graphrelay.capture.serving.cli import serve_main

TINY = ModelConfig.preset("tiny")
MIXED = {"qkv": "triton", "o": "torch", "gate_up": "triton", "down": "triton"}
FMA, DOT = gemv_tiles.Tiles(2, 4, 64, 4, True), gemv_tiles.Tiles(16, 32, 64, 4, False)
SWAPPED = gemv_tiles.Tiles(16, 64, 64, 4, False, early=True, swap=True)
PLAN = LinearPlan({1: MIXED, 16: dict.fromkeys(PROJECTIONS, "torch")},
                  tiles={1: {"qkv": FMA, "gate_up": SWAPPED, "down": DOT}})


@pytest.fixture
def measured(monkeypatch):
    """LinearPlan.measured replaced by PLAN (a CPU measures nothing), its calls counted."""
    calls = []

    def fake(model, rows, stream=None):
        calls.append(list(rows))
        return PLAN

    monkeypatch.setattr(plan_file.LinearPlan, "measured", staticmethod(fake))
    return calls


def same_plan(a: LinearPlan, b: LinearPlan) -> bool:
    return (a.choices, a.tiles, a.default) == (b.choices, b.tiles, b.default)


def test_a_missing_file_is_measured_and_written_then_read_back_without_measuring(tmp_path, measured):
    path, model = tmp_path / "plan.json", LlamaModel(TINY, 2, "cpu")
    first = plan_file.load_or_measure(path, model, [16, 1, 2])
    assert measured == [[16, 1, 2]] and first is PLAN
    record = json.loads(path.read_text())
    assert record["gpu"] == "cpu" and record["rows"] == [1, 2, 16] and record["shape"]["layers"] == TINY.num_layers
    again = plan_file.load_or_measure(path, model, [1, 2, 16])
    assert measured == [[16, 1, 2]]  # not measured again
    assert same_plan(again, PLAN) and again.tiles_for(1) == {"qkv": FMA, "gate_up": SWAPPED, "down": DOT}
    assert all(isinstance(tiles, gemv_tiles.Tiles) for tiles in again.tiles_for(1).values())


def test_a_file_from_before_the_tiling_flags_reads_them_as_off(tmp_path, measured):
    """Files written before `early` and `swap` existed list five fields per tiling."""
    path, model = tmp_path / "plan.json", LlamaModel(TINY, 2, "cpu")
    plan_file.load_or_measure(path, model, [1, 16])
    record = json.loads(path.read_text())
    record["tiles"] = {"1": {"down": [16, 32, 64, 4, False]}}
    path.write_text(json.dumps(record))
    assert plan_file.load_plan(path, model, [1, 16]).tiles_for(1) == {"down": DOT}


@pytest.mark.parametrize("change,what", [
    (lambda r: r | {"gpu": "NVIDIA H200"}, "GPU NVIDIA H200"),
    (lambda r: r | {"shape": r["shape"] | {"layers": 30}}, "model shape"),
    (lambda r: r | {"rows": [1, 2]}, r"row counts \[1, 2\]"),
])
def test_a_plan_measured_elsewhere_is_refused_with_the_difference(tmp_path, measured, change, what):
    path, model = tmp_path / "plan.json", LlamaModel(TINY, 2, "cpu")
    plan_file.load_or_measure(path, model, [1, 2, 16])
    path.write_text(json.dumps(change(json.loads(path.read_text()))))
    with pytest.raises(ValueError, match=f"was measured for {what}.*delete this one"):
        plan_file.load_or_measure(path, model, [1, 2, 16])
    assert measured == [[1, 2, 16]]  # refused, not silently measured again


def test_another_model_shape_is_refused(tmp_path, measured):
    path = tmp_path / "plan.json"
    plan_file.load_or_measure(path, LlamaModel(TINY, 2, "cpu"), [1])
    other = msgspec.structs.replace(TINY, num_layers=TINY.num_layers + 1)
    with pytest.raises(ValueError, match="model shape"):
        plan_file.load_or_measure(path, LlamaModel(other, 2, "cpu"), [1])


@pytest.mark.parametrize("text,match", [
    ("not json", "is not a plan file"),
    ('{"gpu": "cpu"}', "is not a plan file"),
    (None, "must map each of"),  # a valid record whose choices name an unknown backend
])
def test_a_broken_file_is_refused(tmp_path, measured, text, match):
    path, model = tmp_path / "plan.json", LlamaModel(TINY, 2, "cpu")
    plan_file.load_or_measure(path, model, [1, 16])
    if text is None:
        record = json.loads(path.read_text())
        record["choices"]["1"]["qkv"] = "cudnn"
        text = json.dumps(record)
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        plan_file.load_or_measure(path, model, [1, 16])


def test_a_tiling_too_deep_for_this_gpu_is_refused_before_capture(tmp_path, measured, monkeypatch):
    """A file may name a tiling whose buffers, with the residual the step may pass, exceed this GPU's
    shared memory (one written before the depth was bounded): refused with the fix, not left to fail
    as a compiler error at capture."""
    path, model = tmp_path / "plan.json", LlamaModel(TINY, 2, "cpu")
    plan_file.load_or_measure(path, model, [1, 16])
    record = json.loads(path.read_text())
    deep = gemv_tiles.Tiles(64, 64, 64, 4, False, stages=8)
    record["tiles"]["1"]["gate_up"] = list(deep)
    path.write_text(json.dumps(record))
    element_bytes = torch.empty(0, dtype=model.shard.torch_dtype).element_size()
    needs = gemv_tiles.pipeline_bytes(deep, norm=True, element_bytes=element_bytes)
    monkeypatch.setattr(plan_file, "shared_memory_bytes", lambda device: needs)  # just enough
    assert plan_file.load_plan(path, model, [1, 16]).tiles_for(1)["gate_up"] == deep
    monkeypatch.setattr(plan_file, "shared_memory_bytes", lambda device: needs - 1)
    with pytest.raises(ValueError, match="gate_up at 1 rows.*more shared memory than this GPU has.*delete the file"):
        plan_file.load_plan(path, model, [1, 16])


def test_engine_capture_reads_and_writes_the_file(tmp_path):
    path = tmp_path / "plan.json"
    config = EngineConfig(TINY, max_reqs=2, max_batch=2, max_tokens=8, use_graphs=False)
    Engine(config).capture(plan_file=path)
    assert json.loads(path.read_text())["rows"] == list(Engine(config).runner.buckets)
    engine = Engine(config)
    engine.capture(plan_file=path)  # read back: a CPU plan is cuBLAS-shaped torch throughout
    assert engine.model.plan.backends(1) == dict.fromkeys(PROJECTIONS, "torch")
    with pytest.raises(ValueError, match="a plan or a plan_file, not both"):
        engine.capture(LinearPlan.fixed("torch"), plan_file=path)


def test_serve_kernel_plan_flag(tmp_path, capsys):
    tiny = ["--model", "tiny", "--device", "cpu", "--quiet", "--num-requests", "2", "--output-len", "2,3"]
    path = tmp_path / "plan.json"
    assert serve_main([*tiny, "--kernel-plan", str(path)]) == 0
    assert json.loads(path.read_text())["gpu"] == "cpu"
    assert serve_main([*tiny, "--kernel-plan", str(path)]) == 0  # read back
    capsys.readouterr()
    assert serve_main([*tiny, "--kernel-plan", str(tmp_path / "no" / "plan.json")]) == 2
    assert "give a file path in an existing folder" in capsys.readouterr().err
    assert serve_main([*tiny, "--kernel-plan", str(path), "--tp", "2"]) == 2
    assert "drop --kernel-plan or --tp" in capsys.readouterr().err
