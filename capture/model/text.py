"""Text in and out: the tokenizer and chat template that a GGUF file carries.

transformers builds a fast (Rust `tokenizers`) tokenizer and reads the chat template from the
GGUF's metadata; nothing here parses GGUF or implements BPE. A request's text becomes token
ids here, on the host, before it reaches the engine; sampled ids become text here after.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from graphrelay.capture.model.checkpoint import INSTALL_HINT, ModelFileError

# Tokens that end a turn besides the tokenizer's EOS, where the vocabulary has them.
_END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")
# Roles chat templates are written for: a template renders any string it is given (SmolLM2's
# would open a "<|im_start|>wizard" turn the model never saw), so others are refused.
CHAT_ROLES = ("system", "user", "assistant", "tool")


class TextCodec:
    """Encode prompts and chats to token ids, decode ids to text, and name the stop tokens."""

    def __init__(self, gguf_path: str | Path):
        from transformers import AutoTokenizer  # a model dependency, not a library one

        path = Path(gguf_path)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception as exc:  # transformers' GGUF reader fails on a missing key with anything (KeyError, ...)
            raise ModelFileError(f"model file {path}: transformers cannot build its tokenizer "
                                 f"({type(exc).__name__}: {exc}); {INSTALL_HINT}") from None
        if type(self.tokenizer.backend_tokenizer.model).__name__ == "BPE":
            # transformers skips this WordPiece clean-up for BPE anyway and warns on every
            # first decode that it does; turning it off keeps the text and drops the warning.
            self.tokenizer.clean_up_tokenization_spaces = False
        vocab = self.tokenizer.get_vocab()
        stops = {vocab[t] for t in _END_OF_TURN if t in vocab}
        if self.tokenizer.eos_token_id is not None:
            stops.add(self.tokenizer.eos_token_id)
        self.stop_tokens: tuple[int, ...] = tuple(sorted(stops))

    @property
    def has_chat_template(self) -> bool:
        return bool(self.tokenizer.chat_template)

    def encode(self, text: str) -> list[int]:
        """Plain text, no chat template, no special tokens added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        """`[{"role": ..., "content": ...}, ...]` through the model's chat template, ending with
        the assistant's turn opened (generation prompt)."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; send a plain prompt (--no-chat)")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must be an object with string 'role' and 'content'")
            if m["role"] not in CHAT_ROLES:
                raise ValueError(f"messages[{i}]: role {m['role']!r} is not one of {', '.join(CHAT_ROLES)}")
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        # transformers 5 returns a BatchEncoding here, 4.x a plain list.
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens (end-of-turn markers) left out."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
