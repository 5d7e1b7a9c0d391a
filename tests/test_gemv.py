"""capture.kernels.gemv: each fused skinny-GEMM kernel (TRITON_INTERPRET=1 on CPU) against the
unfused torch reference (rms_norm, matmul, silu_mul, add), over random row counts and widths
that are and are not multiples of the tiles; the torch twins against the model's own math.

The `check_*` functions take a device: tests/gpu/test_gemv_gpu.py runs them on CUDA at
SmolLM2's shape. Tolerances (tests/test_layer_kernels.assert_matches): float32 within 1e-6
relative (only the order of float32 sums differs); bf16 within 2 ulp (a normed input one ulp
off moves a sum by less than an output ulp, and the sum order can flip a rounding), 3 after
SiLU * up (both factors can be an ulp off).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphrelay.capture.kernels import gemv, gemv_tiles
from graphrelay.capture.kernels.pdl import pdl_supported
from graphrelay.capture.model.linear_plan import candidate_tiles
from graphrelay.capture.kernels import layer_kernels as lk
from model_reference import rms_norm as model_rms_norm
from test_layer_kernels import EPS, Shape, assert_matches, randn, rotary_case

DTYPES = (torch.float32, torch.bfloat16)


def assert_close_to(actual: torch.Tensor, expected: torch.Tensor, what: str, ulps: int) -> None:
    if actual.dtype == torch.float32:
        # Sums of up to a few thousand unit-scale products: the order moves the last bits.
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=what)
        return
    # Where hundreds of products cancel to nearly zero, another float32 summation order moves
    # the result by many ulps of that tiny value (the H200: 4 ulp at -2.4e-5 in a row of unit
    # scale, one-row kernel against cuBLAS): those elements are held to an absolute bound of the
    # output's scale instead, every other element to `ulps`.
    scale = float(expected.float().abs().amax())
    tiny = expected.float().abs() < scale * 2**-8
    torch.testing.assert_close(actual.float()[tiny], expected.float()[tiny], rtol=0, atol=scale * 2**-12, msg=what)
    assert_matches(torch.where(tiny, expected, actual), expected, what, ulps)


def inputs(device: str, dtype: torch.dtype, rows: int, k: int, n: int, seed: int) -> dict[str, torch.Tensor]:
    """A layer's worth at unit scale: weights ~ k ** -0.5, the residual stream larger than the
    update added to it, as in a model."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": randn(gen, rows, k, dtype=dtype, device=device),
        "residual": randn(gen, rows, k, dtype=dtype, device=device, scale=4.0),
        "norm_weight": randn(gen, k, dtype=dtype, device=device),
        "weight": randn(gen, n, k, dtype=dtype, device=device, scale=k**-0.5),
        "gate_up": randn(gen, 2 * n, k, dtype=dtype, device=device, scale=k**-0.5),
        "stream": randn(gen, rows, n, dtype=dtype, device=device, scale=4.0),
    }


# ----------------------------------------------------------------------------------------------
# Checks shared with the GPU tests


def check_norm_linear(device, dtype, rows, k, n, *, with_residual, seed=0, pdl=None, tiles=None) -> None:
    t = inputs(device, dtype, rows, k, n, seed)
    residual = t["residual"] if with_residual else None
    before = {name: v.clone() for name, v in t.items()}
    got = gemv.norm_linear(t["x"], t["norm_weight"], t["weight"], EPS, residual=residual, backend="triton", pdl=pdl,
                           tiles=tiles)
    ref = gemv.norm_linear(t["x"], t["norm_weight"], t["weight"], EPS, residual=residual, backend="torch")
    if with_residual:
        (got, got_sum), (ref, ref_sum) = got, ref
        assert torch.equal(got_sum, ref_sum), "x + residual is one rounded add: bit for bit"
    assert_close_to(got, ref, f"norm_linear {dtype} rows={rows} k={k} n={n}", ulps=2)
    assert all(torch.equal(v, before[name]) for name, v in t.items()), "an input changed"


def check_norm_gate_up_silu(device, dtype, rows, k, n, *, with_residual, seed=0, pdl=None, tiles=None) -> None:
    t = inputs(device, dtype, rows, k, n, seed)
    residual = t["residual"] if with_residual else None
    got = gemv.norm_gate_up_silu(t["x"], t["norm_weight"], t["gate_up"], EPS, residual=residual, backend="triton",
                                 pdl=pdl, tiles=tiles)
    ref = gemv.norm_gate_up_silu(t["x"], t["norm_weight"], t["gate_up"], EPS, residual=residual, backend="torch")
    if with_residual:
        (got, got_sum), (ref, ref_sum) = got, ref
        assert torch.equal(got_sum, ref_sum)
    assert got.shape == (rows, n)
    assert_close_to(got, ref, f"norm_gate_up_silu {dtype} rows={rows} k={k} n={n}", ulps=3)


def check_linear_residual(device, dtype, rows, k, n, *, seed=0, pdl=None, tiles=None) -> None:
    t = inputs(device, dtype, rows, k, n, seed)
    ref = gemv.linear_residual(t["x"], t["weight"], t["stream"], backend="torch")
    got = gemv.linear_residual(t["x"], t["weight"], t["stream"], backend="triton", pdl=pdl, tiles=tiles)
    # The projection is rounded to the model dtype before the residual add: where the two cancel,
    # an ulp of the larger term is the unit (256 rows x 576 outputs on the H100 had such elements).
    terms = torch.maximum((t["x"] @ t["weight"].T).float().abs(), t["stream"].float().abs())
    assert_close_after_cancellation(got, ref, terms, f"linear_residual {dtype} rows={rows} k={k} n={n}", ulps=2)
    stream = t["stream"].clone()
    in_place = gemv.linear_residual(t["x"], t["weight"], stream, out=stream, backend="triton", pdl=pdl, tiles=tiles)
    assert in_place is stream and torch.equal(stream, got), "in place (out=residual) equals out of place"


def check_norm_qkv_rotary(device, dtype, rows, k, heads: Shape, *, with_residual, seed=0, pdl=None,
                          cache_rows=6, seq_len=32, tiles=None) -> None:
    """q against the unfused path's, and the caches: every entry the unfused path leaves as it
    was stays bit for bit, the written ones agree as q does."""
    width = (heads.heads + 2 * heads.kv_heads) * heads.head_dim
    t = inputs(device, dtype, rows, k, width, seed)
    case = rotary_case(heads, rows, dtype=dtype, device=device, cache_rows=cache_rows, seq_len=seq_len, seed=seed)
    residual = t["residual"] if with_residual else None
    results = {}
    for backend in ("triton", "torch"):
        rotary = gemv.Rotary(case.cos, case.sin, case.positions, case.slots, case.k_cache.clone(),
                             case.v_cache.clone(), heads.heads, heads.kv_heads)
        q = gemv.norm_qkv_rotary(t["x"], t["norm_weight"], t["weight"], EPS, rotary, residual=residual,
                                 backend=backend, pdl=pdl if backend == "triton" else None,
                                 tiles=tiles if backend == "triton" else None)
        results[backend] = (q, rotary.k_cache, rotary.v_cache)
    (got, k_got, v_got), (ref, k_ref, v_ref) = results["triton"], results["torch"]
    if with_residual:
        (got, got_sum), (ref, ref_sum) = got, ref
        assert torch.equal(got_sum, ref_sum)
    what = f"norm_qkv_rotary {dtype} rows={rows} k={k} heads={heads}"
    assert got.shape == (rows, heads.heads, heads.head_dim)
    h, kvh = heads.heads, heads.kv_heads
    pairs = rotation_pairs(t["x"], residual, t["norm_weight"], t["weight"], h + kvh, heads.head_dim)
    assert_close_after_cancellation(got, ref, pairs[:, :h], what + " q")
    for name, a, b, before in (("k", k_got, k_ref, case.k_cache), ("v", v_got, v_ref, case.v_cache)):
        untouched = (b == before).all(-1).all(-1)  # [cache_rows, seq_len]: rows the reference kept
        assert torch.equal(a[untouched], before[untouched]), f"{what}: {name} written outside the rows' entries"
        # Each row's entry (rows sit at distinct [slot, position]s, padding rows in slot 0).
        a, b = a[case.slots, case.positions], b[case.slots, case.positions]
        if name == "k":
            assert_close_after_cancellation(a, b, pairs[:, h:], f"{what} k_cache")
        else:
            assert_close_to(a, b, f"{what} v_cache", ulps=2)


def rotation_pairs(x, residual, norm_weight, weight, heads, head_dim) -> torch.Tensor:
    """`[rows, heads, head_dim]`: for each rotated output element, the larger magnitude of the two
    unrotated projections the rotation mixes into it (columns j and j + d/2 of its head), from
    the unfused path (float32)."""
    h = x if residual is None else x + residual
    projected = gemv.norm_linear(h, norm_weight, weight[: heads * head_dim], EPS, backend="torch").float().abs()
    halves = projected.view(x.shape[0], heads, 2, head_dim // 2)
    larger = torch.maximum(halves[:, :, 0], halves[:, :, 1])
    return torch.cat([larger, larger], dim=-1)


def assert_close_after_cancellation(actual, expected, terms, what, ulps=2) -> None:
    """Values within `ulps` ulp, or where a sum of rounded terms cancels (x cos - y sin with
    both near equal; a rounded projection plus a residual near its negative) within `ulps` ulp
    of `terms`, the larger term's magnitude per element: a term one ulp off (another float32
    sum order) moves the result by that much, however small the result is."""
    if actual.dtype == torch.float32:
        assert_close_to(actual, expected, what, ulps)
        return
    ulp_of_term = torch.exp2(torch.floor(torch.log2(terms.clamp_min(2**-126))) - 7)  # bf16: 8 significant bits
    cancelled = (expected.float().abs() < terms / 2) & ((actual.float() - expected.float()).abs()
                                                        <= 2 * ulps * ulp_of_term)
    assert_close_to(torch.where(cancelled, expected, actual), expected, what, ulps)


# ----------------------------------------------------------------------------------------------
# Triton (interpreted) against the unfused reference, random shapes

SHAPES = dict(
    rows=st.integers(1, 8),
    k=st.one_of(st.sampled_from([16, 64]), st.integers(1, 150)),  # tile multiples, and not
    n=st.one_of(st.sampled_from([16, 48]), st.integers(1, 70)),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
FEW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FEW
@given(**SHAPES, with_residual=st.booleans())
def test_norm_linear_equals_unfused(rows, k, n, dtype, seed, with_residual):
    check_norm_linear("cpu", dtype, rows, k, n, with_residual=with_residual, seed=seed)


@FEW
@given(**SHAPES, with_residual=st.booleans())
def test_norm_gate_up_silu_equals_unfused(rows, k, n, dtype, seed, with_residual):
    check_norm_gate_up_silu("cpu", dtype, rows, k, n, with_residual=with_residual, seed=seed)


HEADS = [Shape(0, 4, 2, 16, 0), Shape(0, 3, 1, 6, 0), Shape(0, 1, 1, 2, 0), Shape(0, 2, 2, 40, 0)]


@FEW
@given(rows=SHAPES["rows"], k=SHAPES["k"], heads=st.sampled_from(HEADS), dtype=SHAPES["dtype"],
       seed=SHAPES["seed"], with_residual=st.booleans())
def test_norm_qkv_rotary_equals_unfused(rows, k, heads, dtype, seed, with_residual):
    check_norm_qkv_rotary("cpu", dtype, rows, k, heads, with_residual=with_residual, seed=seed)


@FEW
@given(**SHAPES)
def test_linear_residual_equals_unfused(rows, k, n, dtype, seed):
    check_linear_residual("cpu", dtype, rows, k, n, seed=seed)


# bf16 K steps of 256 (norm kernels) and 1024 / 256 (projection + residual at 16 / 64-row
# tiles), half that in float32: K = 600 and 1100 take several, the last partial; rows 70 take
# two row tiles. Up to gemv_tiles.FMA_MAX_ROWS rows, one row per program: K = 2500 takes two steps
# of FMA_MAX_K, the last partial.
@pytest.mark.parametrize("rows,k", [(33, 600), (70, 40), (17, 300), (3, 1100), (2, 2500), (1, 64)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_several_k_steps_and_row_tiles(rows, k, dtype):
    check_norm_linear("cpu", dtype, rows, k, 20, with_residual=True)
    check_norm_gate_up_silu("cpu", dtype, rows, k, 20, with_residual=False)
    check_linear_residual("cpu", dtype, rows, k, 20)
    check_norm_qkv_rotary("cpu", dtype, rows, k, HEADS[0], with_residual=True, cache_rows=9, seq_len=64)


# Every tiling start-up timing may pick (capture.model.linear_plan.candidate_tiles) computes
# the same as the unfused path: one-row-per-program and multi-row FMA tiles, tensor-core tiles
# of 16-64 rows, with K in one step and in several.
@pytest.mark.parametrize("rows", [1, 3, 8, 20, 80])
@pytest.mark.parametrize("k", [40, 600])
def test_every_candidate_tiling_equals_unfused(rows, k):
    for tiles in candidate_tiles(rows, k):
        check_norm_linear("cpu", torch.bfloat16, rows, k, 20, with_residual=True, tiles=tiles)
        check_norm_gate_up_silu("cpu", torch.bfloat16, rows, k, 20, with_residual=True, tiles=tiles)
        check_norm_qkv_rotary("cpu", torch.bfloat16, rows, k, HEADS[0], with_residual=False, tiles=tiles)
    for tiles in candidate_tiles(rows, k, split=True):  # O and down: split-K tilings too
        check_linear_residual("cpu", torch.bfloat16, rows, k, 20, tiles=tiles)


def check_early_equals_late(device, dtype, rows, k, tiles: gemv_tiles.Tiles, seed=0) -> None:
    """A tiling that requests its epilogue inputs before the K loop computes what it does after
    it, bit for bit (only the loads move), for all four fused projections."""
    heads = HEADS[0]
    width = (heads.heads + 2 * heads.kv_heads) * heads.head_dim
    t = inputs(device, dtype, rows, k, width, seed)
    case = rotary_case(heads, rows, dtype=dtype, device=device, cache_rows=9, seq_len=64, seed=seed)
    results = []
    for variant in (tiles._replace(early=False), tiles._replace(early=True)):
        rotary = gemv.Rotary(case.cos, case.sin, case.positions, case.slots, case.k_cache.clone(),
                             case.v_cache.clone(), heads.heads, heads.kv_heads)
        q, summed = gemv.norm_qkv_rotary(t["x"], t["norm_weight"], t["weight"], EPS, rotary, residual=t["residual"],
                                         backend="triton", tiles=variant)
        act = gemv.norm_gate_up_silu(t["x"], t["norm_weight"], t["gate_up"], EPS, backend="triton", tiles=variant)
        down = gemv.linear_residual(t["x"], t["weight"], t["stream"], backend="triton", tiles=variant)
        results.append([q, summed, rotary.k_cache, rotary.v_cache, act, down])
    for index, (late, early) in enumerate(zip(*results)):
        assert torch.equal(late, early), f"{tiles} rows={rows} k={k}: output {index} differs with early=True"


@pytest.mark.parametrize("tiles", [gemv_tiles.Tiles(1, 4, 64, 4, True), gemv_tiles.Tiles(16, 16, 64, 4, False, early=True),
                                   gemv_tiles.Tiles(16, 16, 64, 4, False)])
def test_settled_rotary_inputs_change_no_bit(tiles):
    # Rotary.settled moves the position, slot and table loads before the PDL wait (where the
    # tiling requests its epilogue inputs early) and past L1: the same bits, whichever tiling.
    heads, rows, k = HEADS[0], 5 if tiles.fma else 20, 40
    width = (heads.heads + 2 * heads.kv_heads) * heads.head_dim
    t = inputs("cpu", torch.bfloat16, rows, k, width, seed=3)
    case = rotary_case(heads, rows, dtype=torch.bfloat16, device="cpu", cache_rows=9, seq_len=64, seed=3)
    results = []
    for settled in (False, True):
        rotary = gemv.Rotary(case.cos, case.sin, case.positions, case.slots, case.k_cache.clone(),
                             case.v_cache.clone(), heads.heads, heads.kv_heads, settled=settled)
        q = gemv.norm_qkv_rotary(t["x"], t["norm_weight"], t["weight"], EPS, rotary, backend="triton", tiles=tiles)
        results.append((q, rotary.k_cache, rotary.v_cache))
    for index, (plain, settled) in enumerate(zip(*results)):
        assert torch.equal(plain, settled), f"{tiles}: output {index} differs with settled=True"
    assert not torch.equal(results[0][1], case.k_cache)  # the keys were written at all


def check_float8_cache(device, dtype, rows, k, tiles: gemv_tiles.Tiles | None = None, seed=0) -> None:
    """The fused QKV kernel into a float8 cache (capture.model.kv_cache) stores what it stores
    into a model-dtype cache, cast by torch (nearest even, saturating), and the same q."""
    heads = HEADS[0]
    width = (heads.heads + 2 * heads.kv_heads) * heads.head_dim
    t = inputs(device, dtype, rows, k, width, seed)
    t["weight"][-heads.head_dim:] *= 2000.0  # one v head far beyond e4m3's +-448: it saturates
    case = rotary_case(heads, rows, dtype=dtype, device=device, cache_rows=9, seq_len=64, seed=seed)
    results = []
    for cache_dtype in (dtype, torch.float8_e4m3fn):
        rotary = gemv.Rotary(case.cos, case.sin, case.positions, case.slots, case.k_cache.to(cache_dtype),
                             case.v_cache.to(cache_dtype), heads.heads, heads.kv_heads)
        q = gemv.norm_qkv_rotary(t["x"], t["norm_weight"], t["weight"], EPS, rotary, backend="triton", tiles=tiles)
        results.append((q, rotary.k_cache, rotary.v_cache))
    (q, k_model, v_model), (q8, k8, v8) = results
    assert torch.equal(q, q8)
    for name, model, float8 in (("k", k_model, k8), ("v", v_model, v8)):
        cast = lk.to_cache_dtype(model, torch.float8_e4m3fn)
        assert torch.equal(float8.view(torch.uint8), cast.view(torch.uint8)), f"{tiles} {name}_cache"
    assert v8.float().abs().max() == 448.0 and v_model.float().abs().max() > 448.0


@pytest.mark.parametrize("tiles", [None, gemv_tiles.Tiles(1, 4, 64, 4, True), gemv_tiles.Tiles(16, 16, 64, 4, False)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qkv_into_a_float8_cache_rounds_as_torch_casts(dtype, tiles):
    check_float8_cache("cpu", dtype, 5 if tiles is not None and tiles.fma else 20, 40, tiles)


@pytest.mark.parametrize("rows,k", [(20, 40), (80, 600)])
def test_early_epilogue_inputs_change_no_bit(rows, k):
    check_early_equals_late("cpu", torch.bfloat16, rows, k, gemv_tiles.Tiles(16, 16, 64, 4, False))


# Swapped tiles (the weight as the dot's M side) against the unfused path over random shapes:
# row counts across one and several row tiles, K and N that are and are not tile multiples.
@given(rows=st.integers(1, 40), k=st.one_of(st.sampled_from([64, 128]), st.integers(1, 200)),
       n=st.one_of(st.sampled_from([64]), st.integers(1, 90)), dtype=st.sampled_from(DTYPES),
       block_m=st.sampled_from([16, 32]), seed=st.integers(0, 2**16))
@FEW
def test_swapped_tiles_equal_unfused(rows, k, n, dtype, block_m, seed):
    tiles = gemv_tiles.Tiles(block_m, 64, 64, 4, False, swap=True)
    check_norm_linear("cpu", dtype, rows, k, n, with_residual=seed % 2 == 0, seed=seed, tiles=tiles)
    check_norm_gate_up_silu("cpu", dtype, rows, k, n, with_residual=seed % 2 == 1, seed=seed, tiles=tiles)
    check_linear_residual("cpu", dtype, rows, k, n, seed=seed, tiles=tiles)
    check_norm_qkv_rotary("cpu", dtype, rows, k, HEADS[seed % len(HEADS)], with_residual=seed % 2 == 0, seed=seed,
                          cache_rows=6, seq_len=64, tiles=tiles)


# Split-K tilings against the unfused path over random shapes: K steps that do and do not divide
# among the splits (some splits then get none), several row and column tiles; the same bits
# every call (the last split sums the partials in split order), the counters left at zero.
@given(rows=st.integers(1, 40), k=st.one_of(st.sampled_from([16, 128]), st.integers(1, 300)),
       n=st.one_of(st.sampled_from([16, 48]), st.integers(1, 70)), dtype=st.sampled_from(DTYPES),
       split_k=st.integers(2, gemv_tiles.MAX_SPLIT_K), block_k=st.sampled_from([16, 32, 64]), swap=st.booleans(),
       seed=st.integers(0, 2**16))
@FEW
def test_split_k_tiles_equal_unfused_and_repeat_bit_for_bit(rows, k, n, dtype, split_k, block_k, swap, seed):
    tiles = gemv_tiles.Tiles(16, 64 if swap else 16, block_k, 4, False, swap=swap, split_k=split_k)
    check_linear_residual("cpu", dtype, rows, k, n, seed=seed, tiles=tiles)
    t = inputs("cpu", dtype, rows, k, n, seed)
    workspace = gemv_tiles.SplitKWorkspace(rows, n, "cpu")
    first, again = (gemv.linear_residual(t["x"], t["weight"], t["stream"], backend="triton", tiles=tiles,
                                         workspace=workspace) for _ in range(2))
    assert torch.equal(first, again)
    assert not workspace.done.any(), "the last split of each tile resets its counter"


def test_split_k_is_refused_where_it_does_not_apply_and_beyond_its_workspace():
    t = inputs("cpu", torch.float32, 20, 64, 48, seed=0)
    split = gemv_tiles.Tiles(16, 16, 16, 4, False, split_k=2)
    with pytest.raises(ValueError, match="split_k tilings serve linear_residual only"):
        gemv.norm_linear(t["x"], t["norm_weight"], t["weight"], EPS, backend="triton", tiles=split)
    with pytest.raises(ValueError, match="split_k tilings serve linear_residual only"):
        gemv.norm_gate_up_silu(t["x"], t["norm_weight"], t["gate_up"], EPS, backend="triton", tiles=split)
    small = gemv_tiles.SplitKWorkspace(8, 48, "cpu")
    stream = t["stream"].clone()
    with pytest.raises(ValueError, match="too few for 20 x 48 outputs"):
        gemv.linear_residual(t["x"], t["weight"], stream, out=stream, backend="triton", tiles=split, workspace=small)
    assert torch.equal(stream, t["stream"]), "refused before any launch"


@pytest.mark.parametrize("tiles,match", [
    ((1, 4, 1024, 4, True), "must be a gemv_tiles.Tiles"),
    (gemv_tiles.Tiles(16, 16, 64, 4, False, split_k=0), "split_k must be an int in 1..8"),
    (gemv_tiles.Tiles(16, 16, 64, 4, False, split_k=9), "split_k must be an int in 1..8"),
    (gemv_tiles.Tiles(16, 16, 64, 4, False, split_k=2.0), "split_k must be an int"),
    (gemv_tiles.Tiles(1, 4, 1024, 4, True, split_k=2), "an FMA tile takes 1"),
    (gemv_tiles.Tiles(16, 16, 64, 4, False, stages=0), "stages must be an int in 1..8"),
    (gemv_tiles.Tiles(16, 16, 64, 4, False, stages=9), "stages must be an int in 1..8"),
    (gemv_tiles.Tiles(16, 16, 64, 4, False, stages=True), "stages must be an int"),
    (gemv_tiles.Tiles(16, 16, 64, 4, False, 1), "must be bools"),
    (gemv_tiles.Tiles(16, 16, 64, 4, False, swap=1), "must be bools"),
    (gemv_tiles.Tiles(1, 4, 1024, 4, True, swap=True), "an FMA tile has none"),
    (gemv_tiles.Tiles(3, 4, 1024, 4, True), "powers of two"),
    (gemv_tiles.Tiles(1, 4, 1024, 6, True), "powers of two"),
    (gemv_tiles.Tiles(8, 16, 64, 4, False), "needs block_m, block_n, block_k >= 16"),
])
def test_bad_tiles_are_rejected_before_a_launch(tiles, match):
    t = inputs("cpu", torch.float32, 2, 8, 6, seed=0)
    stream = t["stream"].clone()
    with pytest.raises(ValueError, match=match):
        gemv.linear_residual(t["x"], t["weight"], stream, out=stream, backend="triton", tiles=tiles)
    assert torch.equal(stream, t["stream"])


@pytest.mark.parametrize("tiles,norm,asked", [
    # What the H100 (Triton 3.6) asked of shared memory for the tilings it refused at 8 stages,
    # each a norm projection with a residual (results/deep_stages_h100.txt).
    (gemv_tiles.Tiles(64, 32, 128, 4, False, stages=8), True, 368640),  # gate/up
    (gemv_tiles.Tiles(64, 64, 64, 4, False, stages=8), True, 254848),  # gate/up
])
def test_pipeline_bytes_bound_what_the_h100_asked(tiles, norm, asked):
    assert asked <= gemv_tiles.pipeline_bytes(tiles, norm) <= asked + 2048


def test_pipeline_bytes_follow_stages_operands_and_dtype():
    tile = gemv_tiles.Tiles(64, 32, 64, 4, False, stages=8)
    # Those the H100 built at 8 stages fit its 227 KB; a norm projection's step buffers twice the rows.
    assert gemv_tiles.pipeline_bytes(tile, norm=True) <= 232448
    assert gemv_tiles.pipeline_bytes(gemv_tiles.Tiles(64, 32, 128, 4, False, stages=8), norm=False) <= 232448
    step = gemv_tiles.pipeline_bytes(tile._replace(stages=2), norm=False) - gemv_tiles.PIPELINE_OVERHEAD_BYTES
    assert step == (64 + 32) * 64 * 2
    assert gemv_tiles.pipeline_bytes(tile, norm=True) == 7 * 2 * step + gemv_tiles.PIPELINE_OVERHEAD_BYTES
    # float32 keeps at most TC_STAGES_FLOAT32 steps of twice the bytes; FMA tiles buffer no steps.
    assert gemv_tiles.pipeline_stages(tile, 4) == gemv_tiles.TC_STAGES_FLOAT32 < gemv_tiles.pipeline_stages(tile, 2)
    assert gemv_tiles.pipeline_bytes(tile, norm=False, element_bytes=4) == 2 * step + gemv_tiles.PIPELINE_OVERHEAD_BYTES
    assert gemv_tiles.pipeline_bytes(gemv_tiles.Tiles(1, 4, 1024, 4, True), norm=True) == 0


# ----------------------------------------------------------------------------------------------
# The torch twins are the model's math


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_torch_twins_equal_the_model_math(dtype):
    t = inputs("cpu", dtype, 5, 40, 24, seed=3)
    x, residual, nw, w, gate_up, stream = (t[k] for k in ("x", "residual", "norm_weight", "weight", "gate_up", "stream"))
    total = residual + x
    y, got_total = gemv.norm_linear(x, nw, w, EPS, residual=residual, backend="torch")
    assert torch.equal(got_total, total) and torch.equal(y, model_rms_norm(total, nw, EPS) @ w.T)
    assert torch.equal(gemv.norm_linear(x, nw, w, EPS, backend="torch"), model_rms_norm(x, nw, EPS) @ w.T)
    gate, up = (model_rms_norm(x, nw, EPS) @ gate_up.T).chunk(2, dim=-1)
    assert torch.equal(gemv.norm_gate_up_silu(x, nw, gate_up, EPS, backend="torch"),
                       torch.nn.functional.silu(gate) * up)
    assert torch.equal(gemv.linear_residual(x, w, stream, backend="torch"), stream + x @ w.T)


@pytest.mark.parametrize("backend", lk.BACKENDS)
def test_out_buffers_are_filled(backend):
    t = inputs("cpu", torch.float32, 3, 40, 24, seed=4)
    out, total_out = torch.full((3, 24), float("nan")), torch.full((3, 40), float("nan"))
    y, total = gemv.norm_linear(t["x"], t["norm_weight"], t["weight"], EPS, residual=t["residual"], out=out,
                                residual_out=total_out, backend=backend)
    assert y is out and total is total_out
    assert torch.equal(total_out, t["x"] + t["residual"]) and not out.isnan().any()
    act = torch.full((3, 24), float("nan"))
    assert gemv.norm_gate_up_silu(t["x"], t["norm_weight"], t["gate_up"], EPS, out=act, backend=backend) is act
    assert not act.isnan().any()


# ----------------------------------------------------------------------------------------------
# Validation


def _bad(**overrides):
    t = inputs("cpu", torch.float32, 2, 8, 6, seed=0)
    return {**t, **overrides}


def _rotary(heads: int = 1) -> gemv.Rotary:
    """For `_bad()`'s width-6 projection: 1 q head, 1 KV head, head_dim 2."""
    cache = torch.zeros(3, 8, 1, 2)
    index = torch.zeros(2, dtype=torch.int64)
    return gemv.Rotary(torch.ones(8, 2), torch.zeros(8, 2), index, index, cache, cache.clone(), heads, 1)


BAD_CALLS = {
    "norm weight width": (lambda b: gemv.norm_linear(
        (t := _bad())["x"], torch.ones(7), t["weight"], EPS, backend=b), "norm_weight must be"),
    "weight width": (lambda b: gemv.norm_linear(
        (t := _bad())["x"], t["norm_weight"], torch.ones(6, 9), EPS, backend=b), "norm_linear weight must be"),
    "weight dtype": (lambda b: gemv.linear_residual(
        (t := _bad())["x"], t["weight"].bfloat16(), t["stream"], backend=b), "weight must be a torch.float32"),
    "odd gate_up": (lambda b: gemv.norm_gate_up_silu(
        (t := _bad())["x"], t["norm_weight"], torch.ones(5, 8), EPS, backend=b), "even"),
    "residual_out aliases x": (lambda b: gemv.norm_linear(
        (t := _bad())["x"], t["norm_weight"], t["weight"], EPS, residual=t["residual"], residual_out=t["x"],
        backend=b), "must not alias"),
    "residual_out alone": (lambda b: gemv.norm_linear(
        (t := _bad())["x"], t["norm_weight"], t["weight"], EPS, residual_out=t["residual"], backend=b),
        "needs residual"),
    "stream shape": (lambda b: gemv.linear_residual(
        (t := _bad())["x"], t["weight"], torch.ones(2, 7), backend=b), "residual must be"),
    "out shape": (lambda b: gemv.norm_gate_up_silu(
        (t := _bad())["x"], t["norm_weight"], t["gate_up"], EPS, out=torch.ones(2, 12), backend=b),
        "out must be"),
    "rotary not a Rotary": (lambda b: gemv.norm_qkv_rotary(
        (t := _bad())["x"], t["norm_weight"], t["weight"], EPS, rotary=(), backend=b), "gemv.Rotary"),
    "qkv width": (lambda b: gemv.norm_qkv_rotary(
        (t := _bad())["x"], t["norm_weight"], t["weight"], EPS, _rotary(heads=2), backend=b), "qkv width 6"),
    "rotary q_out": (lambda b: gemv.norm_qkv_rotary(
        (t := _bad())["x"], t["norm_weight"], t["weight"], EPS, _rotary(), q_out=torch.ones(2, 6), backend=b),
        "q_out must be"),
    "x not contiguous": (lambda b: gemv.linear_residual(
        torch.ones(8, 2).t(), (t := _bad())["weight"], t["stream"], backend=b), "contiguous"),
}


@pytest.mark.parametrize("backend", lk.BACKENDS)
@pytest.mark.parametrize("case", BAD_CALLS, ids=list(BAD_CALLS))
def test_bad_inputs_are_rejected_by_both_backends(case, backend):
    call, match = BAD_CALLS[case]
    with pytest.raises(ValueError, match=match):
        call(backend)


def test_pdl_on_a_cpu_is_refused_and_auto_is_off():
    t = _bad()
    assert not pdl_supported(torch.device("cpu"))
    with pytest.raises(ValueError, match="pdl=True needs a CUDA device"):
        gemv.linear_residual(t["x"], t["weight"], t["stream"], backend="triton", pdl=True)
    stream = t["stream"].clone()
    gemv.linear_residual(t["x"], t["weight"], stream, out=stream, backend="triton")  # pdl=None: off here
    assert not torch.equal(stream, t["stream"])
