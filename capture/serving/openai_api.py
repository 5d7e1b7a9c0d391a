"""The OpenAI-compatible request and response shapes, and their validation.

Requests are decoded by msgspec straight into typed structs (a wrong type is an error naming
the field), then checked against the model (context length, vocabulary) and turned into the
loop's `Request`: everything a bad request can get wrong is found here, before anything is
queued. The sampling controls (penalties, logit_bias, min_tokens, logprobs, response_format
and vLLM's structured outputs) map onto `ControlParams` by the same names and code as a
`serve --requests` line (`request_controls`); their engine limits and grammar compilation
are checked by `check_controls`, off the event loop. Parameters a client may send that
graphrelay does not implement yet are refused when they would change the result, never
silently ignored; unknown fields are ignored, as OpenAI's own server does for forward
compatibility. Responses are plain dicts encoded by msgspec.
"""

from __future__ import annotations

import re
import secrets
import time
import uuid
from typing import Any, Optional, Union

import msgspec

from graphrelay.capture.iteration.controls.params import ControlParams
from graphrelay.capture.iteration.controls.state import SamplingControls
from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.model.text import TextCodec
from graphrelay.capture.serving.request_controls import CONTROL_NAMES, ControlNameError, control_params, request_name
from graphrelay.capture.serving.workloads import Request

MAX_STOP_STRINGS = 16  # each is matched on every piece of text: bound the host's work
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
# The serve flags that set the engine's static control limits, named in place of the config.
SERVE_FLAGS = {"ControlsConfig.max_bias": "--max-logit-bias", "ControlsConfig.grammar_states": "--grammar-states"}
# Set to anything but these, a parameter would change the output in a way not implemented.
_UNSUPPORTED = {"echo": (None, False), "suffix": (None, ""), "best_of": (None, 1), "tools": (None, [])}


class ApiError(Exception):
    """An error answered as OpenAI's error JSON."""

    def __init__(self, message: str, *, status: int = 400, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error", headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.kind = message, status, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    """The parameters both endpoints share."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None  # None: OpenAI's default, 1
    top_p: Optional[float] = None
    top_k: Optional[int] = None  # vLLM's extension: 0 or -1 = no cut
    seed: Optional[int] = None  # None: a fresh random seed
    stop: Union[str, list[str], None] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # Sampling controls (request_controls maps them; the shapes of the last four are checked there).
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None  # vLLM's
    min_tokens: Optional[int] = None  # vLLM's
    ignore_eos: bool = False  # vLLM's: the model's stop tokens do not end the request (benchmarks' fixed lengths)
    logit_bias: Optional[dict[str, float]] = None  # token id -> bias
    response_format: Any = None
    structured_outputs: Any = None  # vLLM's, and its older guided_regex / guided_json
    guided_regex: Optional[str] = None
    guided_json: Any = None
    # Not implemented (see _UNSUPPORTED): accepted only at their neutral values.
    echo: Any = None
    suffix: Any = None
    best_of: Any = None
    tools: Any = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Union[str, list[int]]
    logprobs: Optional[int] = None  # the sampled token's logprob and the top n


class ContentPart(msgspec.Struct):
    type: str
    text: Optional[str] = None


class ChatMessage(msgspec.Struct):
    role: str
    content: Union[str, list[ContentPart], None] = None


class ChatRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None  # with logprobs: true


class Prepared(msgspec.Struct):
    """A validated request, ready for the loop."""

    request: Request
    stream: bool
    include_usage: bool
    created: int  # unix seconds, as OpenAI stamps responses
    control_names: tuple[str, ...] = ()  # the control parameters the request gave, for errors


def decode(body: bytes, kind: type) -> Any:
    """Body JSON into `kind`; a malformed body or a wrong type is a 400 naming the field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise ApiError(f"invalid request: {exc}", param=_field_of(str(exc)), code="invalid_type") from None
    except msgspec.DecodeError as exc:
        raise ApiError(f"the body is not valid JSON: {exc}", code="invalid_json") from None


def _field_of(message: str) -> Optional[str]:
    """The field a msgspec validation message is about, in OpenAI's `param` form."""
    where = re.search(r"at `\$\.?(.*)`$", message)
    missing = re.match(r"Object missing required field `(\w+)`", message)
    parent = where.group(1) if where else ""
    if missing:
        return f"{parent}.{missing.group(1)}" if parent else missing.group(1)
    return parent or None


class Limits(msgspec.Struct, frozen=True):
    """What the served model accepts."""

    model_name: str
    max_seq_len: int
    vocab_size: int
    max_top_k: Optional[int] = None  # the engine's static top-k width (None: any)
    controls: bool = False  # the engine was built with sampling controls


def prepare_completion(body: CompletionRequest, codec: TextCodec, limits: Limits) -> Prepared:
    if isinstance(body.prompt, str):
        prompt = codec.encode(body.prompt)
    else:
        # min / max run in C: the per-element scan that names the offender runs only on a bad prompt.
        if body.prompt and not 0 <= min(body.prompt) <= max(body.prompt) < limits.vocab_size:
            bad = next(t for t in body.prompt if not 0 <= t < limits.vocab_size)
            raise ApiError(f"prompt token id {bad} is outside the vocabulary 0..{limits.vocab_size - 1}", param="prompt")
        prompt = list(body.prompt)
    return _prepare(body, prompt, body.max_tokens, DEFAULT_COMPLETION_TOKENS, codec, limits)


def prepare_chat(body: ChatRequest, codec: TextCodec, limits: Limits) -> Prepared:
    if not body.messages:
        raise ApiError("messages must hold at least one message", param="messages")
    messages = []
    for i, m in enumerate(body.messages):
        content = m.content
        if isinstance(content, list):
            if any(p.type != "text" or p.text is None for p in content):
                raise ApiError(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported",
                               param=f"messages[{i}].content")
            content = "".join(p.text for p in content)
        messages.append({"role": m.role, "content": content or ""})
    try:
        prompt = codec.encode_chat(messages)
    except Exception as exc:  # the template is the model's (jinja): any failure is the messages' fault
        raise ApiError(f"messages do not fit the model's chat template: {exc}", param="messages") from None
    if body.max_tokens is not None and body.max_completion_tokens is not None and body.max_tokens != body.max_completion_tokens:
        raise ApiError("max_tokens and max_completion_tokens differ; give one", param="max_completion_tokens")
    wanted = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return _prepare(body, prompt, wanted, None, codec, limits)


def _prepare(body: _Sampling, prompt: list[int], max_tokens: Optional[int], default: Optional[int],
             codec: TextCodec, limits: Limits) -> Prepared:
    if body.model is not None and body.model != limits.model_name:
        raise ApiError(f"model {body.model!r} is not served here; this server serves {limits.model_name!r} (GET /v1/models)",
                       param="model", code="model_not_found")
    for name, neutral in _UNSUPPORTED.items():
        if getattr(body, name) not in neutral:
            raise ApiError(f"{name} is not supported yet; leave it out", param=name, code="unsupported_parameter")
    if body.n != 1:
        raise ApiError(f"n={body.n}: only one choice per request (n=1) is supported; send n requests", param="n")
    if not prompt:
        raise ApiError("the prompt is empty", param="prompt")
    room = limits.max_seq_len - len(prompt)
    if room < 1:
        raise ApiError(f"the prompt is {len(prompt)} tokens; this server's context is {limits.max_seq_len} tokens, "
                       f"which leaves no room for a completion; shorten the prompt", param="prompt", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = room if default is None else min(default, room)
    if max_tokens < 1:
        raise ApiError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if max_tokens > room:
        raise ApiError(f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceed this server's context of "
                       f"{limits.max_seq_len} tokens; ask for at most {room}", param="max_tokens", code="context_length_exceeded")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise ApiError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings", param="stop")
    top_k = body.top_k if body.top_k is not None else 0
    if top_k < -1:
        raise ApiError(f"top_k must be -1 or 0 (no cut) or a positive int, got {top_k}", param="top_k")
    if limits.max_top_k is not None and top_k > limits.max_top_k:
        raise ApiError(f"top_k {top_k} is above this server's limit of {limits.max_top_k} (its --max-top-k)", param="top_k")
    try:
        sampling = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature, top_k=max(top_k, 0),
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=secrets.randbits(63) if body.seed is None else body.seed,
        )
    except ValueError as exc:
        raise ApiError(str(exc).replace("SamplingParams.", ""), param=str(exc).split(".")[1].split(" ")[0]) from None
    given = {name: getattr(body, name) for name in CONTROL_NAMES if getattr(body, name, None) is not None}
    try:
        controls = control_params(given)
    except ControlNameError as exc:
        raise ApiError(str(exc), param=exc.param) from None
    if controls is not None and not limits.controls:
        name = request_name(_changed_fields(controls)[0], given)
        raise ApiError(f"{name} needs the engine's sampling controls, and this server was started without them "
                       f"(serve --no-controls); leave {name} out or restart the server without --no-controls",
                       param=name, code="controls_disabled")
    request = Request(id=uuid.uuid4().hex, prompt=prompt, max_new_tokens=max_tokens,
                      stop_tokens=() if body.ignore_eos else codec.stop_tokens, sampling=sampling, stop=stop,
                      controls=controls)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return Prepared(request, body.stream, include_usage, int(time.time()), tuple(given))


def check_controls(controls: SamplingControls, prepared: Prepared) -> None:
    """The engine's limits on the request's controls (logit_bias entries, the grammar pool)
    and its grammar's compilation, which can take seconds: run it off the event loop."""
    params = prepared.request.controls
    try:
        controls.check(params, prepared.request.stop_tokens)
    except ValueError as exc:
        raise controls_error(str(exc), prepared) from None


def controls_error(message: str, prepared: Prepared) -> ApiError:
    """The 400 for the engine's refusal of a request's controls, named by the request's own
    parameter (and the server's flags rather than the engine's config names)."""
    # The engine's messages begin with the field they are about; any other is the grammar's.
    field = re.match(r"\w+", message).group()
    name = request_name(field if field in ControlParams.__struct_fields__ else "json_schema", prepared.control_names)
    for config, flag in SERVE_FLAGS.items():
        message = message.replace(config, flag)
    return ApiError(f"{name}: {message}", param=name)


def _changed_fields(params: ControlParams) -> list[str]:
    neutral = ControlParams()
    return [f for f in ControlParams.__struct_fields__ if getattr(params, f) != getattr(neutral, f)]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
