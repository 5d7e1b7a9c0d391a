"""The `bench serve` workload: seeded requests, then Poisson arrival times for each rate.

The requests (prompts and output lengths) are drawn once and shared by every rate of a sweep,
so rates differ only in when requests arrive. Arrivals come from one seeded draw of unit-rate
exponential gaps, scaled by 1 / rate: the sweep replays the same arrival pattern faster or
slower, and rate inf sends everything at time 0. Requests carry no stop tokens, so each makes
exactly its output length in process; over HTTP they ask for `ignore_eos` (vLLM's, and
graphrelay's), so a server that honours it streams the same lengths.
"""

from __future__ import annotations

import itertools
import math
import random
from typing import TYPE_CHECKING, Optional

import msgspec

from graphrelay.capture.serving.workloads import DEMO_QUESTIONS, Request
from graphrelay.tools.bench.spec import GROUNDED

if TYPE_CHECKING:
    from graphrelay.capture.model.text import TextCodec


class Lengths(msgspec.Struct, frozen=True):
    """Inclusive ranges, uniform: prompt tokens and output tokens per request."""

    prompt: tuple[int, int]
    output: tuple[int, int]


def make_requests(count: int, lengths: Lengths, seed: int, vocab_size: int, codec: Optional["TextCodec"] = None) -> list[Request]:
    """`count` requests with arrival 0: random token ids, or windows of real text when the
    model has a tokenizer (`codec`), so a real model reads language rather than noise."""
    rng = random.Random(seed)
    text = _text_tokens(codec, lengths.prompt[1]) if codec is not None else None
    requests = []
    for i in range(count):
        n = rng.randint(*lengths.prompt)
        if text is None:
            prompt = [rng.randrange(vocab_size) for _ in range(n)]
        else:
            start = rng.randrange(len(text) - n + 1)
            prompt = text[start : start + n]
        requests.append(Request(id=f"s{i}", prompt=prompt, max_new_tokens=rng.randint(*lengths.output)))
    return requests


def _text_tokens(codec: "TextCodec", longest: int) -> list[int]:
    """The bench's built-in English text (the grounded passages and the demo questions) as
    token ids, repeated until the longest prompt fits in it twice over."""
    corpus = "\n\n".join([*(passage for _, passage in GROUNDED), *DEMO_QUESTIONS])
    tokens = codec.encode(corpus)
    return tokens * math.ceil(2 * longest / len(tokens))


def unit_arrivals(count: int, seed: int) -> list[float]:
    """Arrival times of a Poisson process at 1 request/s; divide by a rate for that rate."""
    rng = random.Random(f"arrivals-{seed}")  # its own stream: changing lengths moves no arrival
    return list(itertools.accumulate(rng.expovariate(1.0) for _ in range(count)))


def at_rate(requests: list[Request], unit: list[float], rate: float) -> list[Request]:
    """The requests arriving at `rate` requests/s (inf: all at time 0)."""
    if len(unit) != len(requests):
        raise ValueError(f"{len(unit)} arrival times for {len(requests)} requests")
    return [msgspec.structs.replace(r, arrival=0.0 if math.isinf(rate) else t / rate) for r, t in zip(requests, unit)]
