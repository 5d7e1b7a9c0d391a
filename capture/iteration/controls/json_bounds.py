"""Numeric bounds of a JSON schema, enforced by the grammar.

outlines-core turns `{"type": "integer", "minimum": 1, "maximum": 5}` into the regex of *any*
integer: it drops `minimum` / `maximum`, so a constrained output can break its schema. Before
outlines-core sees a schema, each bounded integer or number is swapped for a placeholder
constant; outlines-core builds the rest of the regex, and each placeholder is replaced by a regex
that matches exactly the JSON numbers inside the bounds (`range_regex`).

Integers: any bounds (inclusive or exclusive, one-sided or both; fractional bounds round
inward). Numbers: inclusive integral bounds, written without an exponent (plain decimals are
valid JSON and keep the bound checkable digit by digit); other number bounds are refused with
the reason rather than silently not enforced.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

FRACTION = r"(\.[0-9]+)?"
ZERO_FRACTION = r"(\.0+)?"  # the upper bound itself, written as 5 or 5.0
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_VALUES = ("const", "enum", "default", "examples")  # data, not subschemas
_PLACEHOLDER = "GRAPHRELAYBOUND{}X"  # letters and digits only: outlines-core copies it verbatim


def same_length_range(low: str, high: str) -> str:
    """Regex of the decimal strings from `low` to `high`, both of one length (low <= high)."""
    if low == high:
        return low
    rest = len(low) - 1
    if low[1:] == "0" * rest and high[1:] == "9" * rest:
        return f"[{low[0]}-{high[0]}]" + ("[0-9]" * rest)
    if low[0] == high[0]:
        return low[0] + same_length_range(low[1:], high[1:])
    parts = [low[0] + same_length_range(low[1:], "9" * rest)]
    if int(high[0]) - int(low[0]) > 1:
        parts.append(f"[{int(low[0]) + 1}-{int(high[0]) - 1}]" + "[0-9]" * rest)
    parts.append(high[0] + same_length_range("0" * rest, high[1:]))
    return "(" + "|".join(parts) + ")"


def natural_range(low: int, high: Optional[int]) -> Optional[str]:
    """Regex of the integers low..high (0 <= low; high None: unbounded) as JSON writes them
    (no leading zeros); None when the range is empty."""
    if high is not None and high < low:
        return None
    parts = []
    top = len(str(high)) if high is not None else len(str(low))
    for digits in range(len(str(low)), top + 1):
        first = low if digits == len(str(low)) else 10 ** (digits - 1)
        last = high if high is not None and digits == top else 10 ** digits - 1
        parts.append(same_length_range(str(first), str(last)))
    if high is None:  # every longer number
        parts.append(f"[1-9][0-9]{{{len(str(low))},}}")
    return "(" + "|".join(parts) + ")"


def integer_regex(low: Optional[int], high: Optional[int]) -> Optional[str]:
    """Regex of the JSON integers in low..high (None: unbounded on that side)."""
    parts = []
    if high is None or high >= 0:
        natural = natural_range(max(low, 0) if low is not None else 0, high)
        parts += [natural] if natural else []
    if low is None or low < 0:  # negatives: "-" and a magnitude in max(1, -high)..-low
        magnitude = natural_range(max(1, -high if high is not None else 1), -low if low is not None else None)
        parts += ["-" + magnitude] if magnitude else []
    return "(" + "|".join(parts) + ")" if parts else None


def _magnitude_number(low: int, high: Optional[int]) -> Optional[str]:
    """Regex of the plain decimals m with low <= m <= high, 0 <= low (high None: unbounded)."""
    if high is None:
        return natural_range(low, None) + FRACTION
    if high < low:
        return None
    below = natural_range(low, high - 1)  # any fraction keeps m < high
    exact = str(high) + ZERO_FRACTION
    return f"({below}{FRACTION}|{exact})" if below else f"({exact})"


def number_regex(low: Optional[int], high: Optional[int]) -> Optional[str]:
    """Regex of the plain JSON decimals in [low, high] (integral bounds, None: unbounded)."""
    parts = []
    if high is None or high >= 0:
        part = _magnitude_number(max(low, 0) if low is not None else 0, high)
        parts += [part] if part else []
    if low is None or low < 0:  # "-" and a magnitude in max(0, -high)..-low
        part = _magnitude_number(max(0, -high) if high is not None else 0, -low if low is not None else None)
        parts += ["-" + part] if part else []
    return "(" + "|".join(parts) + ")" if parts else None


def _number(value: Any, where: str, keyword: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"json_schema: {where} has {keyword} {value!r}; it must be a finite number")
    return value


def _integer_bounds(node: dict, where: str) -> tuple[Optional[int], Optional[int]]:
    low = high = None
    if "minimum" in node:
        low = math.ceil(_number(node["minimum"], where, "minimum"))
    if "exclusiveMinimum" in node:
        low = max(low if low is not None else -math.inf, math.floor(_number(node["exclusiveMinimum"], where, "exclusiveMinimum")) + 1)
    if "maximum" in node:
        high = math.floor(_number(node["maximum"], where, "maximum"))
    if "exclusiveMaximum" in node:
        high = min(high if high is not None else math.inf, math.ceil(_number(node["exclusiveMaximum"], where, "exclusiveMaximum")) - 1)
    return low, high


def _number_bounds(node: dict, where: str) -> tuple[Optional[int], Optional[int]]:
    for keyword in ("exclusiveMinimum", "exclusiveMaximum"):
        if keyword in node:
            raise ValueError(f"json_schema: {where} is a number with {keyword}, which the grammar cannot enforce; "
                             f"use minimum / maximum, or an integer")
    bounds = []
    for keyword in ("minimum", "maximum"):
        value = node.get(keyword)
        if value is not None and _number(value, where, keyword) != int(value):
            raise ValueError(f"json_schema: {where} is a number with {keyword} {value!r}; the grammar enforces "
                             f"whole-number bounds on numbers only (use {math.floor(value)} or {math.ceil(value)}, "
                             f"or an integer)")
        bounds.append(int(value) if value is not None else None)
    return bounds[0], bounds[1]


def _bounded_regex(node: dict, where: str) -> Optional[str]:
    """The regex for a bounded integer / number node, or None for any other node."""
    kind = node.get("type")
    if kind not in ("integer", "number") or not any(k in node for k in _BOUNDS):
        return None
    low, high = (_integer_bounds if kind == "integer" else _number_bounds)(node, where)
    regex = (integer_regex if kind == "integer" else number_regex)(low, high)
    if regex is None:
        raise ValueError(f"json_schema: {where} allows no {kind} (bounds {low}..{high})")
    return regex


def enforce_numeric_bounds(schema: str) -> str:
    """The regex outlines-core builds for `schema` (JSON text), with every bounded integer and
    number enforced (see the module docstring)."""
    from outlines_core.json_schema import build_regex_from_schema

    try:
        tree = json.loads(schema)
    except ValueError as e:
        raise ValueError(f"json_schema is not valid JSON: {e}") from None
    regexes: list[str] = []

    def swap(node: Any, where: str) -> Any:
        if isinstance(node, list):
            return [swap(item, f"{where}[{i}]") for i, item in enumerate(node)]
        if not isinstance(node, dict):
            return node
        regex = _bounded_regex(node, where)
        if regex is not None:
            regexes.append(regex)
            return {"const": _PLACEHOLDER.format(len(regexes) - 1)}
        return {key: value if key in _VALUES else swap(value, f"{where}.{key}") for key, value in node.items()}

    swapped = swap(tree, "the schema")
    try:
        regex = build_regex_from_schema(json.dumps(swapped))
    except Exception as e:  # outlines-core raises its own types for unsupported schemas
        raise ValueError(f"json_schema is not supported by outlines-core: {e}") from None
    for index, bound in enumerate(regexes):
        placeholder = f'"{_PLACEHOLDER.format(index)}"'
        if placeholder not in regex:
            raise ValueError(f"json_schema: a bounded number's placeholder did not survive outlines-core "
                             f"({placeholder}); this schema shape is not supported with numeric bounds")
        regex = regex.replace(placeholder, bound)
    return regex
