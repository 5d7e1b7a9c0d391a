"""`graphrelay bench json`'s workload: five JSON schemas, chat prompts asking for them, and
the check that an output parses and validates.

The schemas are the shapes users send (a nested record, an enum beside an integer range, an
array of objects with required fields, booleans and numbers, string patterns). Every string
has a maxLength and every array a maxItems: a constrained output then always has an end, so
`max_new_tokens` can be set above the longest one and a `length` finish means the model
rambled inside the bounds, not that the schema allowed no end. Each prompt states the schema,
as a user of a small model would, so the model's own choices mostly fit it already.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import jsonschema
import msgspec

from graphrelay.capture.iteration.controls.params import ControlParams
from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.model.text import TextCodec
from graphrelay.capture.serving.workloads import DEMO_QUESTIONS, Request, derived_seed


def _text(max_length: int) -> dict[str, Any]:
    return {"type": "string", "minLength": 1, "maxLength": max_length}


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


SCHEMAS: dict[str, dict[str, Any]] = {
    "person": _object({
        "name": _text(40), "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": _object({"street": _text(60), "city": _text(40),
                            "postcode": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    }),
    "review": _object({
        "product": _text(40), "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "sentiment": {"type": "string", "enum": ["positive", "neutral", "negative"]},
    }),
    "order": _object({
        "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": _object({
            "name": _text(30), "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
            "unit": {"type": "string", "enum": ["piece", "kg", "litre", "pack"]},
        })},
    }),
    "listing": _object({
        "title": _text(50), "price": {"type": "number", "minimum": 0}, "in_stock": {"type": "boolean"},
        "on_sale": {"type": "boolean"}, "weight_kg": {"type": "number", "minimum": 0},
    }),
    "booking": _object({
        "guest": _text(40), "date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"},
        "time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
        "room": {"type": "string", "pattern": "^[A-D]-[0-9]{3}$"},
    }),
}

# Per schema, what the request describes; a workload cycles through them.
TASKS: dict[str, tuple[str, ...]] = {
    "person": (
        "Anna Berg is 34 and lives at 12 Lake Road, Springfield, postcode 40213.",
        "Make up a person: a retired teacher living in a small coastal town.",
        "Tom Okafor, 27, moved to 5 Hill Street in Riverton (postcode 10027) last year.",
        "Describe a fictional shop owner from a mountain village.",
    ),
    "review": (
        "Review: 'The kettle boils fast but the lid broke after a week.'",
        "Review: 'Best headphones I have owned, comfortable all day.'",
        "Review: 'The chair is fine. Nothing special, does the job.'",
        "Write a short review of a pizza place you liked.",
    ),
    "order": (
        "I need two kilos of apples, a pack of rice and three litres of milk.",
        "Order the ingredients for pancakes for four people.",
        "Buy 6 eggs, one loaf of bread and a pack of butter.",
        "List what to buy for a picnic for two.",
    ),
    "listing": (
        "A used mountain bike, 14.5 kg, for 320 euros, available now, not discounted.",
        "A wooden desk lamp on sale at 19.99, currently out of stock, weighs 1.2 kg.",
        "Make up a listing for a second-hand guitar.",
        "A box of 12 coloured pencils, 0.3 kg, 4.50, in stock and on sale.",
    ),
    "booking": (
        "Book room B-204 for Maria Lopez on 2025-03-14 at 18:30.",
        "Reserve a room for John Smith next Friday evening.",
        "Alex Chen wants room A-101 on 2024-12-02 at 09:00.",
        "Make up a hotel booking for a business trip in June.",
    ),
}

TEMPERATURE, TOP_P = 0.8, 0.95  # the seeded half of the requests: a typical chat setting


def prompt_text(schema_name: str, task: str) -> str:
    schema = json.dumps(SCHEMAS[schema_name], separators=(",", ":"))
    return f"{task}\nReply with only a JSON object that follows this JSON schema:\n{schema}"


def sampling_for(index: int, seed: int) -> SamplingParams:
    """Even requests greedy, odd ones seeded sampling: both paths in every batch."""
    if index % 2 == 0:
        return SamplingParams()
    return SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, seed=derived_seed(seed, index))


def build_requests(codec: TextCodec, constrained: int, unconstrained: int, json_tokens: int, plain_tokens: int,
                   seed: int = 0) -> list[Request]:
    """`constrained` requests cycling through the schemas (and each schema's tasks), with the
    `unconstrained` chat questions spread evenly among them, so the two kinds share batches."""
    names = list(SCHEMAS)
    json_requests = []
    for i in range(constrained):
        name = names[i % len(names)]
        tasks = TASKS[name]
        messages = [{"role": "user", "content": prompt_text(name, tasks[(i // len(names)) % len(tasks)])}]
        controls = ControlParams(json_schema=json.dumps(SCHEMAS[name]))
        json_requests.append(Request(id=f"{name}-{i}", prompt=codec.encode_chat(messages), max_new_tokens=json_tokens,
                                     stop_tokens=codec.stop_tokens, sampling=sampling_for(i, seed), controls=controls))
    plain = [Request(id=f"plain-{j}", prompt=codec.encode_chat([{"role": "user", "content": DEMO_QUESTIONS[j % len(DEMO_QUESTIONS)]}]),
                     max_new_tokens=plain_tokens, stop_tokens=codec.stop_tokens, sampling=sampling_for(j, seed + 1))
             for j in range(unconstrained)]
    return interleave(json_requests, plain)


def interleave(major: list[Request], minor: list[Request]) -> list[Request]:
    """`minor` spread evenly through `major`, order within each kept."""
    if not minor:
        return list(major)
    every = max(1, len(major) // len(minor))
    out, rest = [], list(minor)
    for i, request in enumerate(major):
        out.append(request)
        if rest and (i + 1) % every == 0:
            out.append(rest.pop(0))
    return out + rest


def schema_of(request: Request) -> Optional[str]:
    """The name of the schema a request is constrained to, None for an unconstrained one."""
    if request.controls is None or request.controls.json_schema is None:
        return None
    return next(name for name, schema in SCHEMAS.items()
                if msgspec.json.decode(request.controls.json_schema) == schema)


class Verdict(msgspec.Struct, frozen=True):
    """One constrained output: whether it parses, whether it validates, and if not, the
    schema keywords it breaks (e.g. "maximum") and the most relevant message."""

    parses: bool
    valid: bool
    keywords: tuple[str, ...] = ()
    error: Optional[str] = None


def check(text: str, schema_name: str) -> Verdict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        return Verdict(False, False, ("json",), f"not JSON: {error}")
    schema = SCHEMAS[schema_name]
    errors = list(jsonschema.validators.validator_for(schema)(schema).iter_errors(value))
    if not errors:
        return Verdict(True, True)
    return Verdict(True, False, tuple(sorted({e.validator for e in errors})), jsonschema.exceptions.best_match(errors).message)
