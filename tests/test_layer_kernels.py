"""capture.layer_kernels: each Triton kernel (TRITON_INTERPRET=1 on CPU) equals its torch twin,
and each torch twin equals capture/model/model.py's math, so integrating them cannot change CPU numerics.

The `check_*` functions take a device: tests/gpu/test_layer_kernels_gpu.py runs them on CUDA at
serving sizes. Tolerances (the module docstring says why): float32 within 1e-6; bf16/fp16
within 1 ulp, 2 where a general weight / `up` multiplies an output already 1 ulp off; rotary
bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch

from graphrelay.capture.kernels import layer_kernels as lk
from graphrelay.capture.model.model import ModelConfig
from model_reference import rms_norm as model_rms_norm
from model_reference import split_qkv, swiglu_mlp

EPS = 1e-5


class Shape(NamedTuple):
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int


SMOL = Shape(576, 9, 3, 64, 1536)  # SmolLM2-135M
TINY = Shape(64, 4, 2, 16, 128)  # the `tiny` preset
ODD = Shape(40, 3, 1, 6, 600)  # no power of two anywhere, head_dim / 2 odd, 600 = 512 + 88
SHAPES = pytest.mark.parametrize("shape", [SMOL, TINY, ODD], ids=["smol", "tiny", "odd"])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, device: str, scale: float = 1.0) -> torch.Tensor:
    """Drawn on the CPU so every device sees the same values."""
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def powers_of_two(gen: torch.Generator, *shape: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Random signs times 2^-2..2^2: products with these are exact, so a 1-ulp difference in
    what they scale stays 1 ulp."""
    exponents = torch.randint(-2, 3, shape, generator=gen).float()
    signs = torch.randint(0, 2, shape, generator=gen).float() * 2 - 1
    return (signs * exponents.exp2()).to(device=device, dtype=dtype)


def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Floats as integers in value order (+0 == -0): neighbouring floats differ by 1."""
    if t.dtype == torch.float32:
        bits = t.view(torch.int32).long()
        magnitude = bits & 0x7FFFFFFF
    else:
        bits = t.view(torch.int16).int()
        magnitude = bits & 0x7FFF
    return torch.where(bits < 0, -magnitude, magnitude)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, what: str, ulps: int = 1) -> None:
    """float32: within 1e-6. Half types: within `ulps` ulp, and at most 1% of the elements not
    bit-equal (a systematic error, e.g. truncating instead of rounding, misses about half)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6, msg=what)
        return
    dist = (ordered_bits(actual) - ordered_bits(expected)).abs().flatten()
    worst = int(dist.argmax())
    assert dist[worst] <= ulps, (f"{what}: {int(dist[worst])} ulp apart at flat index {worst}: "
                                 f"{actual.flatten()[worst].item()} vs {expected.flatten()[worst].item()}")
    differ = int((dist > 0).sum())
    assert differ <= max(1, dist.numel() // 100), f"{what}: {differ} of {dist.numel()} elements differ"


# ----------------------------------------------------------------------------------------------
# Checks shared with the GPU tests


def check_rms_norm(device: str, dtype: torch.dtype, hidden: int, n: int, *, with_residual: bool, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = randn(gen, n, hidden, dtype=dtype, device=device)
    # The residual stream is larger than the update added to it, as in a model.
    residual = randn(gen, n, hidden, dtype=dtype, device=device, scale=4.0) if with_residual else None
    inputs = [t.clone() for t in (x, residual) if t is not None]
    weights = ((powers_of_two(gen, hidden, dtype=dtype, device=device), 1),
               (randn(gen, hidden, dtype=dtype, device=device), 2))
    for weight, ulps in weights:
        ref = lk.rms_norm(x, weight, EPS, residual=residual, backend="torch")
        got = lk.rms_norm(x, weight, EPS, residual=residual, backend="triton")
        if with_residual:
            (ref, ref_sum), (got, got_sum) = ref, got
            assert torch.equal(got_sum, ref_sum), "x + residual is one rounded add: bit for bit"
        assert_matches(got, ref, f"rms_norm {dtype} hidden={hidden} n={n}", ulps)
    assert all(torch.equal(a, b) for a, b in zip(inputs, (t for t in (x, residual) if t is not None)))


class RotaryCase(NamedTuple):
    qkv: torch.Tensor  # [n, (h + 2 kvh) d]
    cos: torch.Tensor  # [seq_len, d] float32
    sin: torch.Tensor
    positions: torch.Tensor  # [n]
    slots: torch.Tensor  # [n], 0 for padding rows
    k_cache: torch.Tensor  # [cache_rows, seq_len, kvh, d], random: any stray write shows
    v_cache: torch.Tensor


def rotary_case(shape: Shape, n: int, *, dtype: torch.dtype, device: str, cache_rows: int, seq_len: int,
                index_dtype: torch.dtype = torch.int64, seed: int = 0) -> RotaryCase:
    """Live rows at distinct [slot, position], the first three at positions 0, seq_len // 2 and
    seq_len - 1; a quarter of the others are padding rows (slot 0, distinct positions)."""
    assert cache_rows >= 4, "the forced rows use slots 1..3"
    gen = torch.Generator().manual_seed(seed)
    h, kvh, d = shape.heads, shape.kv_heads, shape.head_dim
    forced = torch.tensor([0, seq_len + seq_len // 2, 3 * seq_len - 1])[:n]  # slots 1, 2, 3
    rest = torch.randperm((cache_rows - 1) * seq_len, generator=gen)
    rest = rest[~torch.isin(rest, forced)][: n - len(forced)]
    flat = torch.cat([forced, rest])
    slots, positions = flat // seq_len + 1, flat % seq_len
    pad = len(rest) // 4
    assert pad <= seq_len
    slots[len(forced):len(forced) + pad] = 0
    positions[len(forced):len(forced) + pad] = torch.randperm(seq_len, generator=gen)[:pad]
    order = torch.randperm(n, generator=gen)
    # Random angles, not a real table: both halves of a row differ and every row is distinct.
    angles = torch.rand(seq_len, d, generator=gen) * 6.3
    cache_shape = (cache_rows, seq_len, kvh, d)
    return RotaryCase(
        qkv=randn(gen, n, (h + 2 * kvh) * d, dtype=dtype, device=device),
        cos=angles.cos().to(device), sin=angles.sin().to(device),
        positions=positions[order].to(device=device, dtype=index_dtype),
        slots=slots[order].to(device=device, dtype=index_dtype),
        k_cache=randn(gen, *cache_shape, dtype=dtype, device=device),
        v_cache=randn(gen, *cache_shape, dtype=dtype, device=device),
    )


def run_rotary(case: RotaryCase, shape: Shape, backend: str, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k_cache, v_cache) after the op, on copies of the case's caches."""
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    q = lk.rotary_and_cache_write(case.qkv, case.cos, case.sin, case.positions, k_cache, v_cache, case.slots,
                                  shape.heads, shape.kv_heads, backend=backend, **kwargs)
    return q, k_cache, v_cache


def check_rotary(device: str, dtype: torch.dtype, shape: Shape, n: int, *, cache_rows: int, seq_len: int,
                 index_dtype: torch.dtype = torch.int64) -> None:
    case = rotary_case(shape, n, dtype=dtype, device=device, cache_rows=cache_rows, seq_len=seq_len,
                       index_dtype=index_dtype)
    ref = run_rotary(case, shape, "torch")
    got = run_rotary(case, shape, "triton")
    for name, a, b in zip(("q", "k_cache", "v_cache"), got, ref):
        assert torch.equal(a, b), f"rotary {name}, {dtype} n={n}: not bit for bit"
    # Where the writes land, independently of the torch twin: v is copied raw to exactly the
    # rows' [slot, position] and nothing else changes (k: nothing outside those entries).
    kvh, d = shape.kv_heads, shape.head_dim
    slots, positions = case.slots.long(), case.positions.long()
    v_new = case.qkv[:, (shape.heads + kvh) * d:].view(n, kvh, d)
    expected_v = case.v_cache.clone()
    expected_v[slots, positions] = v_new  # distinct [slot, position] per row, padding included
    assert torch.equal(got[2], expected_v)
    written = torch.zeros(cache_rows, seq_len, dtype=torch.bool, device=device)
    written[slots, positions] = True
    assert torch.equal(got[1][~written], case.k_cache[~written])


def check_silu_mul(device: str, dtype: torch.dtype, inter: int, n: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    gate_up = randn(gen, n, 2 * inter, dtype=dtype, device=device, scale=3.0)
    # exp(-gate) overflows to inf for -100: silu is then -0, as in torch.
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -1e-3])
    ref = lk.silu_mul(gate_up, backend="torch")
    assert_matches(lk.silu_mul(gate_up, backend="triton"), ref, f"silu_mul {dtype} I={inter} n={n}", ulps=2)
    # With `up` a power of two the final product is exact: only silu's own rounding remains.
    gate_up[:, inter:] = powers_of_two(gen, n, inter, dtype=dtype, device=device)
    ref = lk.silu_mul(gate_up, backend="torch")
    assert_matches(lk.silu_mul(gate_up, backend="triton"), ref, f"silu_mul {dtype} I={inter} n={n}, up 2^k", ulps=1)


# ----------------------------------------------------------------------------------------------
# Triton (interpreted) against the torch twins


@DTYPES
@SHAPES
@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_triton_equals_torch(dtype, shape, n, with_residual):
    check_rms_norm("cpu", dtype, shape.hidden, n, with_residual=with_residual)


@pytest.mark.parametrize("backend", lk.BACKENDS)
def test_rms_norm_fills_out_and_updates_the_residual_in_place(backend):
    gen = torch.Generator().manual_seed(1)
    x, residual = (randn(gen, 5, SMOL.hidden, dtype=torch.bfloat16, device="cpu") for _ in range(2))
    weight = randn(gen, SMOL.hidden, dtype=torch.bfloat16, device="cpu")
    normed, total = lk.rms_norm(x, weight, EPS, residual=residual, backend=backend)
    for alias in ("residual", "x"):  # residual_out may be either input
        x_, residual_ = x.clone(), residual.clone()
        out = torch.full_like(x, float("nan"))
        target = residual_ if alias == "residual" else x_
        got, got_total = lk.rms_norm(x_, weight, EPS, residual=residual_, out=out, residual_out=target,
                                     backend=backend)
        assert got is out and got_total is target
        assert torch.equal(out, normed) and torch.equal(target, total), alias
    out = torch.empty_like(x)
    assert lk.rms_norm(x, weight, EPS, out=out, backend=backend) is out
    assert torch.equal(out, lk.rms_norm(x, weight, EPS, backend=backend))


@pytest.mark.parametrize("backend", lk.BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_of_chosen_rows_equals_the_norm_of_those_rows(backend, dtype, with_residual):
    """The model's last norm gathers the rows that sample in its own node: each output row is,
    bit for bit, the norm of its row (of x + residual), in the rows' order, repeats included;
    x and residual are left as they were."""
    gen = torch.Generator().manual_seed(2)
    x, residual = (randn(gen, 9, SMOL.hidden, dtype=dtype, device="cpu") for _ in range(2))
    weight = randn(gen, SMOL.hidden, dtype=dtype, device="cpu")
    before = (x.clone(), residual.clone())
    res = residual if with_residual else None
    full = lk.rms_norm(x, weight, EPS, residual=res, backend=backend)
    full = full[0] if with_residual else full
    for rows in (torch.tensor([8, 0, 3, 3]), torch.tensor([5], dtype=torch.int32), torch.arange(9)):
        out = torch.full((rows.shape[0], SMOL.hidden), float("nan"), dtype=dtype)
        got = lk.rms_norm(x, weight, EPS, residual=res, rows=rows, out=out, backend=backend)
        assert got is out and torch.equal(got, full[rows.long()]), rows.tolist()
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])


@DTYPES
@SHAPES
@pytest.mark.parametrize("n", [1, 3, 17])
def test_rotary_triton_equals_torch(dtype, shape, n):
    check_rotary("cpu", dtype, shape, n, cache_rows=6, seq_len=32)


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bytes: comparable where torch has no float8 comparison on the CPU."""
    return t.contiguous().view(torch.uint8)


def check_rotary_float8(device: str, dtype: torch.dtype, shape: Shape, n: int) -> None:
    """An opt-in float8 cache (capture.model.kv_cache) holds what a model-dtype cache would,
    cast by torch (nearest even, ties included: a bf16 value ties on the e4m3 grid one time in
    sixteen), saturating at +-448 (`to_cache_dtype`), in both backends; q is untouched by the
    cache's dtype."""
    case = rotary_case(shape, n, dtype=dtype, device=device, cache_rows=6, seq_len=32)
    qkv = case.qkv.clone()
    # v beyond e4m3's range saturates; NaN stays NaN
    qkv[0, -4:] = torch.tensor([1000.0, -600.0, 447.0, float("nan")], device=device)
    case = case._replace(qkv=qkv)
    q_ref, k_ref, v_ref = run_rotary(case, shape, "torch")
    float8 = case._replace(k_cache=case.k_cache.to(torch.float8_e4m3fn), v_cache=case.v_cache.to(torch.float8_e4m3fn))
    for backend in ("torch", "triton"):
        q, k_cache, v_cache = run_rotary(float8, shape, backend)
        assert torch.equal(q, q_ref), backend
        for name, got, want in (("k", k_cache, k_ref), ("v", v_cache, v_ref)):
            assert torch.equal(bytes_of(got), bytes_of(lk.to_cache_dtype(want, torch.float8_e4m3fn))), \
                f"{backend} {name}_cache"
    assert v_cache.float().nan_to_num().abs().max() == 448.0 and v_cache.float().isnan().sum() == 1


@DTYPES
@SHAPES
@pytest.mark.parametrize("n", [1, 17])
def test_rotary_into_a_float8_cache_rounds_as_torch_casts(dtype, shape, n):
    check_rotary_float8("cpu", dtype, shape, n)


def test_rotary_takes_int32_indices_and_fills_q_out():
    case = rotary_case(TINY, 9, dtype=torch.float32, device="cpu", cache_rows=4, seq_len=16,
                       index_dtype=torch.int32)
    ref = run_rotary(case, TINY, "torch")
    q_out = torch.full((9, TINY.heads, TINY.head_dim), float("nan"))
    got = run_rotary(case, TINY, "triton", q_out=q_out)
    assert got[0] is q_out
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("backend", lk.BACKENDS)
def test_rotary_padding_rows_write_only_row_zero(backend):
    """All rows padding, several at one position: rows 1.. keep every value; row 0 changes only
    at the positions used, where v holds one of the rows that wrote there."""
    case = rotary_case(TINY, 6, dtype=torch.float32, device="cpu", cache_rows=4, seq_len=16)
    positions = torch.tensor([5, 5, 0, 15, 5, 0])
    case = case._replace(slots=torch.zeros(6, dtype=torch.int64), positions=positions)
    _, k_cache, v_cache = run_rotary(case, TINY, backend)
    assert torch.equal(k_cache[1:], case.k_cache[1:]) and torch.equal(v_cache[1:], case.v_cache[1:])
    used = torch.zeros(16, dtype=torch.bool)
    used[positions] = True
    for cache, before in ((k_cache, case.k_cache), (v_cache, case.v_cache)):
        assert torch.equal(cache[0, ~used], before[0, ~used])
        assert (cache[0, used] != before[0, used]).any(-1).any(-1).all()
    v_rows = case.qkv[:, (TINY.heads + TINY.kv_heads) * TINY.head_dim:].view(6, TINY.kv_heads, TINY.head_dim)
    for pos in positions.unique().tolist():
        assert any(torch.equal(v_cache[0, pos], v_rows[i]) for i in range(6) if positions[i] == pos)


def test_rotary_out_of_range_indices_write_only_row_zero():
    """The kernel redirects a bad [slot, position] to padding row 0 instead of writing outside
    the cache or into another request's row; the torch twin raises."""
    case = rotary_case(TINY, 5, dtype=torch.float32, device="cpu", cache_rows=4, seq_len=16)
    case = case._replace(slots=torch.tensor([4, -1, 1, 1, 2]), positions=torch.tensor([0, 3, 16, -2, 40]))
    _, k_cache, v_cache = run_rotary(case, TINY, "triton")
    for cache, before in ((k_cache, case.k_cache), (v_cache, case.v_cache)):
        assert torch.equal(cache[1:], before[1:]) and torch.equal(cache[0, 1:], before[0, 1:])
        assert not torch.equal(cache[0, 0], before[0, 0])
    with pytest.raises(IndexError):
        run_rotary(case, TINY, "torch")


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # gate -100, on purpose
@DTYPES
@pytest.mark.parametrize("inter", [SMOL.inter, TINY.inter, ODD.inter, 100])
@pytest.mark.parametrize("n", [1, 3, 17])
def test_silu_mul_triton_equals_torch(dtype, inter, n):
    check_silu_mul("cpu", dtype, inter, n)


@pytest.mark.parametrize("backend", lk.BACKENDS)
def test_silu_mul_fills_out(backend):
    gate_up = torch.randn(3, 2 * ODD.inter, generator=torch.Generator().manual_seed(2))
    out = torch.full((3, ODD.inter), float("nan"))
    assert lk.silu_mul(gate_up, out=out, backend=backend) is out
    assert torch.equal(out, lk.silu_mul(gate_up, backend=backend))


# ----------------------------------------------------------------------------------------------
# Torch twins against capture/model/model.py


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_torch_twins_equal_the_model_functions(dtype):
    s, n = SMOL, 17
    config = ModelConfig(hidden_size=s.hidden, num_heads=s.heads, num_kv_heads=s.kv_heads, head_dim=s.head_dim,
                         intermediate_size=s.inter, dtype=str(dtype).removeprefix("torch."))
    gen = torch.Generator().manual_seed(3)
    x, residual, weight = (randn(gen, *shape, dtype=dtype, device="cpu")
                           for shape in ((n, s.hidden), (n, s.hidden), (s.hidden,)))

    assert torch.equal(lk.rms_norm(x, weight, EPS, backend="torch"), model_rms_norm(x, weight, EPS))
    normed, total = lk.rms_norm(x, weight, EPS, residual=residual, backend="torch")
    assert torch.equal(total, residual + x)  # the model's `x = x + update`, x being the residual
    assert torch.equal(normed, model_rms_norm(residual + x, weight, EPS))

    case = rotary_case(s, n, dtype=dtype, device="cpu", cache_rows=6, seq_len=32)  # padding rows too
    q, k_cache, v_cache = run_rotary(case, s, "torch")
    # An independent oracle for the cache write: advanced-index assignment, last write wins
    # (the case's duplicates are padding rows on slot 0, which nothing reads).
    keys, values = case.k_cache.clone(), case.v_cache.clone()
    ref_q, k, v = split_qkv(config, case.qkv)
    cos, sin = case.cos[case.positions], case.sin[case.positions]
    keys[case.slots, case.positions] = lk.rotate(k, cos, sin)
    values[case.slots, case.positions] = v
    assert torch.equal(q, lk.rotate(ref_q, cos, sin))
    assert torch.equal(k_cache[1:], keys[1:]) and torch.equal(v_cache[1:], values[1:])

    layer = SimpleNamespace(gate_up=randn(gen, 2 * s.inter, s.hidden, dtype=dtype, device="cpu", scale=0.05),
                            down=randn(gen, s.hidden, s.inter, dtype=dtype, device="cpu", scale=0.05))
    assert torch.equal(lk.silu_mul(x @ layer.gate_up.T, backend="torch") @ layer.down.T, swiglu_mlp(x, layer))


# ----------------------------------------------------------------------------------------------
# Dispatch and validation


def test_default_backend_is_torch_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, weight = torch.randn(2, 8), torch.ones(8)
    assert torch.equal(lk.rms_norm(x, weight, EPS), model_rms_norm(x, weight, EPS))
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        lk.rms_norm(x, weight, EPS, backend="triton")


def _rotary_args(**overrides) -> dict:
    d, kvh = 4, 1
    args = dict(qkv=torch.randn(2, 4 * d), rope_cos=torch.ones(8, d), rope_sin=torch.zeros(8, d),
                positions=torch.zeros(2, dtype=torch.int64), k_cache=torch.zeros(3, 8, kvh, d),
                v_cache=torch.zeros(3, 8, kvh, d), slots=torch.zeros(2, dtype=torch.int64),
                num_heads=2, num_kv_heads=kvh)
    return args | overrides


BAD_CALLS = {
    "x not contiguous": (lambda b: lk.rms_norm(torch.randn(8, 4).t(), torch.ones(8), EPS, backend=b), "contiguous"),
    "x 1-D": (lambda b: lk.rms_norm(torch.randn(8), torch.ones(8), EPS, backend=b), "2-D"),
    "weight dtype": (lambda b: lk.rms_norm(torch.randn(2, 8), torch.ones(8, dtype=torch.bfloat16), EPS, backend=b),
                     "rms_norm weight must be a torch.float32"),
    "residual shape": (lambda b: lk.rms_norm(torch.randn(2, 8), torch.ones(8), EPS, residual=torch.randn(3, 8),
                                             backend=b), "rms_norm residual must be"),
    "residual_out alone": (lambda b: lk.rms_norm(torch.randn(2, 8), torch.ones(8), EPS,
                                                 residual_out=torch.randn(2, 8), backend=b), "needs residual"),
    "unknown backend": (lambda b: lk.rms_norm(torch.randn(2, 8), torch.ones(8), EPS, backend="cuda"),
                        "backend must be"),
    "float rows": (lambda b: lk.rms_norm(torch.randn(2, 8), torch.ones(8), EPS, rows=torch.zeros(1), backend=b),
                   "rows must be a 1-d int32/int64"),
    "rows with residual_out": (lambda b: lk.rms_norm(torch.randn(2, 8), torch.ones(8), EPS, residual=torch.randn(2, 8),
                                                     residual_out=torch.randn(2, 8),
                                                     rows=torch.zeros(1, dtype=torch.int64), backend=b),
                               "keeps no residual_out"),
    "rows out shape": (lambda b: lk.rms_norm(torch.randn(2, 8), torch.ones(8), EPS,
                                             rows=torch.zeros(3, dtype=torch.int64), out=torch.zeros(2, 8),
                                             backend=b), r"rms_norm out must be .* of shape \[3, 8\]"),
    "qkv width": (lambda b: lk.rotary_and_cache_write(**_rotary_args(qkv=torch.randn(2, 20)), backend=b),
                  "qkv width 20"),
    "kv heads": (lambda b: lk.rotary_and_cache_write(**_rotary_args(num_kv_heads=2), backend=b), "k_cache must be"),
    "cache dtype": (lambda b: lk.rotary_and_cache_write(
        **_rotary_args(v_cache=torch.zeros(3, 8, 1, 4, dtype=torch.bfloat16)), backend=b), "v_cache must be"),
    "float8 k, model-dtype v": (lambda b: lk.rotary_and_cache_write(
        **_rotary_args(k_cache=torch.zeros(3, 8, 1, 4, dtype=torch.float8_e4m3fn)), backend=b),
        "v_cache must be .*float8_e4m3fn"),
    "cache not contiguous": (lambda b: lk.rotary_and_cache_write(
        **_rotary_args(k_cache=torch.zeros(8, 3, 1, 4).transpose(0, 1)), backend=b), "contiguous"),
    "float positions": (lambda b: lk.rotary_and_cache_write(**_rotary_args(positions=torch.zeros(2)), backend=b),
                        "positions must be a torch.int32 or torch.int64"),
    "table width": (lambda b: lk.rotary_and_cache_write(**_rotary_args(rope_sin=torch.zeros(8, 5)), backend=b),
                    "rope_sin must be"),
    "q_out shape": (lambda b: lk.rotary_and_cache_write(**_rotary_args(q_out=torch.zeros(2, 8)), backend=b),
                    "q_out must be"),
    "odd gate_up": (lambda b: lk.silu_mul(torch.randn(2, 7), backend=b), "even"),
    "out dtype": (lambda b: lk.silu_mul(torch.randn(2, 8), out=torch.zeros(2, 4, dtype=torch.float16), backend=b),
                  "silu_mul out must be a torch.float32"),
}


@pytest.mark.parametrize("backend", lk.BACKENDS)
@pytest.mark.parametrize("case", BAD_CALLS, ids=list(BAD_CALLS))
def test_bad_inputs_are_rejected_by_both_backends(case, backend):
    call, match = BAD_CALLS[case]
    with pytest.raises(ValueError, match=match):
        call(backend)
