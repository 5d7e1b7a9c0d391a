"""Workloads: the requests a serving run admits. Token ids only; no tokenizer needed.

Two sources: a seeded synthetic generator (closed loop, or Poisson arrivals at a rate, with
uniform prompt and output lengths), and a JSONL file with one request per line.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

import msgspec

from capture.sampling import SamplingParams


class Request(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request. `arrival` is seconds after the run starts (0 = at once)."""

    id: str
    prompt: list[int]
    max_new_tokens: int
    stop_token: Optional[int] = None
    sampling: SamplingParams = SamplingParams()
    arrival: float = 0.0

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"request {self.id!r}: prompt is empty; give at least one token id")
        if any(t < 0 for t in self.prompt):
            raise ValueError(f"request {self.id!r}: prompt token ids must be >= 0")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.id!r}: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.arrival < 0:
            raise ValueError(f"request {self.id!r}: arrival must be >= 0 seconds, got {self.arrival}")


class SyntheticWorkload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Seeded synthetic requests. rate = requests per second (Poisson); 0 = closed loop, all at once."""

    num_requests: int = 32
    prompt_len: tuple[int, int] = (4, 32)  # inclusive range, uniform
    output_len: tuple[int, int] = (8, 64)
    vocab_size: int = 512
    stop_token: Optional[int] = None
    rate: float = 0.0
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        for name in ("prompt_len", "output_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be a range LOW,HIGH with 1 <= LOW <= HIGH, got {low},{high}")
        if self.rate < 0:
            raise ValueError(f"rate must be >= 0 requests/s (0 = closed loop), got {self.rate}")

    def requests(self) -> list[Request]:
        rng = random.Random(self.seed)
        clock, out = 0.0, []
        for i in range(self.num_requests):
            if self.rate > 0:
                clock += rng.expovariate(self.rate)
            prompt = [rng.randrange(self.vocab_size) for _ in range(rng.randint(*self.prompt_len))]
            out.append(
                Request(
                    id=f"r{i}",
                    prompt=prompt,
                    max_new_tokens=rng.randint(*self.output_len),
                    stop_token=self.stop_token,
                    sampling=SamplingParams(temperature=self.temperature, top_k=self.top_k, seed=self.seed * 1_000_003 + i),
                    arrival=clock,
                )
            )
        return out


class WorkloadError(ValueError):
    """A request file is malformed; the message names the file, the line and the problem."""


def load_jsonl(path: str | Path) -> list[Request]:
    """One JSON request per line (blank lines skipped); ids default to the line number."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise WorkloadError(f"cannot read request file {path}: {exc.strerror}") from None
    decoder = msgspec.json.Decoder(type=dict)
    requests, seen = [], set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            raw = decoder.decode(line)
            raw.setdefault("id", str(number))
            request = msgspec.convert(raw, Request)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            raise WorkloadError(f"{where}: {exc}") from None
        if request.id in seen:
            raise WorkloadError(f"{where}: duplicate request id {request.id!r}")
        seen.add(request.id)
        requests.append(request)
    if not requests:
        raise WorkloadError(f"{path}: no requests (expected one JSON object per line)")
    return requests
