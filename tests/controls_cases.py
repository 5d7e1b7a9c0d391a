"""What the controls tests share: a made-up text vocabulary for the tiny model, its EOS, and a
JSON schema and a regex whose matches are short enough for a few dozen tokens."""

from __future__ import annotations

import msgspec

from graphrelay.capture.iteration.controls.grammar import made_up_token_strings
from graphrelay.capture.model.model import ModelConfig

EOS = 0
STRINGS = made_up_token_strings(ModelConfig.preset("tiny").vocab_size)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"]}
REGEX = r"[a-c]{2,4}-[0-9]{1,3}"


def msgspec_replace(request, **changes):
    """A copy of a frozen request with `changes`."""
    return msgspec.structs.replace(request, **changes)
