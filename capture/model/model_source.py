"""Where a run's model comes from: a preset's architecture with random weights, or a GGUF file
(architecture, weights, tokenizer and chat template). One function so `serve`, `generate`
and the benchmarks pick models the same way.
"""

from __future__ import annotations

from typing import Optional

import msgspec

from graphrelay.capture.model.checkpoint import read_gguf, resolve_gguf_path
from graphrelay.capture.model.model import ModelConfig, ModelWeights
from graphrelay.capture.model.text import TextCodec

# Presets whose real weights have a default GGUF (capture.checkpoint.default_gguf_path).
GGUF_PRESETS = ("smollm2-135m",)
WEIGHT_SOURCES = ("auto", "gguf", "random")


class LoadedModel(msgspec.Struct):
    config: ModelConfig
    weights: Optional[ModelWeights]  # None: seeded random weights
    codec: Optional[TextCodec]  # None: token ids only
    source: str  # what was loaded, for the summary


def load_model(
    name: str, *, weights: str = "auto", gguf: Optional[str] = None, dtype: str = "float32", max_seq_len: int = 1024,
    tokenizer: Optional[str] = None,
) -> LoadedModel:
    """`name` is a preset; `weights` "auto" loads the GGUF for presets that have one (or when
    `gguf` is given) and random weights otherwise. `tokenizer` (random weights only): a GGUF
    whose tokenizer and chat template to use, "" for the default file; the vocabulary is
    resized to it, so a small random model serves text (fast tests of the text path). Raises
    ModelFileError with the install hint when a file is needed but missing."""
    preset = ModelConfig.preset(name)
    real = _check_sources(name, weights, gguf, tokenizer)
    if not real:
        config = msgspec.structs.replace(preset, dtype=dtype, max_seq_len=max_seq_len)
        if tokenizer is None:
            return LoadedModel(config, None, None, f"{name}, random weights")
        path = resolve_gguf_path(tokenizer or None)
        codec = TextCodec(path)
        config = msgspec.structs.replace(config, vocab_size=len(codec.tokenizer))
        return LoadedModel(config, None, codec, f"{name}, random weights, tokenizer of {path.name}")
    path = resolve_gguf_path(gguf)
    config, loaded = read_gguf(path, max_seq_len=max_seq_len, dtype=dtype)
    return LoadedModel(config, loaded, TextCodec(path), f"{path.name}")


def load_codec(name: str, *, weights: str = "auto", gguf: Optional[str] = None,
               tokenizer: Optional[str] = None) -> Optional[TextCodec]:
    """The tokenizer and chat template `load_model` would give, without reading any weights
    (a process that serves text while another holds the model)."""
    ModelConfig.preset(name)
    if _check_sources(name, weights, gguf, tokenizer):
        return TextCodec(resolve_gguf_path(gguf))
    return None if tokenizer is None else TextCodec(resolve_gguf_path(tokenizer or None))


def _check_sources(name: str, weights: str, gguf: Optional[str], tokenizer: Optional[str]) -> bool:
    """Reject sources that do not go together; returns whether the weights come from a GGUF."""
    if weights not in WEIGHT_SOURCES:
        raise ValueError(f"weights {weights!r} is not one of {WEIGHT_SOURCES}")
    real = uses_gguf(name, weights, gguf)
    if gguf is not None and not real:
        raise ValueError("--gguf PATH gives real weights, which --weights random leaves unused; drop one of them "
                         "(random weights take the file's tokenizer with --tokenizer PATH)")
    if real and tokenizer is not None:
        raise ValueError("a tokenizer file goes with random weights only (a GGUF model brings its own); use --weights random")
    return real


def uses_gguf(name: str, weights: str, gguf: Optional[str]) -> bool:
    """Whether `load_model` would read a GGUF file (real weights and a tokenizer)."""
    return weights == "gguf" or (weights == "auto" and (gguf is not None or name in GGUF_PRESETS))


def default_dtype(device_type: str) -> str:
    """bf16 on a GPU, float32 on the CPU (where it is the exact, fast choice)."""
    return "bfloat16" if device_type == "cuda" else "float32"

