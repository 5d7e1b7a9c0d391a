"""`graphrelay bench kernels` on a machine without a GPU: its command-line errors (the timing
itself runs in tests/gpu/test_gemv_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from bench_cases import assert_needs_gpu, assert_usage_error


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
