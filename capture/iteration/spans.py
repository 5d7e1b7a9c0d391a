"""What the scheduler hands the engine each iteration: query spans, one per request.

A span is one request's share of a flat token batch:
- a prefill chunk: `tokens` are prompt tokens for positions `start ..` of `slot`; `samples`
  marks the chunk that ends the prompt (its last token's output is the first sampled token);
- a decode span (`tokens` empty): the request's next input token and position live on the
  device (the relay), so the host gives only the slot; with speculation the engine makes it a
  verify span of the current token plus k drafts proposed on the device.
"""

from __future__ import annotations

import msgspec

from graphrelay.capture.iteration.sampling import SamplingParams


class Span(msgspec.Struct, frozen=True):
    slot: int
    params: SamplingParams
    tokens: list[int] = []  # prompt chunk; empty: a decode span
    start: int = 0  # a prompt chunk's first position
    samples: bool = True  # a prompt chunk that ends its prompt (decode spans always sample)

    @property
    def is_decode(self) -> bool:
        return not self.tokens


def decode_span(slot: int, params: SamplingParams) -> Span:
    return Span(slot, params)


def prefill_span(slot: int, params: SamplingParams, tokens: list[int], start: int, last: bool) -> Span:
    return Span(slot, params, tokens=tokens, start=start, samples=last)
