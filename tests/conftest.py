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


@pytest.fixture(scope="session", autouse=True)
def gguf_read_once():
    """A GGUF's weights and tokenizer are read once per session (SmolLM2's take about 15 s:
    dequantizing and building the tokenizer), however many tests and CLI runs load the model:
    `load_model` shares them (nothing writes to either). Its config still follows each
    caller's max_seq_len."""
    import functools

    import msgspec

    from graphrelay.capture.model import model_source

    read, codec = model_source.read_gguf, functools.cache(model_source.TextCodec)

    @functools.cache
    def whole(path, dtype):
        return read(path, max_seq_len=2**31 - 1, dtype=dtype)  # capped at the trained context

    def read_once(path, max_seq_len=2048, dtype="float32"):
        config, weights = whole(path, dtype)
        return msgspec.structs.replace(config, max_seq_len=min(max_seq_len, config.max_seq_len)), weights

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_source, "read_gguf", read_once)
        patch.setattr(model_source, "TextCodec", codec)
        yield


@pytest.fixture(scope="session")
def codec(gguf_read_once):
    """The real model's tokenizer and chat template (SmolLM2's GGUF), shared with `load_model`."""
    from graphrelay.capture.model import model_source
    from graphrelay.capture.model.checkpoint import resolve_gguf_path

    return model_source.TextCodec(resolve_gguf_path(None))
