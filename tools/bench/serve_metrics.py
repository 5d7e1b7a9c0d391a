"""Latency and throughput of one sweep point of `bench serve`, from per-request timestamps.

Both drivers (in process and over HTTP) reduce a request to a `Timing`: when it was due, when
each of its tokens (or stream chunks) arrived, and how many tokens it made. From those:

- TTFT: due time to the first token. In process that includes waiting for a slot, as a client
  would see it; over HTTP it is measured from the moment the request is sent.
- TPOT: (last token - first token) / (tokens - 1), per request: the decode pace it saw.
- ITL: every gap between consecutive token arrivals, pooled over requests. In process tokens
  come one per decode iteration; over HTTP a stream chunk may carry several tokens, so the gap
  is between chunks.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import msgspec
import numpy as np

PERCENTILES = (50, 90, 99)


class Timing(msgspec.Struct):
    """One request's timestamps, seconds from the start of its run."""

    id: str
    prompt_tokens: int
    max_tokens: int
    output_tokens: int
    due_s: float  # when it was sent (HTTP) or arrived (in process)
    token_times_s: list[float]  # each token's (or stream chunk's) arrival on the client
    error: Optional[str] = None  # why the request failed (HTTP); its timestamps are not used

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times_s)


def distribution(values: list[float]) -> dict[str, Optional[float]]:
    """Mean and p50 / p90 / p99 (linear interpolation); None when nothing was measured."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    points = np.percentile(np.asarray(values, dtype=np.float64), PERCENTILES)
    return {"mean": float(np.mean(values)), **{f"p{p}": float(v) for p, v in zip(PERCENTILES, points)}}


def summarize(timings: list[Timing], duration_s: float) -> dict[str, Any]:
    """The figures of one sweep point. `duration_s`: first arrival to the last token."""
    done = [t for t in timings if t.ok]
    tokens = sum(t.output_tokens for t in done)
    ttft = [(t.token_times_s[0] - t.due_s) * 1e3 for t in done]
    tpot = [(t.token_times_s[-1] - t.token_times_s[0]) * 1e3 / (t.output_tokens - 1) for t in done if t.output_tokens > 1]
    itl = [(b - a) * 1e3 for t in done for a, b in zip(t.token_times_s, t.token_times_s[1:])]
    latency = [(t.token_times_s[-1] - t.due_s) * 1e3 for t in done]
    errors = [t.error or "no tokens" for t in timings if not t.ok]
    return {
        "requests": len(timings),
        "completed": len(done),
        "failed": len(errors),
        "first_error": errors[0] if errors else None,
        "ended_early": sum(t.output_tokens < t.max_tokens for t in done),  # an end of turn before max_tokens
        "prompt_tokens": sum(t.prompt_tokens for t in done),
        "output_tokens": tokens,
        "duration_s": duration_s,
        "requests_per_s": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_tokens_per_s": tokens / duration_s if duration_s > 0 else 0.0,
        "ttft_ms": distribution(ttft),
        "tpot_ms": distribution(tpot),
        "itl_ms": distribution(itl),
        "latency_ms": distribution(latency),
    }


def highest_rate_within(points: list[dict[str, Any]], limit_ms: float) -> Optional[float]:
    """The highest finite rate (requests/s) whose TTFT p99 is at most `limit_ms`, every request
    completed; None if none is. All-at-once points (rate inf) have no rate to report."""
    passing = [p["rate"] for p in points
               if not math.isinf(p["rate"]) and p["failed"] == 0 and p["ttft_ms"]["p99"] is not None
               and p["ttft_ms"]["p99"] <= limit_ms]
    return max(passing, default=None)
