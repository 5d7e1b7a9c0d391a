"""How a skinny-GEMM launch (`capture.kernels.gemv`) is tiled, and the scratch its split-K
tilings share: the tiling's fields and their rules, the default per row count, and the
workspace allocated once for the partial products.

Up to FMA_MAX_ROWS rows (decode at batch 1-16) the default runs one row per program on the CUDA
cores, tiles of at most FMA_TILE weight elements (BLOCK_N x BLOCK_K) and K steps of at most
FMA_MAX_K; each row's program re-reads its weight tile, from L2 after the first. Beyond, tensor-
core tiles. Start-up timing (`capture.model.linear_plan`) picks among more tilings per projection.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

FMA_MAX_ROWS = 16
FMA_TILE = 4096
FMA_MAX_K = 2048
MAX_SPLIT_K = 8  # programs a split-K tiling shares an output tile's K steps among, at most
# K steps in flight in a tensor-core tile's pipelined loop: 4 was the fastest of 2-4 at every
# projection and row count of a sweep on the H200 (results/skinny_stages_h200.txt); MAX_STAGES
# bounds the shared memory the deepest may buffer.
TC_STAGES = 4
MAX_STAGES = 8
# Each stage buffers a K step of x and of the weight tiles in shared memory, so float32 (tests and
# CPU-sized presets on a GPU) keeps at most 2: the widest candidate tile at 4 would pass Hopper's 227 KB.
TC_STAGES_FLOAT32 = 2
# What Triton 3.6 asks beyond a tile's `stages - 1` buffered K steps: 24-25 KB in the three
# tilings the H100 refused at 8 stages, which asked 248, 249 and 360 KB (results/deep_stages_h100.txt).
PIPELINE_OVERHEAD_BYTES = 26 * 1024
SPLIT_TILE_MAX = 128  # the widest block_m / block_n a split-K tiling may use (workspace sizing)


class Tiles(NamedTuple):
    """One launch's tiling: rows, output features and K elements per program and loop step,
    warps, and whether the product runs on the CUDA cores (FMA) rather than as a tensor-core
    dot (which needs block_m, block_n, block_k >= 16). `early`: a tensor-core tile requests its
    epilogue inputs (residual tile, rotary positions and cache rows) before its K loop rather
    than after it (FMA tiles always do). `swap`: a tensor-core tile computes the transposed
    product, weight rows as the dot's M side and the x rows as its N side: Hopper's warpgroup
    MMA takes M in 64-row steps, so a tile of fewer than 64 x rows needs the weight on that
    side to use it (the tile's accumulator is transposed back once, after the K loop).
    `split_k`: `linear_residual` only (a projection with a short output, a long K, or both:
    O and down), each output tile's K steps shared by that many programs, so the grid fills
    more of the GPU; their partial products meet in a `SplitKWorkspace` and the last to finish
    sums them in a fixed order and adds the residual. Each distinct Tiles compiles its own
    kernel variant. `stages`: how many K steps of a tensor-core tile's loop Triton's pipeliner keeps
    in flight (float32 launches keep at most TC_STAGES_FLOAT32: their steps are twice the
    bytes; `pipeline_stages`); FMA tiles take their whole K in one or a few steps and ignore it."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    fma: bool
    early: bool = False
    swap: bool = False
    split_k: int = 1
    stages: int = TC_STAGES


def default_tiles(m: int, k: int) -> Tiles:
    """The tiling used when a caller names none."""
    if m <= FMA_MAX_ROWS:
        # A program per row and a few output features, the whole K in one step where it fits:
        # every weight byte is requested at once (before the PDL wait), and the grid has a
        # program or more per SM even for the narrowest projection.
        block_k = min(triton.next_power_of_2(k), FMA_MAX_K)
        return Tiles(1, max(2, FMA_TILE // block_k), block_k, 4, True)
    # Short K steps the pipeliner keeps `stages` deep: at 16-64 rows the H200 sweep's fastest,
    # or within 10% of it, for every projection; 64-row blocks beyond.
    return Tiles(16 if m <= 64 else 64, 32, 64, 4, False)


def pipeline_stages(tiles: Tiles, element_bytes: int) -> int:
    """The K steps a tensor-core launch of `tiles` keeps in flight for operands of that many bytes."""
    return tiles.stages if element_bytes <= 2 else min(tiles.stages, TC_STAGES_FLOAT32)


def pipeline_bytes(tiles: Tiles, norm: bool, element_bytes: int = 2) -> int:
    """Shared memory a tensor-core launch of `tiles` asks, at most (0 for an FMA tile, whose K steps
    are not pipelined): Triton buffers `stages - 1` K steps of each load in the loop, plus its own.
    A step loads an x tile and a weight tile; a norm projection's (`norm`) also loads x's residual
    and a second weight tile (gate and up, or QKV's rotary halves), counted whether or not a call
    passes the residual: the step passes one where the projection before it ran on torch. Within
    2 KB above what the H100 reported for the tilings it refused (PIPELINE_OVERHEAD_BYTES)."""
    if tiles.fma:
        return 0
    rows = 2 * (tiles.block_m + tiles.block_n) if norm else tiles.block_m + tiles.block_n
    step = rows * tiles.block_k * element_bytes
    return (pipeline_stages(tiles, element_bytes) - 1) * step + PIPELINE_OVERHEAD_BYTES


def check_tiles(tiles: object) -> Tiles:
    if not isinstance(tiles, Tiles):
        raise ValueError(f"tiles must be a gemv_tiles.Tiles, got {type(tiles).__name__}")
    sizes = (tiles.block_m, tiles.block_n, tiles.block_k)
    if any(not isinstance(v, int) or v < 1 or v & (v - 1) for v in sizes + (tiles.warps,)):
        raise ValueError(f"tiles sizes and warps must be powers of two, got {tiles}")
    if not all(isinstance(flag, bool) for flag in (tiles.fma, tiles.early, tiles.swap)):
        raise ValueError(f"tiles fma, early and swap must be bools, got {tiles}")
    if not tiles.fma and min(sizes) < 16:
        raise ValueError(f"a tensor-core tile needs block_m, block_n, block_k >= 16, got {tiles}; or set fma=True")
    if tiles.fma and tiles.swap:
        raise ValueError(f"swap transposes a tensor-core product; an FMA tile has none, got {tiles}")
    if not isinstance(tiles.stages, int) or isinstance(tiles.stages, bool) or not 1 <= tiles.stages <= MAX_STAGES:
        raise ValueError(f"tiles stages must be an int in 1..{MAX_STAGES}, got {tiles}")
    split = tiles.split_k
    if not isinstance(split, int) or isinstance(split, bool) or not 1 <= split <= MAX_SPLIT_K:
        raise ValueError(f"tiles split_k must be an int in 1..{MAX_SPLIT_K}, got {tiles}")
    if split > 1 and tiles.fma:
        raise ValueError(f"split_k shares a tensor-core tile's K loop; an FMA tile takes 1, got {tiles}")
    return tiles


class SplitKWorkspace:
    """Scratch of the split-K tilings (`Tiles.split_k`), allocated once: float32 partial
    products and a counter per output tile (zero between calls: the last split resets its
    tile's). One workspace serves launches in sequence on one stream, as a forward makes them
    (each launch has finished with it before the next one uses it), not concurrent ones."""

    def __init__(self, max_rows: int, max_cols: int, device: torch.device | str, max_split: int = MAX_SPLIT_K):
        if min(max_rows, max_cols, max_split) < 1:
            raise ValueError(f"SplitKWorkspace sizes must be positive, got rows={max_rows} cols={max_cols} "
                             f"split={max_split}")
        # Any tiling up to SPLIT_TILE_MAX a side covers at most this much of the padded output.
        padded = (max_rows + SPLIT_TILE_MAX - 1) * (max_cols + SPLIT_TILE_MAX - 1)
        self.partials = torch.empty(max_split * padded, dtype=torch.float32, device=device)
        self.done = torch.zeros(triton.cdiv(max_rows, 16) * triton.cdiv(max_cols, 16), dtype=torch.int32,
                                device=device)

    def check(self, m: int, n: int, tiles: Tiles) -> None:
        """Before a launch: this call's tiles and partials fit."""
        grid = triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n)
        if (grid > self.done.numel() or grid * tiles.split_k * tiles.block_m * tiles.block_n > self.partials.numel()
                or max(tiles.block_m, tiles.block_n) > SPLIT_TILE_MAX):
            raise ValueError(f"SplitKWorkspace holds {self.partials.numel()} partials and {self.done.numel()} tiles, "
                             f"too few for {m} x {n} outputs in {tiles}: size it for the largest rows and columns")
