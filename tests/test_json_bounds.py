"""Numeric bounds of JSON schemas enforced by the grammar (outlines-core alone drops them): the
range regexes accept exactly the numbers inside the bounds, written as JSON writes them, and
whole schemas compile to regexes that refuse out-of-range values wherever they sit. Also the
grammar compiler's bounded cache."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrelay.capture.iteration.controls.grammar import GrammarCompiler, made_up_token_strings, vocabulary
from graphrelay.capture.iteration.controls.json_bounds import enforce_numeric_bounds, integer_regex, number_regex

bound = st.one_of(st.none(), st.integers(-1500, 1500), st.integers(-12, 12))


def _inside(value, low, high) -> bool:
    return (low is None or value >= low) and (high is None or value <= high)


def _matches(regex, text: str) -> bool:
    return regex is not None and re.fullmatch(regex, text) is not None


@settings(max_examples=300, deadline=None)
@given(bound, bound, st.lists(st.integers(-3000, 3000), min_size=20, max_size=60))
def test_integer_regex_accepts_exactly_the_range(low, high, values):
    regex = integer_regex(low, high)
    probes = set(values) | {v for b in (low, high) if b is not None for v in (b - 1, b, b + 1)} | {0, -1, 1}
    for value in probes:
        assert _matches(regex, str(value)) == _inside(value, low, high), (low, high, value, regex)
    assert not _matches(regex, "007") and not _matches(regex, "-0") and not _matches(regex, "1.0")


@settings(max_examples=200, deadline=None)
@given(bound, bound, st.lists(st.tuples(st.integers(-2000, 2000), st.sampled_from(["", ".0", ".5", ".25", ".000"])),
                              min_size=20, max_size=60))
def test_number_regex_accepts_exactly_the_range(low, high, values):
    regex = number_regex(low, high)
    probes = [(v, f) for v, f in values] + [(b, f) for b in (low, high) if b is not None for f in ("", ".0", ".5")]
    for whole, fraction in probes:
        for text in (f"{whole}{fraction}", f"-{abs(whole)}{fraction}"):
            if float(text) == 0 and text.startswith("-"):  # -0 may be left out, never wrongly let in
                assert not _matches(regex, text) or _inside(0, low, high)
                continue
            assert _matches(regex, text) == _inside(float(text), low, high), (low, high, text, regex)
    assert not _matches(regex, "01.5")


SCHEMA = {
    "$defs": {"quantity": {"type": "integer", "minimum": 1, "maximum": 100}},
    "type": "object",
    "properties": {
        "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "required": ["q", "price"],
            "properties": {"q": {"$ref": "#/$defs/quantity"}, "price": {"type": "number", "minimum": 0}}}},
        "rating": {"anyOf": [{"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 6}, {"type": "null"}]},
        "default_ok": {"type": "string", "maxLength": 4, "default": {"type": "integer", "maximum": 1}},
    },
    "required": ["items", "rating"],
}


@pytest.mark.parametrize("text, valid", [
    ('{"items":[{"q":5,"price":1.5}],"rating":5}', True),
    ('{"items":[{"q":100,"price":0}],"rating":null}', True),
    ('{"items":[{"q":101,"price":1.5}],"rating":5}', False),  # above maximum, behind a $ref
    ('{"items":[{"q":0,"price":1.5}],"rating":5}', False),  # below minimum
    ('{"items":[{"q":5,"price":-0.5}],"rating":5}', False),  # a negative price
    ('{"items":[],"rating":6}', False),  # exclusiveMaximum
    ('{"items":[],"rating":0}', False),  # exclusiveMinimum
])
def test_schema_regex_refuses_out_of_range_values(text, valid):
    assert _matches(enforce_numeric_bounds(json.dumps(SCHEMA)), text) == valid


def test_unbounded_numbers_keep_outlines_forms():
    regex = enforce_numeric_bounds(json.dumps({"type": "object", "properties": {"n": {"type": "number"}},
                                               "required": ["n"]}))
    assert _matches(regex, '{"n":-1.5e+3}')  # exponents where no bound needs checking


@pytest.mark.parametrize("schema, message", [
    ({"type": "number", "exclusiveMinimum": 0}, "exclusiveMinimum, which the grammar cannot enforce"),
    ({"type": "number", "minimum": 0.5}, "whole-number bounds on numbers only (use 0 or 1"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "allows no integer"),
    ({"type": "integer", "minimum": "1"}, "minimum '1'; it must be a finite number"),
])
def test_bounds_the_grammar_cannot_enforce_are_refused(schema, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        enforce_numeric_bounds(json.dumps(schema))


def test_compiled_grammar_allows_only_in_range_digits():
    """Through the compiler into the token automaton: after '{"r":' only the digits 1..5 are
    allowed by a rating of 1..5 (a made-up vocabulary of single characters and pairs)."""
    strings = made_up_token_strings(400)
    compiler = GrammarCompiler(vocabulary(strings, eos_token=0), len(strings))
    grammar = compiler.compile("json_schema", json.dumps({
        "type": "object", "properties": {"r": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["r"]}))
    state = 0
    for char in '{"r":':
        state = int(grammar.next[state, strings.index(char)])
    allowed = {strings[t] for t in range(len(strings)) if grammar.allowed[state, t]}
    assert {"1", "2", "3", "4", "5"} <= allowed
    assert not allowed & {"0", "6", "7", "8", "9", "-"}


def test_compiler_keeps_only_the_most_recently_used_grammars():
    """A long-lived server sees many schemas: the compiler's host tables stay bounded."""
    strings = made_up_token_strings(200)
    compiler = GrammarCompiler(vocabulary(strings, eos_token=0), len(strings), cache_size=2)
    first = compiler.compile("regex", "a+")
    compiler.compile("regex", "b+")
    assert compiler.compile("regex", "a+") is first  # a hit refreshes it
    compiler.compile("regex", "c+")  # evicts b+, the least recently used
    assert [key[1] for key in compiler._cache] == ["a+", "c+"]
    with pytest.raises(ValueError, match="cache_size must be a positive int"):
        GrammarCompiler(compiler.vocabulary, len(strings), cache_size=0)
