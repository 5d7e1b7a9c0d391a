"""The skinny-GEMM kernel's software pipeline on Hopper, read on a machine with no GPU.

Triton's pipeliner stages each K step's x and weight tiles in shared memory, `stages - 1` steps
ahead, and lets a step's warpgroup MMAs run asynchronously while the next copies are issued. A
tile that an asynchronous MMA reads therefore needs one buffer more than the copies in flight:
with as many buffers as copies, the copy for a later step lands in the tile a pending MMA still
reads. Triton (3.6 on the lent GPUs, 3.9 here) allocates one buffer too few for a tile that an
MMA and a register load both read (an x tile squared for an RMSNorm beside the dot): the
interpreter agrees with torch while the H100 computes another function. These tests compile
every tensor-core tiling the start-up plan may time for sm_90, from the arguments the library's
own launch passes, and check the staged buffers in Triton's TTGIR.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import NamedTuple

import pytest
import torch
import triton
import triton.compiler
from triton.backends.compiler import GPUTarget

from graphrelay.capture.kernels import gemv
from graphrelay.capture.model.linear_plan import candidate_tiles

HOPPER = GPUTarget("cuda", 90, 32)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 576, 9, 3, 64, 1536  # SmolLM2-135M


class StagedBuffer(NamedTuple):
    name: str
    buffers: int  # the allocation's leading dimension
    prologue_copies: int  # copies into it issued before its loop
    mma_reads: bool  # an asynchronous warpgroup MMA reads one of its tiles
    register_reads: bool  # a local_load reads one of its tiles


_ALLOC = re.compile(r"(%[\w#]+) = ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x\d+x")
_VIEW = re.compile(r"(%[\w#]+) = ttg\.(?:memdesc_index|memdesc_subview|memdesc_trans|memdesc_subslice) (%[\w#]+)")
_COPY = re.compile(r"async_copy_global_to_local %[\w#]+, (%[\w#]+)")
_ASYNC_MMA = re.compile(r"warp_group_dot (%[\w#]+), (%[\w#]+)[^\n]*isAsync = true")
_LOCAL_LOAD = re.compile(r"local_load (%[\w#]+)")


def staged_buffers(ttgir: str) -> list[StagedBuffer]:
    """Every shared-memory allocation the pipeliner stages into (`[buffers, ...]`, filled by
    async copies) in a TTGIR module, and who reads it."""
    views = [(m.group(1), m.group(2)) for m in _VIEW.finditer(ttgir)]
    mma_operands = {name for m in _ASYNC_MMA.finditer(ttgir) for name in m.groups()}
    register_operands = {m.group(1) for m in _LOCAL_LOAD.finditer(ttgir)}
    found = []
    for alloc in _ALLOC.finditer(ttgir):
        buffers = int(alloc.group(2))
        names = {alloc.group(1)}
        while True:  # views of views
            more = {view for view, base in views if base in names} - names
            if not more:
                break
            names |= more
        loop = ttgir.find("scf.for", alloc.end())
        prologue = ttgir[alloc.end(): loop if loop >= 0 else len(ttgir)]
        copies = sum(1 for m in _COPY.finditer(prologue) if m.group(1) in names)
        found.append(StagedBuffer(alloc.group(1), buffers, copies, bool(names & mma_operands),
                                  bool(names & register_operands)))
    return found


def overwritten_under_mma(buffers: list[StagedBuffer]) -> list[StagedBuffer]:
    """Staged tiles an asynchronous MMA may still read when the next copy overwrites them."""
    return [b for b in buffers if b.mma_reads and b.prologue_copies >= b.buffers]


# A TTGIR excerpt of the shape Triton 3.6 gave a deferred-norm tile whose result disagreed on
# the H100 (there 3 x buffers for 3 copies at 4 stages): x staged as many times as copies are
# in flight before the loop, read by the MMA and by a register load; the weights one deeper.
RACY = """
    %x_149 = ttg.local_alloc : () -> !ttg.memdesc<2x64x128xbf16, #shared, #smem, mutable>
    %w_150 = ttg.local_alloc : () -> !ttg.memdesc<3x16x128xbf16, #shared, #smem, mutable>
    %x_156 = ttg.memdesc_index %x_149[%c0_i32] : !ttg.memdesc<2x64x128xbf16>
    %x_157 = ttg.async_copy_global_to_local %x_155, %x_156 mask %k_ok other %cst : tensor<64x128x!tt.ptr<bf16>>
    %w_163 = ttg.memdesc_index %w_150[%c0_i32] : !ttg.memdesc<3x16x128xbf16>
    %w_164 = ttg.async_copy_global_to_local %w_162, %w_163 mask %w_ok other %cst : tensor<16x128x!tt.ptr<bf16>>
    %x_178 = ttg.memdesc_index %x_149[%c1_i32] : !ttg.memdesc<2x64x128xbf16>
    %x_179 = ttg.async_copy_global_to_local %x_177, %x_178 mask %k_ok other %cst : tensor<64x128x!tt.ptr<bf16>>
    %w_187 = ttg.async_copy_global_to_local %w_185, %w_150 mask %w_ok other %cst : tensor<16x128x!tt.ptr<bf16>>
    %acc:4 = scf.for %k = %c0 to %c576 step %c128 iter_args(%a = %zero) -> (tensor<64x16xf32>) {
      %x_299 = ttg.memdesc_index %x_149[%i] : !ttg.memdesc<2x64x128xbf16>
      %x_300 = ttg.local_load %x_299 token %t : !ttg.memdesc<64x128xbf16> -> tensor<64x128xbf16>
      %w_303 = ttg.memdesc_index %w_150[%i] : !ttg.memdesc<3x16x128xbf16>
      %w_304 = ttg.memdesc_trans %w_303 {order = array<i32: 1, 0>} : !ttg.memdesc<16x128xbf16>
      %acc_305 = ttng.warp_group_dot %x_299, %w_304, %a {inputPrecision = 0 : i32, isAsync = true} : tensor<64x16xf32>
"""


def test_the_check_finds_the_staging_that_raced_on_the_h100():
    staged = {b.name: b for b in staged_buffers(RACY)}
    assert staged["%x_149"] == StagedBuffer("%x_149", 2, 2, True, True)
    assert staged["%w_150"] == StagedBuffer("%w_150", 3, 2, True, False)
    assert overwritten_under_mma(list(staged.values())) == [staged["%x_149"]]
    # One buffer more, or the MMA reading x through registers instead, is safe.
    assert not overwritten_under_mma(staged_buffers(RACY.replace("2x64x128", "3x64x128")))
    assert not overwritten_under_mma(staged_buffers(RACY.replace("warp_group_dot %x_299", "warp_group_dot %x_reg")))


class _Recorded(Exception):
    """Raised by the stand-in kernel: the launch's arguments, as the library passed them."""

    def __init__(self, args, kwargs):
        super().__init__("recorded")
        self.args, self.kwargs = args, kwargs


class _Recorder:
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise _Recorded(args, kwargs)
        return launch


def _signature_type(value) -> str:
    if isinstance(value, torch.Tensor):
        names = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int64: "i64", torch.int32: "i32"}
        return "*" + names[value.dtype]
    return "fp32" if isinstance(value, float) else "i32"


def compile_for_hopper(launch) -> str:
    """The TTGIR of the skinny kernel for sm_90, compiled from the arguments `launch()` passes
    to it, as they would be on a CUDA device: bfloat16 dots on the tensor cores (the interpreter
    upcasts them) and programmatic dependent launch on. Needs Triton's compiler, not its
    interpreter (TRITON_INTERPRET unset or 0)."""
    kernel, pick_backend = gemv._skinny_linear_kernel, gemv._pick_backend
    # The kernel recorded rather than run; "triton" on CPU tensors allowed without the interpreter.
    gemv._skinny_linear_kernel, gemv._pick_backend = _Recorder(), lambda backend, x: backend
    try:
        launch()
        raise AssertionError("the launch never reached the kernel")
    except _Recorded as recorded:
        args, kwargs = recorded.args, dict(recorded.kwargs)
    finally:
        gemv._skinny_linear_kernel, gemv._pick_backend = kernel, pick_backend
    options = {"num_warps": kwargs.pop("num_warps"), "num_stages": kwargs.pop("num_stages", 3), "launch_pdl": True}
    kwargs.pop("launch_pdl", None)
    kwargs.pop("enable_fp_fusion", None)
    kwargs.update(DOT_F32=args[0].dtype == torch.float32, USE_PDL=True)
    names = kernel.arg_names
    signature = {name: _signature_type(value) for name, value in zip(names, args)}
    signature.update({name: "constexpr" for name in kwargs})
    assert list(signature) == list(names), "every kernel parameter is either passed or a constexpr"
    constants = {(names.index(name),): value for name, value in kwargs.items()}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if signature[name].startswith("*")}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=aligned)
    return triton.compile(source, target=HOPPER, options=options).asm["ttgir"]


def _projections(tiles):
    """Zero-argument calls of the fused projections the engine makes with `tiles`, bf16 on the
    CPU (the launch is recorded, not run)."""
    rows = tiles.block_m * 2 + 1
    bf16 = dict(dtype=torch.bfloat16)
    x, residual, norm = torch.randn(rows, HIDDEN, **bf16), torch.randn(rows, HIDDEN, **bf16), torch.ones(HIDDEN, **bf16)
    attn = torch.randn(rows, HEADS * HEAD_DIM, **bf16)
    o = torch.randn(HIDDEN, HEADS * HEAD_DIM, **bf16)
    if tiles.split_k > 1:  # O and down only
        return {"o + residual": lambda: gemv.linear_residual(attn, o, x, backend="triton", tiles=tiles)}
    qkv = torch.randn((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, **bf16)
    gate_up = torch.randn(2 * INTERMEDIATE, HIDDEN, **bf16)
    cache = torch.zeros(4, 64, KV_HEADS, HEAD_DIM, **bf16)
    table = torch.randn(64, HEAD_DIM)
    positions = torch.arange(rows) % 64
    rotary = gemv.Rotary(table, table, positions, positions % 4, cache, cache.clone(), HEADS, KV_HEADS)
    return {
        "qkv": lambda: gemv.norm_qkv_rotary(x, norm, qkv, 1e-5, rotary, backend="triton", tiles=tiles),
        "gate_up": lambda: gemv.norm_gate_up_silu(x, norm, gate_up, 1e-5, backend="triton", tiles=tiles),
        "gate_up + residual": lambda: gemv.norm_gate_up_silu(x, norm, gate_up, 1e-5, residual=residual,
                                                             backend="triton", tiles=tiles),
        "o + residual": lambda: gemv.linear_residual(attn, o, x, backend="triton", tiles=tiles),
    }


def tensor_core_tilings() -> list:
    """Every tiling the start-up plan may time that runs on the tensor cores."""
    tilings = set()
    for rows in (5, 16, 17, 48, 64, 80, 128, 256):
        tilings.update(t for t in candidate_tiles(rows, HIDDEN, split=True) if not t.fma)
        tilings.update(t for t in candidate_tiles(rows, HIDDEN) if not t.fma)
    return sorted(tilings)


def hopper_staging() -> dict:
    """{repr(tiles): {projection: [StagedBuffer fields]}} for every tensor-core tiling (run in
    a child process without the interpreter: see `staging`)."""
    return {repr(t): {what: [list(b) for b in staged_buffers(compile_for_hopper(launch))]
                      for what, launch in _projections(t).items()} for t in tensor_core_tilings()}


@pytest.fixture(scope="module")
def staging() -> dict:
    # The suite interprets Triton (conftest), and an interpreted kernel has no compiler to
    # hand: compile in a child process that does not.
    env = dict(os.environ, TRITON_INTERPRET="0")
    code = "import json, test_sm90_pipeline as t; print(json.dumps(t.hopper_staging()))"
    done = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), env=env, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tiles", tensor_core_tilings(), ids=str)
def test_no_staged_tile_is_overwritten_under_a_pending_mma(tiles, staging):
    for what, found in staging[repr(tiles)].items():
        staged = [StagedBuffer(*b) for b in found]
        assert staged, f"{what} {tiles}: no staged tiles found in the TTGIR (has its format changed?)"
        if tiles.block_m >= 64 or tiles.swap:  # a warpgroup's 64-row side: the MMA reads shared memory
            assert any(b.mma_reads for b in staged), f"{what} {tiles}: no asynchronous MMA found in the TTGIR"
        racy = overwritten_under_mma(staged)
        assert not racy, (f"{what} {tiles}: staged tiles {racy} have as many copies in flight as buffers while an "
                          f"asynchronous MMA reads them: a later K step's copy overwrites a tile in use on the GPU")
