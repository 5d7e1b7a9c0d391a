"""capture.model.linear_plan: the per-row-count backend lookup, the choice from timings, and the
model's layer stack under every kind of plan: all-torch is the pre-plan stack op for op, and
all-Triton or mixed plans (interpreted) give the same greedy tokens in float32."""

from __future__ import annotations

import math

import pytest
import torch
import triton

from graphrelay.capture.kernels import attention, gemv, gemv_tiles
from graphrelay.capture.kernels import layer_kernels as kernels
from graphrelay.capture.model import linear_plan
from graphrelay.capture.model.linear_plan import PROJECTIONS, LinearPlan, ProjectionTiming
from graphrelay.capture.model.model import LlamaModel, ModelConfig

ALL_TRITON = dict.fromkeys(PROJECTIONS, "triton")
ALL_TORCH = dict.fromkeys(PROJECTIONS, "torch")


def test_a_row_count_uses_the_smallest_measured_size_at_or_above_it():
    mixed = {"qkv": "triton", "o": "torch", "gate_up": "triton", "down": "torch"}
    plan = LinearPlan({8: mixed, 1: ALL_TRITON})
    assert plan.backends(1) == ALL_TRITON
    assert plan.backends(2) == plan.backends(8) == mixed
    assert plan.backends(9) == ALL_TORCH  # beyond the largest: the default
    assert LinearPlan.fixed("triton").backends(10_000) == ALL_TRITON


def test_from_timings_keeps_the_faster_backend():
    timings = [ProjectionTiming(4, p, torch_us=2.0, triton_us=us) for p, us in zip(PROJECTIONS, (1.0, 3.0, 2.0, 1.9))]
    plan = LinearPlan.from_timings(timings)
    assert plan.backends(4) == {"qkv": "triton", "o": "torch", "gate_up": "torch", "down": "triton"}


def test_from_timings_keeps_the_fastest_tiling_of_a_triton_choice():
    fma, dot = gemv_tiles.Tiles(2, 4, 1024, 4, True), gemv_tiles.Tiles(32, 16, 128, 4, False)
    timings = [ProjectionTiming(2, "qkv", 3.0, 2.0, fma), ProjectionTiming(2, "o", 1.0, 2.0, dot),
               ProjectionTiming(2, "gate_up", 3.0, 2.0, None), ProjectionTiming(2, "down", 3.0, 2.0, dot)]
    plan = LinearPlan.from_timings(timings)
    assert plan.backends(2) == {"qkv": "triton", "o": "torch", "gate_up": "triton", "down": "triton"}
    assert plan.tiles_for(1) == plan.tiles_for(2) == {"qkv": fma, "down": dot}  # o runs torch; gate_up the default
    assert plan.tiles_for(3) == {}  # beyond the plan: the default everywhere
    ops = plan.ops(2, 1e-5)
    assert ops.tiles == {"qkv": fma, "down": dot}


@pytest.mark.parametrize("tiles,match", [
    ({8: {"o": gemv_tiles.Tiles(1, 4, 1024, 4, True)}}, "runs on triton"),  # o is torch at 8 rows
    ({16: {"qkv": gemv_tiles.Tiles(1, 4, 1024, 4, True)}}, "runs on triton"),  # no 16-row choice
    ({8: {"qkv": gemv_tiles.Tiles(1, 4, 1000, 4, True)}}, "powers of two"),
    ({8: {"qkv": gemv_tiles.Tiles(16, 16, 64, 4, False, split_k=2)}}, "split-K tiling serves only"),
])
def test_bad_tiles_in_a_plan_are_rejected(tiles, match):
    with pytest.raises(ValueError, match=match):
        LinearPlan({8: ALL_TORCH | {"qkv": "triton"}}, tiles=tiles)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 17, 64, 65, 256])
@pytest.mark.parametrize("k", [64, 576, 1536, 4096])
def test_candidate_tiles_are_valid_and_cover_the_rows(rows, k):
    candidates = linear_plan.candidate_tiles(rows, k)
    with_split = linear_plan.candidate_tiles(rows, k, split=True)
    assert candidates and len(set(with_split)) == len(with_split)
    # Split-K tilings only where asked for (O and down): the others run the norm prologue.
    # The same tilings first (the O and down projections' pipelines may run deeper: fewer buffers a step).
    assert [t._replace(stages=0) for t in with_split[: len(candidates)]] == [t._replace(stages=0) for t in candidates]
    assert all(t.split_k == 1 for t in candidates)
    assert all(t.split_k > 1 for t in with_split[len(candidates):]) and (rows <= 4) == (with_split == candidates)
    for tiles in with_split:
        assert gemv_tiles.check_tiles(tiles) is tiles
        assert tiles.block_k <= max(gemv_tiles.FMA_MAX_K, 256)
        assert max(tiles.block_m, tiles.block_n) <= gemv_tiles.SPLIT_TILE_MAX or tiles.split_k == 1
        if tiles.fma:  # CUDA-core tiles only for decode-sized batches, never more rows than padded to
            assert rows <= 16 and tiles.block_m <= max(4, triton.next_power_of_2(rows))
        # The deeper pipeline only beyond 64 rows, where the captured step measured it faster.
        depths = (gemv_tiles.TC_STAGES, linear_plan.DEEP_STAGES) if rows > 64 else (gemv_tiles.TC_STAGES,)
        assert tiles.stages in depths


@pytest.mark.parametrize("rows", [80, 256])
def test_deep_pipelines_only_where_the_h100_built_them(rows):
    """Which tilings beyond 64 rows get DEEP_STAGES: on the H100 (Triton 3.6) a 64 x 64 x 64 tile of
    gate/up asked 249 KB of shared memory at 8 stages and 64 x 32 x 128 ones 248-360 KB (QKV,
    gate/up) against 227 KB, while O and down built every tiling at 8 (results/deep_stages_h100.txt)."""
    def deep(tiles):
        return {(t.block_m, t.block_n, t.block_k) for t in tiles if t.stages == linear_plan.DEEP_STAGES}

    def shallow(tiles):
        return {(t.block_m, t.block_n, t.block_k) for t in tiles if t.stages == gemv_tiles.TC_STAGES}

    norm = linear_plan.candidate_tiles(rows, 576)
    assert deep(norm) == {(16, 64, 64), (64, 32, 64)} and shallow(norm) == {(64, 64, 64), (64, 32, 128)}
    for k in (576, 1536):  # O, down
        split = linear_plan.candidate_tiles(rows, k, split=True)
        assert deep(split) == {(t.block_m, t.block_n, t.block_k) for t in split} and not shallow(split)


def test_tiles_fit_counts_the_norm_projections_buffers_and_the_dtype():
    deep = gemv_tiles.Tiles(64, 64, 64, 4, False, stages=linear_plan.DEEP_STAGES)
    h100 = 232448
    # On the H100 this gate/up asked 254,848 bytes; O and down built it.
    assert not linear_plan.tiles_fit(deep, "gate_up", torch.bfloat16, h100)
    assert not linear_plan.tiles_fit(deep, "qkv", torch.bfloat16, h100)  # with the residual the step may pass
    assert all(linear_plan.tiles_fit(deep, projection, torch.bfloat16, h100) for projection in ("o", "down"))
    assert linear_plan.tiles_fit(deep, "gate_up", torch.float32, h100)  # float32 keeps 2 stages
    assert linear_plan.shared_memory_bytes(torch.device("cpu")) == math.inf


@pytest.mark.parametrize("choices,default,match", [
    ({0: ALL_TORCH}, "torch", "positive ints"),
    ({4: {"qkv": "torch"}}, "torch", "must map each of"),
    ({4: ALL_TORCH | {"o": "cublas"}}, "torch", "must map each of"),
    ({}, "cuda", "default must be one of"),
])
def test_bad_plans_are_rejected(choices, default, match):
    with pytest.raises(ValueError, match=match):
        LinearPlan(choices, default=default)


def test_a_cpu_model_is_planned_torch_without_timing(monkeypatch):
    model = LlamaModel(ModelConfig(), 2, "cpu")

    def refuse(*args, **kwargs):
        raise AssertionError("timed on a CPU")

    monkeypatch.setattr(linear_plan, "time_projections", refuse)
    assert LinearPlan.measured(model, [1, 8]).backends(1) == ALL_TORCH
    monkeypatch.undo()
    with pytest.raises(ValueError, match="needs a CUDA model"):
        linear_plan.time_projections(model, [1])


# ----------------------------------------------------------------------------------------------
# The model under each plan


def pre_plan_forward(model, tokens, slots, positions, attend):
    """The layer stack as it was before the plan: the all-torch plan must be it op for op."""
    c = model.shard
    residual = model.embed.index_select(0, tokens)
    h = kernels.rms_norm(residual, model.layers[0].attn_norm, c.rms_eps)
    for index, layer in enumerate(model.layers):
        if index:
            h, residual = kernels.rms_norm(x, layer.attn_norm, c.rms_eps, residual=residual)
        q = kernels.rotary_and_cache_write(h @ layer.qkv.T, model.rope_cos, model.rope_sin, positions,
                                           model.kv_cache.keys[index], model.kv_cache.values[index], slots,
                                           c.num_heads, c.num_kv_heads)
        x = attend(index, q) @ layer.o.T
        h, residual = kernels.rms_norm(x, layer.mlp_norm, c.rms_eps, residual=residual)
        x = kernels.silu_mul(h @ layer.gate_up.T) @ layer.down.T
    return kernels.rms_norm(x, model.final_norm, c.rms_eps, residual=residual)[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_torch_plan_is_the_pre_plan_stack_bit_for_bit(dtype):
    model = LlamaModel(ModelConfig(dtype=dtype), 3, "cpu")
    tokens, slots, positions = torch.tensor([5, 9, 0]), torch.tensor([1, 2, 0]), torch.tensor([0, 0, 1])

    def attend(index, q):
        return attention.decode_attention(q, model.kv_cache.keys[index], model.kv_cache.values[index], slots,
                                          positions, scale=model.scale)

    got = model._forward(tokens, slots, positions, attend)
    assert torch.equal(got, pre_plan_forward(model, tokens, slots, positions, attend))


PROMPTS = {1: [1, 2, 3], 3: [9, 8, 7, 6, 5, 4], 2: [44]}
STEPS = 4


def greedy_run(plan: LinearPlan) -> tuple[dict[int, list[int]], torch.Tensor]:
    """Prefill PROMPTS one by one, then STEPS decode steps of all of them plus a padding row;
    returns every slot's tokens and the last step's logits."""
    model = LlamaModel(ModelConfig(), 4, "cpu")
    model.plan = plan
    sequences = {slot: prompt + [int(model.prefill([slot], [prompt])[0].argmax())] for slot, prompt in PROMPTS.items()}
    for _ in range(STEPS):
        rows = [(sequences[s][-1], s, len(sequences[s]) - 1) for s in sequences] + [(0, 0, 1)]
        tokens, slots, seq_lens = (torch.tensor(col, dtype=torch.int32) for col in zip(*rows))
        logits = model.decode(tokens, slots, seq_lens)
        for row, slot in enumerate(sequences):
            sequences[slot].append(int(logits[row].argmax()))
    return sequences, logits


@pytest.fixture(scope="module")
def torch_run():
    return greedy_run(LinearPlan.fixed("torch"))


# Mixed plans chain a Triton projection after a torch one that left its update pending (the
# fused residual-add prologue) and a torch norm after a Triton residual epilogue.
# The split-K tilings (O and down) share each output tile's K steps among programs.
SPLIT_TILES = {"o": gemv_tiles.Tiles(16, 16, 16, 4, False, split_k=2),
               "down": gemv_tiles.Tiles(16, 16, 32, 4, False, split_k=3)}


@pytest.mark.parametrize("backends,tiles", [
    (ALL_TRITON, None),
    ({"qkv": "triton", "o": "torch", "gate_up": "triton", "down": "torch"}, None),
    ({"qkv": "torch", "o": "triton", "gate_up": "torch", "down": "triton"}, None),
    (ALL_TRITON, SPLIT_TILES),
], ids=["triton", "norms-triton", "residuals-triton", "triton-split-k"])
def test_greedy_tokens_equal_under_triton_and_mixed_plans(torch_run, backends, tiles, monkeypatch):
    expected_tokens, expected_logits = torch_run
    launches = []
    launch = gemv._launch
    monkeypatch.setattr(gemv, "_launch", lambda *args, **kwargs: launches.append(1) or launch(*args, **kwargs))
    # Prefill rows (up to 6) and decode rows (4) both fall in the 8-row entry.
    tokens, logits = greedy_run(LinearPlan({8: backends}, tiles=tiles and {8: tiles}))
    forwards, layers = len(PROMPTS) + STEPS, ModelConfig().num_layers
    assert len(launches) == forwards * layers * list(backends.values()).count("triton")
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# The start-up timing's gate: a candidate tiling must build and agree with the unfused path


def gate_case(projection: str, rows: int = 20):
    """A layer of the tiny model (float32, CPU) and what `time_projections` feeds the gate."""
    model = LlamaModel(ModelConfig(), 2, "cpu")
    c = model.config
    gen = torch.Generator().manual_seed(rows)
    x, attn, act = (torch.randn(rows, width, generator=gen) for width in
                    (c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size))
    positions = torch.arange(rows) % c.max_seq_len
    rotary = gemv.Rotary(model.rope_cos, model.rope_sin, positions, torch.zeros_like(positions),
                         model.kv_cache.keys[0], model.kv_cache.values[0], c.num_heads, c.num_kv_heads)
    inputs = (x, attn, act, rotary, c.rms_eps, gemv_tiles.SplitKWorkspace(rows, c.hidden_size, "cpu"), None)
    layer = model.layers[0]
    return layer, inputs, linear_plan._projection_output(projection, None, layer, *inputs)


@pytest.mark.parametrize("projection", PROJECTIONS)
def test_a_candidate_tiling_that_computes_the_projection_passes_the_gate(projection, recwarn):
    layer, inputs, reference = gate_case(projection)
    split = projection in linear_plan.SPLIT_PROJECTIONS
    for tiles in linear_plan.candidate_tiles(20, 64, split=split)[-2:]:  # swapped, and split-K where it applies
        assert linear_plan._tiling_works(projection, 20, tiles, reference, layer, inputs), tiles
    assert not recwarn.list


@pytest.mark.parametrize("failure,words", [
    (lambda: (_ for _ in ()).throw(triton.compiler.errors.CompilationError("k.py", None, "bad layout")),
     r"does not build on this GPU \(CompilationError"),
    (lambda: (_ for _ in ()).throw(RuntimeError("PassManager::run failed")), "does not build on this GPU"),
    (lambda: torch.full((20, 64), float("nan")), "away from the unfused path"),
    (lambda: torch.zeros(20, 64), "away from the unfused path"),
])
def test_a_tiling_that_does_not_build_or_disagrees_is_skipped_with_a_warning(failure, words, monkeypatch):
    """If the gate let one through, the plan could keep a tiling that computes garbage because
    it was fast; one that fails to build would stop start-up instead of losing a candidate."""
    layer, inputs, reference = gate_case("o")
    tiles = gemv_tiles.Tiles(16, 16, 16, 4, False, split_k=2)
    monkeypatch.setattr(linear_plan, "_projection_output", lambda *args: failure())
    with pytest.warns(UserWarning, match=words):
        assert not linear_plan._tiling_works("o", 20, tiles, reference, layer, inputs)
