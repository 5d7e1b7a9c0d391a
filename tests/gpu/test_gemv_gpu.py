"""capture.kernels.gemv and capture.model.linear_plan on CUDA at SmolLM2-135M's shape in bf16:
each fused kernel against the unfused path (layer_kernels' norm / SiLU kernels around cuBLAS)
for 1, 8 and 64 rows; programmatic dependent launch on (Hopper) changing no bit; and a captured
decode forward under an all-Triton and a measured plan replaying exactly what it does eagerly.
Tolerances as in tests/test_gemv.py.
"""

from __future__ import annotations

import json
import math
import warnings

import msgspec
import pytest
import torch

from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.kernels import gemv, gemv_tiles
from graphrelay.capture.kernels.pdl import pdl_supported
from graphrelay.capture.model.linear_plan import BACKENDS, PROJECTIONS, LinearPlan, candidate_tiles, time_projections
from graphrelay.capture.model.model import LlamaModel, ModelConfig
from graphrelay.tools.bench import bench_main
from test_gemv import (check_early_equals_late, check_float8_cache, check_linear_residual, check_norm_gate_up_silu,
                       check_norm_linear, check_norm_qkv_rotary, inputs)
from test_layer_kernels import EPS, SMOL, rotary_case

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
BF16 = torch.bfloat16
QKV_WIDTH = (SMOL.heads + 2 * SMOL.kv_heads) * SMOL.head_dim
ROWS = pytest.mark.parametrize("rows", [1, 8, 64])
RESIDUAL = pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])


@ROWS
@RESIDUAL
def test_norm_qkv(rows, with_residual):
    check_norm_linear(DEVICE, BF16, rows, SMOL.hidden, QKV_WIDTH, with_residual=with_residual)


@ROWS
@RESIDUAL
def test_norm_qkv_rotary(rows, with_residual):
    # 8 request rows x 64 positions: room for 64 distinct live [slot, position]s.
    check_norm_qkv_rotary(DEVICE, BF16, rows, SMOL.hidden, SMOL, with_residual=with_residual, cache_rows=9,
                          seq_len=64)


@ROWS
def test_norm_qkv_rotary_into_a_float8_cache(rows):
    check_float8_cache(DEVICE, BF16, rows, SMOL.hidden)


@ROWS
def test_o_residual(rows):
    check_linear_residual(DEVICE, BF16, rows, SMOL.heads * SMOL.head_dim, SMOL.hidden)


@ROWS
@RESIDUAL
def test_norm_gate_up_silu(rows, with_residual):
    check_norm_gate_up_silu(DEVICE, BF16, rows, SMOL.hidden, SMOL.inter, with_residual=with_residual)


@ROWS
def test_down_residual(rows):
    check_linear_residual(DEVICE, BF16, rows, SMOL.inter, SMOL.hidden)


def test_pdl_is_on_for_hopper_and_changes_no_bit():
    device = torch.device(DEVICE)
    t = inputs(DEVICE, BF16, 8, SMOL.hidden, SMOL.hidden, seed=1)

    case = rotary_case(SMOL, 8, dtype=BF16, device=DEVICE, cache_rows=4, seq_len=16)
    qkv_weight = inputs(DEVICE, BF16, 8, SMOL.hidden, QKV_WIDTH, seed=2)["weight"]

    def run(pdl: bool) -> list[torch.Tensor]:
        rotary = gemv.Rotary(case.cos, case.sin, case.positions, case.slots, case.k_cache.clone(),
                             case.v_cache.clone(), SMOL.heads, SMOL.kv_heads)
        return [
            gemv.norm_linear(t["x"], t["norm_weight"], t["weight"], EPS, residual=t["residual"], pdl=pdl)[0],
            gemv.norm_gate_up_silu(t["x"], t["norm_weight"], t["gate_up"], EPS, pdl=pdl),
            gemv.linear_residual(t["x"], t["weight"], t["stream"], pdl=pdl),
            gemv.norm_qkv_rotary(t["x"], t["norm_weight"], qkv_weight, EPS, rotary, pdl=pdl),
            rotary.k_cache, rotary.v_cache,
        ]

    if torch.cuda.get_device_capability(device) < (9, 0):
        assert not pdl_supported(device)
        with pytest.raises(ValueError, match="pdl=True needs"):
            run(True)
        return
    assert pdl_supported(device), "a Hopper-class GPU, but this Triton cannot launch with PDL"
    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# A captured decode forward


def smol_model(layers: int = 4) -> LlamaModel:
    """SmolLM2-135M's shapes, random weights, fewer layers (the replay check is per layer)."""
    config = msgspec.structs.replace(ModelConfig.preset("smollm2-135m"), num_layers=layers, max_seq_len=256)
    return LlamaModel(config, 9, DEVICE)


def test_time_projections_reports_every_projection_and_row_count():
    """Every projection and row count timed, and no candidate tiling skipped by the gate (each
    builds on this GPU and computes the projection; the gate once compared O / down against an
    input the timed calls had updated in place, and skipped all but the first)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        timings = time_projections(smol_model(1), [1, 8, 64, 256])
    skipped = [str(w.message) for w in caught if "start-up timing skips" in str(w.message)]
    assert not skipped, skipped[:3]
    assert [(t.rows, t.projection) for t in timings] == [(r, p) for r in (1, 8, 64, 256) for p in PROJECTIONS]
    for t in timings:
        assert math.isfinite(t.torch_us) and math.isfinite(t.triton_us) and t.torch_us > 0 and t.triton_us > 0
        assert t.faster in BACKENDS


# Split-K O and down at 8 rows: their partials and per-tile counters live in the model's
# workspace, reset by each tile's last split, so every replay starts from zero counters.
SPLIT_PLAN = LinearPlan({8: dict.fromkeys(PROJECTIONS, "triton")},
                        tiles={8: {"o": gemv_tiles.Tiles(16, 16, 64, 4, False, split_k=2),
                                   "down": gemv_tiles.Tiles(16, 32, 128, 4, False, split_k=4)}})


@pytest.mark.parametrize("plan_kind", ["triton", "measured", "split-k"])
def test_captured_decode_replays_eager_bit_for_bit(plan_kind):
    """Decode over 8 rows (7 live slots and a padding row) captured once; each replay on fresh
    tokens and positions leaves the logits and the KV cache exactly as the eager call does.
    With PDL on (Hopper) under the all-Triton plan, every projection is a PDL launch."""
    model = smol_model()
    model.plan = {"triton": lambda: LinearPlan.fixed("triton"), "split-k": lambda: SPLIT_PLAN,
                  "measured": lambda: LinearPlan.measured(model, [1, 8, 64])}[plan_kind]()
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 40, (7,), generator=gen).tolist()
    for slot, n in enumerate(lengths, start=1):
        model.prefill([slot], [torch.randint(0, 4096, (n,), generator=gen).tolist()])
    tokens = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    slots = torch.tensor(list(range(1, 8)) + [0], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lengths + [0], dtype=torch.int32, device=DEVICE)
    out = torch.empty(8, model.config.vocab_size, device=DEVICE)
    model.decode(tokens, slots, seq_lens, out=out)  # compiles every kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.decode(tokens, slots, seq_lens, out=out)

    cache = model.kv_cache.keys + model.kv_cache.values
    for step in range(1, 4):
        tokens.copy_(torch.randint(0, 4096, (8,), generator=gen))
        seq_lens[:7] = torch.tensor(lengths, device=DEVICE) + step
        before = [t.clone() for t in cache]
        graph.replay()
        replayed = [out.clone()] + [t.clone() for t in cache]
        for t, saved in zip(cache, before):
            t.copy_(saved)
        model.decode(tokens, slots, seq_lens, out=out)
        eager = [out] + cache
        for index, (a, b) in enumerate(zip(replayed, eager)):
            assert torch.equal(a, b), f"step {step}: tensor {index} (0: logits, then K and V per layer) differs"
        assert not torch.equal(replayed[1], before[0]), "the replay wrote no K"


@pytest.mark.parametrize("rows", [1, 8])
def test_pdl_chain_replays_the_serialized_forward(rows):
    """Under PDL each kernel launches while the one before still runs and reads its inputs
    only after its wait (capture.kernels.pdl). A 30-layer decode forward (SmolLM2-135M's
    depth, the longest chain) captured that way and replayed 50 times equals, every time and
    bit for bit, the same forward run eagerly without PDL, each kernel launched after the one
    before has ended."""
    if not pdl_supported(torch.device(DEVICE)):
        pytest.skip("programmatic dependent launch needs a Hopper-class GPU")
    model = smol_model(layers=30)
    gen = torch.Generator().manual_seed(rows)
    lengths = torch.randint(4, 200, (rows,), generator=gen).tolist()
    for slot, n in enumerate(lengths, start=1):
        model.prefill([slot], [torch.randint(0, 4096, (n,), generator=gen).tolist()])
    tokens = torch.randint(0, 4096, (rows,), generator=gen).to(DEVICE)
    slots = torch.arange(1, rows + 1, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out = torch.empty(rows, model.config.vocab_size, device=DEVICE)
    cache = model.kv_cache.keys + model.kv_cache.values
    before = [t.clone() for t in cache]

    def restore() -> None:
        for t, saved in zip(cache, before):
            t.copy_(saved)

    model.plan = LinearPlan.fixed("triton", pdl=False)
    model.decode(tokens, slots, seq_lens, out=out)
    serialized = [out.clone()] + [t.clone() for t in cache]
    restore()
    model.plan = LinearPlan.fixed("triton")
    model.decode(tokens, slots, seq_lens, out=out)  # compiles the PDL kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.decode(tokens, slots, seq_lens, out=out)
    for replay in range(50):
        restore()
        graph.replay()
        for index, (a, b) in enumerate(zip([out] + cache, serialized)):
            assert torch.equal(a, b), f"replay {replay}: tensor {index} (0: logits, then K and V per layer) differs"


def test_bench_kernels_smoke_writes_every_row(tmp_path):
    assert bench_main(["kernels", "--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "kernels_bench.json").read_text())
    assert [(r["rows"], r["projection"]) for r in report["rows"]] == [(r, p) for r in (1, 2) for p in PROJECTIONS]
    assert all(r["torch_us"] > 0 and r["triton_us"] > 0 and r["triton_no_pdl_us"] > 0 for r in report["rows"])
    for layer in report["per_layer"]:
        assert layer["plan_us"] <= min(layer["torch_us"], layer["triton_us"]) + 1e-9


def test_engine_capture_plans_every_bucket_before_capturing():
    engine = Engine(EngineConfig(ModelConfig.preset("tiny"), max_reqs=4, max_batch=4, device="cuda", buckets=(1, 4),
                                 max_tokens=4))
    engine.capture()
    plan = engine.model.plan
    assert sorted(plan.choices) == [1, 4]
    assert all(set(choice) == set(PROJECTIONS) for choice in plan.choices.values())


def test_a_plan_file_gives_a_second_engine_the_first_ones_kernels(tmp_path):
    """A plan measured on this GPU (tilings included), written by one engine and read by another
    of the same shape: the same choices and tilings (the CPU tests check that a read measures
    nothing)."""
    path = tmp_path / "plan.json"
    config = EngineConfig(ModelConfig.preset("tiny"), max_reqs=4, max_batch=4, device="cuda", buckets=(1, 4, 16),
                          max_tokens=16)
    first = Engine(config)
    first.capture(plan_file=path)
    record = json.loads(path.read_text())
    assert record["gpu"] == torch.cuda.get_device_name() and record["rows"] == [1, 4, 16]
    second = Engine(config)
    second.capture(plan_file=path)
    a, b = first.model.plan, second.model.plan
    assert (a.choices, a.tiles, a.default) == (b.choices, b.tiles, b.default)
    assert sorted(b.choices) == [1, 4, 16]


@pytest.mark.parametrize("rows", [80, 256])
def test_early_epilogue_tiles_change_no_bit(rows):
    """The start-up plan may pick a tensor-core tiling with its epilogue inputs requested before
    the K loop: the same bits as the tiling without."""
    for tiles in candidate_tiles(rows, SMOL.hidden):
        if tiles.early:
            check_early_equals_late(DEVICE, BF16, rows, SMOL.hidden, tiles)


@pytest.mark.parametrize("rows", [8, 40, 256])
def test_every_candidate_tiling_equals_unfused_at_smollm2_shape(rows):
    """Each tiling the start-up plan may pick (swapped, early and split-K ones included) compiles
    on this GPU and computes each projection as the unfused path does."""
    for tiles in candidate_tiles(rows, SMOL.hidden):
        check_norm_qkv_rotary(DEVICE, BF16, rows, SMOL.hidden, SMOL, with_residual=False, cache_rows=9, seq_len=64,
                              tiles=tiles)
        check_norm_gate_up_silu(DEVICE, BF16, rows, SMOL.hidden, SMOL.inter, with_residual=True, tiles=tiles)
    for k in (SMOL.heads * SMOL.head_dim, SMOL.inter):  # O, down
        for tiles in candidate_tiles(rows, k, split=True):
            check_linear_residual(DEVICE, BF16, rows, k, SMOL.hidden, tiles=tiles)
