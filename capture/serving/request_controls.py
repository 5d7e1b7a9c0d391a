"""A request line's OpenAI / vLLM sampling names, mapped onto `Request.sampling` and
`Request.controls` before the line is converted (see `workloads.load_jsonl`).

Accepted at the top level of a request object: temperature, top_p, top_k, seed;
frequency_penalty, presence_penalty, repetition_penalty, min_tokens, logit_bias ({"token id":
bias}); logprobs (chat: true + top_logprobs n; completions: n); response_format
({"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}, {"type":
"json_object"} or {"type": "text"}); vLLM's structured_outputs ({"regex": ...} or {"json":
schema}) and its older guided_regex / guided_json.

The HTTP server takes the same names (`openai_api`) through `control_params`, which also
builds and checks the `ControlParams`; a mistake is a `ControlNameError` naming the
request's own parameter, for OpenAI's error `param`.
"""

from __future__ import annotations

import re
from typing import Collection, Optional

import msgspec

from graphrelay.capture.iteration.controls.params import ControlParams

SAMPLING_NAMES = ("temperature", "top_p", "top_k", "seed")
PLAIN_CONTROL_NAMES = ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_tokens")
GRAMMAR_NAMES = ("response_format", "structured_outputs", "guided_regex", "guided_json")
CONTROL_NAMES = (*PLAIN_CONTROL_NAMES, "logit_bias", "logprobs", "top_logprobs", *GRAMMAR_NAMES)
ANY_JSON_OBJECT = {"type": "object"}


class ControlNameError(ValueError):
    """A control given wrongly; `param` is the name the request used for it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def move_openai_names(raw: dict) -> None:
    """Rewrite `raw` in place: the OpenAI / vLLM names become `sampling` and `controls`
    entries. Giving a name both ways (top level and inside `sampling` / `controls`) is refused."""
    _move(raw, "sampling", {name: raw.pop(name) for name in SAMPLING_NAMES if name in raw})
    _move(raw, "controls", _pop_controls(raw))


def control_params(given: dict) -> Optional[ControlParams]:
    """The `ControlParams` of a request's control names (`given`: name -> value, as sent);
    None when they change nothing, so neutral values need no controls in the engine."""
    fields = _pop_controls(dict(given))
    try:
        params = msgspec.convert(fields, ControlParams)  # type-checked, unlike ControlParams(**fields)
    except (msgspec.ValidationError, ValueError) as exc:
        message = str(exc).replace("ControlParams.", "")
        field = re.search(r"^(\w+)|at `\$\.(\w+)", message)
        name = request_name(next(g for g in field.groups() if g) if field else "", given)
        raise ControlNameError(message if message.startswith(name) else f"{name}: {message}", name) from None
    return None if params == ControlParams() else params


def request_name(field: str, given: Collection[str]) -> str:
    """The request's name for `ControlParams.field` (for errors), `given` the names the request
    used: the grammar's is whichever grammar name it used; chat's logprobs width is top_logprobs."""
    if field in ("json_schema", "regex"):
        return next((name for name in GRAMMAR_NAMES if name in given), "response_format")
    if field == "logprobs" and "top_logprobs" in given:
        return "top_logprobs"
    return field if field in CONTROL_NAMES else next(iter(given), field)


def _pop_controls(raw: dict) -> dict:
    """Pop the control names out of `raw`; returns them as `ControlParams` fields."""
    controls = {name: raw.pop(name) for name in PLAIN_CONTROL_NAMES if name in raw}
    if "logit_bias" in raw:
        controls["logit_bias"] = _logit_bias(raw.pop("logit_bias"))
    if "logprobs" in raw or "top_logprobs" in raw:
        controls["logprobs"] = _logprobs(raw.pop("logprobs", None), raw.pop("top_logprobs", None))
    grammar = _grammar(raw)
    if grammar:
        controls.update(grammar)
    return controls


def _move(raw: dict, field: str, values: dict) -> None:
    if not values:
        return
    nested = raw.setdefault(field, {})
    if not isinstance(nested, dict):
        raise ValueError(f"'{field}' must be an object")
    both = sorted(set(values) & set(nested))
    if both:
        raise ValueError(f"{both} given both at the top level and inside '{field}'; give each once")
    nested.update(values)


def _logit_bias(bias) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise ControlNameError("logit_bias must be an object {\"token id\": bias}", "logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ControlNameError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
    return out


def _logprobs(logprobs, top_logprobs):
    if isinstance(logprobs, bool) or logprobs is None:  # chat: logprobs: true, top_logprobs: n
        if top_logprobs is not None and not logprobs:
            raise ControlNameError("top_logprobs needs logprobs: true", "top_logprobs")
        return (top_logprobs or 0) if logprobs else None
    if top_logprobs is not None:
        raise ControlNameError("give logprobs: n (completions) or logprobs: true + top_logprobs: n (chat), not both",
                               "top_logprobs")
    return logprobs  # completions: logprobs: n, checked by ControlParams


def _grammar(raw: dict) -> dict:
    """json_schema (as JSON text) or regex from whichever name the request used."""
    found = []  # (name, grammar)
    fmt = raw.pop("response_format", None)
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise ControlNameError("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                                       "response_format")
            found.append(("response_format", {"json_schema": schema}))
        elif kind == "json_object":
            found.append(("response_format", {"json_schema": ANY_JSON_OBJECT}))
        elif kind != "text":
            raise ControlNameError(f"response_format type must be json_schema, json_object or text, got {kind!r}",
                                   "response_format")
    structured = raw.pop("structured_outputs", None)
    if structured is not None:
        if not isinstance(structured, dict) or set(structured) - {"regex", "json"} or len(structured) != 1:
            raise ControlNameError("structured_outputs takes one of {\"regex\": ...} or {\"json\": schema}",
                                   "structured_outputs")
        found.append(("structured_outputs", {"regex": structured["regex"]} if "regex" in structured
                      else {"json_schema": structured["json"]}))
    if "guided_regex" in raw:
        found.append(("guided_regex", {"regex": raw.pop("guided_regex")}))
    if "guided_json" in raw:
        found.append(("guided_json", {"json_schema": raw.pop("guided_json")}))
    if len(found) > 1:
        raise ControlNameError("give one of response_format, structured_outputs, guided_regex, guided_json", found[1][0])
    if not found:
        return {}
    name, grammar = found[0]
    if "regex" in grammar and not isinstance(grammar["regex"], str):
        raise ControlNameError(f"{name}: the regex must be a string", name)
    if "json_schema" in grammar and not isinstance(grammar["json_schema"], str):
        grammar["json_schema"] = msgspec.json.encode(grammar["json_schema"]).decode()
    return grammar
