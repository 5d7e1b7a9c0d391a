"""vLLM's `ignore_eos`: the model's stop tokens no longer end the request (what a benchmark
asks for, so every request makes the length it planned); stop strings still do."""

from __future__ import annotations

import msgspec
import pytest

from graphrelay.capture.serving.openai_api import CompletionRequest, Limits, prepare_completion

LIMITS = Limits("m", max_seq_len=64, vocab_size=49152)


def _prepare(codec, **fields):
    body = msgspec.convert({"prompt": [1, 2, 3], "max_tokens": 4, **fields}, CompletionRequest)
    return prepare_completion(body, codec, LIMITS).request


def test_ignore_eos_drops_the_stop_tokens_and_keeps_the_stop_strings(codec):
    assert codec.stop_tokens and _prepare(codec).stop_tokens == codec.stop_tokens
    request = _prepare(codec, ignore_eos=True, stop=["\n\n"])
    assert request.stop_tokens == () and request.stop == ("\n\n",)


def test_ignore_eos_must_be_a_bool(codec):
    """The body's decode refuses it (the server answers that with a 400 naming the field)."""
    with pytest.raises(msgspec.ValidationError, match="ignore_eos"):
        _prepare(codec, ignore_eos="yes")
