"""capture.layer_kernels on CUDA at SmolLM2-135M's shape in bf16: each Triton kernel against its
torch twin (run on CUDA too) for decode batches (1, 256 rows) and a packed prefill (8192 rows),
and the three ops captured in one CUDA graph, GEMMs between them, replaying exactly what they
do eagerly. Tolerances as in tests/test_layer_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from graphrelay.capture.kernels import layer_kernels as lk
from test_layer_kernels import (EPS, SMOL, check_rms_norm, check_rotary, check_rotary_float8, check_silu_mul, randn,
                                rotary_case)

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
ROWS = pytest.mark.parametrize("n", [1, 256, 8192])


@ROWS
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm(n, with_residual):
    check_rms_norm(DEVICE, torch.bfloat16, SMOL.hidden, n, with_residual=with_residual)


@ROWS
def test_rotary_and_cache_write(n):
    # 8 request rows x 2048 positions hold 8192 distinct live [slot, position]s.
    check_rotary(DEVICE, torch.bfloat16, SMOL, n, cache_rows=9, seq_len=2048)


@pytest.mark.parametrize("n", [1, 17, 100])
def test_rotary_into_a_float8_cache(n):
    check_rotary_float8(DEVICE, torch.bfloat16, SMOL, n)


@ROWS
def test_silu_mul(n):
    check_silu_mul(DEVICE, torch.bfloat16, SMOL.inter, n)


def test_cuda_tensors_default_to_triton(monkeypatch):
    def refuse(*args):
        raise AssertionError("the torch twin ran for CUDA tensors")

    for name in ("_rms_norm_torch", "_rotary_torch"):
        monkeypatch.setattr(lk, name, refuse)
    x = torch.randn(2, SMOL.hidden, device=DEVICE, dtype=torch.bfloat16)
    lk.rms_norm(x, torch.ones(SMOL.hidden, device=DEVICE, dtype=torch.bfloat16), EPS)
    case = rotary_case(SMOL, 3, dtype=torch.bfloat16, device=DEVICE, cache_rows=4, seq_len=16)
    lk.rotary_and_cache_write(case.qkv, case.cos, case.sin, case.positions, case.k_cache, case.v_cache,
                              case.slots, SMOL.heads, SMOL.kv_heads)
    monkeypatch.setattr(torch.nn.functional, "silu", refuse)
    lk.silu_mul(torch.randn(2, 2 * SMOL.inter, device=DEVICE, dtype=torch.bfloat16))


def test_graph_replay_equals_eager():
    """Add + norm (residual updated in place) -> QKV GEMM -> rotary + cache write, and gate/up GEMM
    -> silu_mul, captured once over static buffers; every replay on fresh inputs (positions and
    slots included) leaves every buffer exactly as the same ops run eagerly do."""
    s, n, dtype = SMOL, 8, torch.bfloat16
    gen = torch.Generator().manual_seed(5)
    norm_w = randn(gen, s.hidden, dtype=dtype, device=DEVICE)
    qkv_w = randn(gen, (s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden, dtype=dtype, device=DEVICE,
                  scale=s.hidden**-0.5)
    gate_up_w = randn(gen, 2 * s.inter, s.hidden, dtype=dtype, device=DEVICE, scale=s.hidden**-0.5)
    case = rotary_case(s, n, dtype=dtype, device=DEVICE, cache_rows=5, seq_len=64)
    buffers = {
        "update": torch.empty(n, s.hidden, dtype=dtype, device=DEVICE),
        "residual": torch.empty(n, s.hidden, dtype=dtype, device=DEVICE),
        "positions": case.positions.clone(), "slots": case.slots.clone(),
        "k_cache": case.k_cache.clone(), "v_cache": case.v_cache.clone(),
        "normed": torch.empty(n, s.hidden, dtype=dtype, device=DEVICE),
        "q": torch.empty(n, s.heads, s.head_dim, dtype=dtype, device=DEVICE),
        "act": torch.empty(n, s.inter, dtype=dtype, device=DEVICE),
    }
    b = buffers

    def step() -> None:
        lk.rms_norm(b["update"], norm_w, EPS, residual=b["residual"], out=b["normed"], residual_out=b["residual"])
        lk.rotary_and_cache_write(b["normed"] @ qkv_w.T, case.cos, case.sin, b["positions"], b["k_cache"],
                                  b["v_cache"], b["slots"], s.heads, s.kv_heads, q_out=b["q"])
        lk.silu_mul(b["normed"] @ gate_up_w.T, out=b["act"])

    def fresh_inputs(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        other = rotary_case(s, n, dtype=dtype, device=DEVICE, cache_rows=5, seq_len=64, seed=seed)
        b["update"].copy_(randn(g, n, s.hidden, dtype=dtype, device=DEVICE))
        b["residual"].copy_(randn(g, n, s.hidden, dtype=dtype, device=DEVICE, scale=4.0))
        b["positions"].copy_(other.positions)
        b["slots"].copy_(other.slots)

    fresh_inputs(0)
    side = torch.cuda.Stream()  # warm-up (Triton compiles) off the capture stream, as torch advises
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for seed in range(1, 4):
        fresh_inputs(seed)
        before = {name: t.clone() for name, t in buffers.items()}
        graph.replay()
        replayed = {name: t.clone() for name, t in buffers.items()}
        for name, t in buffers.items():
            t.copy_(before[name])
        step()
        for name, t in buffers.items():
            assert torch.equal(replayed[name], t), f"seed {seed}: {name} differs between replay and eager"
        for name in ("residual", "k_cache", "v_cache", "normed", "q", "act"):
            assert not torch.equal(replayed[name], before[name]), f"seed {seed}: the replay left {name} as it was"
