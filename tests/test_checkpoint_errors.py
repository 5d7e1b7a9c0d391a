"""Broken model files end in one ModelFileError naming the file and the problem, never a
KeyError from deep inside the GGUF or tokenizer readers. The files are written here with the
`gguf` package: a one-layer Llama small enough to build in milliseconds."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from graphrelay.capture.model.checkpoint import ModelFileError, read_gguf, resolve_gguf_path
from graphrelay.capture.model.text import TextCodec

HIDDEN, HEADS, FFN, VOCAB = 8, 2, 16, 16


def write_llama_gguf(path, *, vocab_key: bool = True, tokenizer_model: str | None = None) -> None:
    """A one-layer Llama GGUF with random float32 weights; no tokenizer metadata, or with
    `tokenizer_model` a token list without the scores that model needs."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.attention.head_count", HEADS)
    writer.add_uint32("llama.attention.head_count_kv", HEADS)
    writer.add_uint32("llama.embedding_length", HIDDEN)
    writer.add_uint32("llama.block_count", 1)
    writer.add_uint32("llama.feed_forward_length", FFN)
    if vocab_key:
        writer.add_uint32("llama.vocab_size", VOCAB)
    if tokenizer_model is not None:
        writer.add_tokenizer_model(tokenizer_model)
        writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
              "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
              "blk.0.attn_q.weight": (HIDDEN, HIDDEN), "blk.0.attn_k.weight": (HIDDEN, HIDDEN),
              "blk.0.attn_v.weight": (HIDDEN, HIDDEN), "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
              "blk.0.ffn_gate.weight": (FFN, HIDDEN), "blk.0.ffn_up.weight": (FFN, HIDDEN),
              "blk.0.ffn_down.weight": (HIDDEN, FFN)}
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_without_tokenizer_tokens_reads_its_vocab_size(tmp_path):
    """llama.vocab_size is there: the tokenizer's token list is not needed (it was looked up
    anyway, as a default argument, and raised KeyError)."""
    path = tmp_path / "no_tokens.gguf"
    write_llama_gguf(path)
    config, weights = read_gguf(path)
    assert config.vocab_size == VOCAB and tuple(weights.embed.shape) == (VOCAB, HIDDEN)


def test_a_gguf_without_any_vocabulary_size_names_the_key(tmp_path):
    path = tmp_path / "no_vocab.gguf"
    write_llama_gguf(path, vocab_key=False)
    with pytest.raises(ModelFileError, match=f"{path} lacks the GGUF metadata key 'tokenizer.ggml.tokens'"):
        read_gguf(path)


@pytest.mark.parametrize("tokenizer_model", [None, "llama"])
def test_a_tokenizer_transformers_cannot_build_is_a_model_file_error(tmp_path, tokenizer_model):
    """No tokenizer at all (transformers: ValueError), or a SentencePiece one without its
    scores (transformers: KeyError 'scores')."""
    path = tmp_path / "bad_tokenizer.gguf"
    write_llama_gguf(path, tokenizer_model=tokenizer_model)
    with pytest.raises(ModelFileError, match=f"model file {path}: transformers cannot build its tokenizer"):
        TextCodec(path)


def test_a_directory_is_not_called_missing(tmp_path):
    with pytest.raises(ModelFileError, match="is a directory; give the path of the .gguf file itself"):
        resolve_gguf_path(tmp_path)
