"""A request line's OpenAI / vLLM sampling names, mapped onto `Request.sampling` and
`Request.controls` before the line is converted (see `workloads.load_jsonl`).

Accepted at the top level of a request object: temperature, top_p, top_k, seed;
frequency_penalty, presence_penalty, repetition_penalty, min_tokens, logit_bias ({"token id":
bias}); logprobs (chat: true + top_logprobs n; completions: n); response_format
({"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}, {"type":
"json_object"} or {"type": "text"}); vLLM's structured_outputs ({"regex": ...} or {"json":
schema}) and its older guided_regex / guided_json.
"""

from __future__ import annotations

import msgspec

SAMPLING_NAMES = ("temperature", "top_p", "top_k", "seed")
PLAIN_CONTROL_NAMES = ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_tokens")
ANY_JSON_OBJECT = {"type": "object"}


def move_openai_names(raw: dict) -> None:
    """Rewrite `raw` in place: the OpenAI / vLLM names become `sampling` and `controls`
    entries. Giving a name both ways (top level and inside `sampling` / `controls`) is refused."""
    _move(raw, "sampling", {name: raw.pop(name) for name in SAMPLING_NAMES if name in raw})
    controls = {name: raw.pop(name) for name in PLAIN_CONTROL_NAMES if name in raw}
    if "logit_bias" in raw:
        controls["logit_bias"] = _logit_bias(raw.pop("logit_bias"))
    if "logprobs" in raw or "top_logprobs" in raw:
        controls["logprobs"] = _logprobs(raw.pop("logprobs", None), raw.pop("top_logprobs", None))
    grammar = _grammar(raw)
    if grammar:
        controls.update(grammar)
    _move(raw, "controls", controls)


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
        raise ValueError("logit_bias must be an object {\"token id\": bias}")
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
    return out


def _logprobs(logprobs, top_logprobs):
    if isinstance(logprobs, bool) or logprobs is None:  # chat: logprobs: true, top_logprobs: n
        if top_logprobs is not None and not logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (top_logprobs or 0) if logprobs else None
    if top_logprobs is not None:
        raise ValueError("give logprobs: n (completions) or logprobs: true + top_logprobs: n (chat), not both")
    return logprobs  # completions: logprobs: n, checked by ControlParams


def _grammar(raw: dict) -> dict:
    """json_schema (as JSON text) or regex from whichever name the request used."""
    found = []
    fmt = raw.pop("response_format", None)
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise ValueError("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
            found.append({"json_schema": schema})
        elif kind == "json_object":
            found.append({"json_schema": ANY_JSON_OBJECT})
        elif kind != "text":
            raise ValueError(f"response_format type must be json_schema, json_object or text, got {kind!r}")
    structured = raw.pop("structured_outputs", None)
    if structured is not None:
        if not isinstance(structured, dict) or set(structured) - {"regex", "json"} or len(structured) != 1:
            raise ValueError("structured_outputs takes one of {\"regex\": ...} or {\"json\": schema}")
        found.append({"regex": structured["regex"]} if "regex" in structured else {"json_schema": structured["json"]})
    if "guided_regex" in raw:
        found.append({"regex": raw.pop("guided_regex")})
    if "guided_json" in raw:
        found.append({"json_schema": raw.pop("guided_json")})
    if len(found) > 1:
        raise ValueError("give one of response_format, structured_outputs, guided_regex, guided_json")
    if not found:
        return {}
    grammar = found[0]
    if "json_schema" in grammar and not isinstance(grammar["json_schema"], str):
        grammar["json_schema"] = msgspec.json.encode(grammar["json_schema"]).decode()
    return grammar
