"""`graphrelay bench kernels` on a machine without a GPU: its command-line errors and how it names
a tiling (the timing itself runs in tests/gpu/test_gemv_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from bench_cases import assert_needs_gpu, assert_usage_error
from graphrelay.capture.kernels import gemv_tiles
from graphrelay.tools.bench import kernels


@pytest.mark.parametrize("argv,message", [
    (["--rows", "0"], "--rows"),
    (["--rows", "1,x"], "--rows"),
    (["--model", "huge"], "--model"),
])
def test_bad_options_are_one_line_errors(argv, message, capsys, tmp_path):
    assert_usage_error("kernels", argv, message, capsys, tmp_path)


def test_without_a_gpu_it_says_so(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_needs_gpu("kernels", capsys, tmp_path)


@pytest.mark.parametrize("tiles,text", [
    (None, "default"),
    (gemv_tiles.Tiles(2, 4, 1024, 8, True), "fma 2x4x1024 w8"),
    (gemv_tiles.Tiles(16, 32, 64, 4, False), "dot 16x32x64 w4"),
    (gemv_tiles.Tiles(16, 64, 64, 4, False, swap=True), "dot swap 16x64x64 w4"),
    (gemv_tiles.Tiles(64, 32, 64, 4, False, early=True), "dot 64x32x64 w4 early"),
    (gemv_tiles.Tiles(64, 32, 128, 4, False, split_k=4), "dot 64x32x128 w4 split 4"),
])
def test_the_table_names_each_tiling_with_its_flags(tiles, text):
    assert kernels._tiles_text(None if tiles is None else tiles._asdict()) == text
