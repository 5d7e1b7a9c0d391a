"""Workloads: the requests a serving run admits, as token ids.

Three sources: a seeded synthetic generator (random token ids; closed loop or Poisson arrivals
at a rate, uniform prompt and output lengths), a JSONL file with one request per line (token
ids, text, or chat messages), and a built-in set of chat prompts for the real model. Text is
turned into token ids here, by the model's `TextCodec`, before the engine sees it.
"""

from __future__ import annotations

import math
import numbers
import random
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import msgspec

from graphrelay.capture.iteration.controls.params import ControlParams
from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.serving.request_controls import move_openai_names

if TYPE_CHECKING:
    from graphrelay.capture.model.text import TextCodec


class Request(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request. `arrival` is seconds after the run starts (0 = at once). `stop` strings
    end the completion's text before the first of them (matched on the host as the text is
    detokenized: `capture.serving.detokenize`), so they need the model's tokenizer."""

    id: str
    prompt: list[int]
    max_new_tokens: int
    stop_tokens: tuple[int, ...] = ()
    sampling: SamplingParams = SamplingParams()
    arrival: float = 0.0
    # Loaded once per request into per-slot device tables (EngineConfig.controls), unlike the
    # sampling params every decode row stages: so they travel beside them.
    controls: Optional[ControlParams] = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # The Python constructor does not type-check (msgspec.convert does): a float or bool
        # here would be compared, counted or staged as if it were valid.
        where = f"request {self.id!r}"
        if not isinstance(self.id, str):
            raise ValueError(f"request id must be a string, got {self.id!r}")
        if not isinstance(self.prompt, list) or not self.prompt:
            raise ValueError(f"{where}: prompt must be a non-empty list of token ids")
        bad = _first_bad_token_id(self.prompt)
        if bad is not None:
            raise ValueError(f"{where}: prompt token ids must be ints >= 0, got {bad!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"{where}: max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        bad = _first_bad_token_id(self.stop_tokens)
        if bad is not None:
            raise ValueError(f"{where}: stop_tokens must be token ids (ints >= 0), got {bad!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"{where}: sampling must be a SamplingParams (e.g. SamplingParams(temperature=0.7)), "
                             f"got {type(self.sampling).__name__}")
        if self.controls is not None and not isinstance(self.controls, ControlParams):
            raise ValueError(f"{where}: controls must be a ControlParams or None, got {type(self.controls).__name__}")
        # A NaN or infinite arrival would never come due and the run would wait forever; past
        # MAX_ARRIVAL_S it is almost surely milliseconds given as seconds.
        if (isinstance(self.arrival, bool) or not isinstance(self.arrival, (int, float))
                or not 0 <= self.arrival <= MAX_ARRIVAL_S):
            raise ValueError(f"{where}: arrival must be seconds after the run starts, 0..{MAX_ARRIVAL_S:g}, "
                             f"got {self.arrival!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"{where}: stop strings must be non-empty strings")


MAX_ARRIVAL_S = 3600.0  # the latest arrival a batch run accepts: one hour


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_token_id(value) -> bool:
    return _is_int(value) and value >= 0


def _first_bad_token_id(ids):
    """The first of `ids` that is not a token id (an int >= 0), or None. Plain ints, what JSON
    decoding gives, are checked in C (`type` and `min` over the list): an HTTP server admits a
    512-token prompt in microseconds instead of ~0.2 ms of per-element Python."""
    if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0):
        return None
    return next((t for t in ids if not _is_token_id(t)), None)


class SyntheticWorkload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Seeded synthetic requests. rate = requests per second (Poisson); 0 = closed loop, all at once."""

    num_requests: int = 32
    prompt_len: tuple[int, int] = (4, 32)  # inclusive range, uniform
    output_len: tuple[int, int] = (8, 64)
    vocab_size: int = 512
    stop_tokens: tuple[int, ...] = ()
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
        if not (math.isfinite(self.rate) and self.rate >= 0):
            raise ValueError(f"rate must be a finite number >= 0 requests/s (0 = closed loop), got {self.rate}")

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
                    stop_tokens=self.stop_tokens,
                    sampling=SamplingParams(temperature=self.temperature, top_k=self.top_k, seed=derived_seed(self.seed, i)),
                    arrival=clock,
                )
            )
        return out


def derived_seed(workload_seed: int, index: int) -> int:
    """Request `index`'s sampling seed: distinct per request, and always inside int64 (the
    workload seed may be any int), so no workload seed makes a request invalid."""
    return (workload_seed * 1_000_003 + index) % 2**63


class WorkloadError(ValueError):
    """A request file is malformed; the message names the file, the line and the problem."""


MAX_LINE_BYTES = 1 << 20  # one request's JSON; a prompt of ~100k tokens fits


def load_jsonl(path: str | Path, codec: Optional["TextCodec"] = None, chat: bool = True) -> list[Request]:
    """One JSON request per line (blank lines skipped); ids default to the line number.

    A request gives its prompt as token ids (`"prompt": [1, 2, 3]`), as text (`"prompt": "..."`,
    through the chat template when `chat`), or as chat messages (`"messages": [{"role": ...,
    "content": ...}]`); text needs the model's `codec`. Text requests stop at the model's
    end-of-turn tokens and at any `stop_tokens` they add; `"stop": "..."` or `["...", ...]`
    adds stop strings (text is cut before the first). The file is read line by line (a huge or
    endless file fails at its first bad line, not by filling memory); lines end at "\n" only,
    so U+2028 inside a JSON string is just a character.
    """
    path = Path(path)
    decoder = msgspec.json.Decoder(type=dict)
    requests, seen = [], set()
    try:
        with path.open("rb") as stream:
            # readline with a limit: an endless or newline-free stream (/dev/zero) fails at
            # its first over-long line instead of filling memory.
            lines = iter(lambda: stream.readline(MAX_LINE_BYTES + 1), b"")
            for number, raw_line in enumerate(lines, 1):
                where = f"{path}:{number}"
                if len(raw_line) > MAX_LINE_BYTES:
                    raise WorkloadError(f"{where}: line longer than {MAX_LINE_BYTES} bytes; one request per line, one JSON object each")
                try:
                    line = raw_line.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise WorkloadError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start}); save the file as UTF-8") from None
                if number == 1:
                    line = line.removeprefix("\ufeff")  # a byte-order mark some editors write first
                if not line.strip():
                    continue
                try:
                    raw = decoder.decode(line)
                    raw.setdefault("id", str(number))
                    move_openai_names(raw)
                    _encode_text(raw, codec, chat)
                    request = msgspec.convert(raw, Request)
                except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                    raise WorkloadError(f"{where}: {exc}") from None
                if request.id in seen:
                    raise WorkloadError(f"{where}: duplicate request id {request.id!r}")
                seen.add(request.id)
                requests.append(request)
    except OSError as exc:
        raise WorkloadError(f"cannot read request file {path}: {exc.strerror}") from None
    if not requests:
        raise WorkloadError(f"{path}: no requests (expected one JSON object per line)")
    return requests


def _encode_text(raw: dict, codec: Optional["TextCodec"], chat: bool) -> None:
    """Turn a text prompt or chat messages into token ids, in place."""
    if isinstance(raw.get("stop"), str):  # OpenAI's form: one string or a list of them
        raw["stop"] = [raw["stop"]]
    if raw.get("stop") and codec is None:
        raise ValueError("stop strings need a model with a tokenizer (the GGUF model); this one takes token ids only")
    messages, prompt = raw.pop("messages", None), raw.get("prompt")
    if messages is None and not isinstance(prompt, str):
        return  # token ids (or a malformed prompt, reported by the conversion)
    if messages is not None and prompt is not None:
        raise ValueError("give either 'prompt' or 'messages', not both")
    if codec is None:
        raise ValueError("text prompts need a model with a tokenizer (the GGUF model); this one takes token ids only")
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
        raw["prompt"] = codec.encode_chat(messages)
    else:
        raw["prompt"] = codec.encode_chat([{"role": "user", "content": prompt}]) if chat else codec.encode(prompt)
    # A text request's own stop_tokens add to the end-of-turn stops (replacing them would
    # let a chat answer run past its turn).
    given = raw.get("stop_tokens", [])
    if isinstance(given, list):  # anything else is reported by the conversion
        raw["stop_tokens"] = list(codec.stop_tokens) + [t for t in given if t not in codec.stop_tokens]


DEMO_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give three tips for staying focused while studying.",
    "Explain in two sentences why the sky is blue.",
    "What is 12 times 12?",
    "Name three primary colors.",
    "Translate 'good morning' into Spanish.",
    "Suggest a name for a friendly robot.",
)


def demo_requests(codec: "TextCodec", max_new_tokens: int = 64, sampling: SamplingParams = SamplingParams()) -> list[Request]:
    """The built-in chat workload: short questions through the chat template, greedy by default."""
    return [
        Request(
            id=f"q{i}", prompt=codec.encode_chat([{"role": "user", "content": q}]), max_new_tokens=max_new_tokens,
            stop_tokens=codec.stop_tokens, sampling=sampling,
        )
        for i, q in enumerate(DEMO_QUESTIONS)
    ]
