"""Shared test setup: Triton kernels run under the interpreter on machines without CUDA,
and tests marked `gpu` skip cleanly there."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before any @triton.jit decorator runs: it picks the interpreter then.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run tools/gpu_check.sh on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """Run a test on the CPU (CI; Triton interpreted) and, marked `gpu`, on CUDA (real kernels)."""
    return request.param


@pytest.fixture(scope="session")
def codec():
    """The real model's tokenizer and chat template (SmolLM2's GGUF; about 10 s to load)."""
    from graphrelay.capture.model.checkpoint import resolve_gguf_path
    from graphrelay.capture.model.text import TextCodec

    return TextCodec(resolve_gguf_path(None))
