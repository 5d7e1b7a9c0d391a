"""What a request asks of the controls, validated where the request is built.

The names and ranges are the ones an OpenAI or vLLM user sends. The engine-wide static widths
(how many logit_bias entries, how many stop tokens) are checked at admission by
`SamplingControls`, which knows them.
"""

from __future__ import annotations

import math
from typing import Optional

import msgspec

MAX_LOGPROBS = 20  # the most top logprobs a request may ask for (OpenAI's limit)
BIAS_RANGE = (-100.0, 100.0)  # OpenAI's logit_bias range
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's frequency / presence range


def _finite_in(name: str, value, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"ControlParams.{name} must be a finite number in [{low}, {high}], got {value!r}")


class ControlParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-request controls; the defaults change nothing.

    frequency_penalty, presence_penalty (OpenAI): subtract `frequency * count + presence *
    (count > 0)` from each token's logit, counting the tokens generated so far.
    repetition_penalty (HF / vLLM): divide positive logits by it and multiply negative ones,
    for every token in the prompt or generated so far (1 = off).
    logit_bias: token id -> bias added to its logit (OpenAI: -100..100).
    min_tokens: the request's stop tokens are masked until this many tokens were generated.
    logprobs: None = none; n = the sampled token's logprob plus the top n (0..20), both from
    the model's raw distribution (before penalties, bias, grammar and temperature).
    json_schema (a JSON Schema as JSON text) or regex: constrain the output to match it.
    """

    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    min_tokens: int = 0
    logprobs: Optional[int] = None
    json_schema: Optional[str] = None
    regex: Optional[str] = None

    def __post_init__(self) -> None:
        _finite_in("frequency_penalty", self.frequency_penalty, *PENALTY_RANGE)
        _finite_in("presence_penalty", self.presence_penalty, *PENALTY_RANGE)
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
            raise ValueError(f"ControlParams.repetition_penalty must be a finite number > 0 (1 = off), got {r!r}")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"ControlParams.logit_bias keys must be token ids >= 0, got {token!r}")
            _finite_in(f"logit_bias[{token}]", bias, *BIAS_RANGE)
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"ControlParams.min_tokens must be an int >= 0, got {self.min_tokens!r}")
        n = self.logprobs
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_LOGPROBS):
            raise ValueError(f"ControlParams.logprobs must be None or an int in 0..{MAX_LOGPROBS}, got {n!r}")
        if self.json_schema is not None and self.regex is not None:
            raise ValueError("ControlParams takes json_schema or regex, not both: drop one")
        if self.min_tokens and (self.json_schema is not None or self.regex is not None):
            # The automaton may allow nothing but EOS (a complete match): masking it too would
            # leave a row with no token to sample.
            raise ValueError("ControlParams.min_tokens cannot be combined with json_schema / regex: drop min_tokens "
                             "(the grammar decides where the output may end)")
        if self.json_schema is not None:
            try:
                msgspec.json.decode(self.json_schema)
            except msgspec.DecodeError as e:
                raise ValueError(f"ControlParams.json_schema must be a JSON Schema as JSON text: {e}") from None

    @property
    def grammar(self) -> Optional[tuple[str, str]]:
        """("json_schema" | "regex", source), or None when unconstrained."""
        if self.json_schema is not None:
            return ("json_schema", self.json_schema)
        if self.regex is not None:
            return ("regex", self.regex)
        return None
