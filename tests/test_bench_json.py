"""`graphrelay bench json`: the smoke run (the tiny random model with the real tokenizer, five
schemas, constrained and plain requests in one batch, n-gram speculation off and on, on CPU),
the output check, the workload, the targets and bad options.

A random model under a grammar is a hard test of the automaton: it picks any token the mask
lets through, so every output that parses and completes shows the mask and the state advance
(plain and under verify) are right."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from bench_cases import assert_needs_gpu, assert_usage_error, smoke_report
from graphrelay.tools.bench import json_bench
from graphrelay.tools.bench.json_workload import SCHEMAS, build_requests, check, interleave, schema_of

@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path, even on a GPU host


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    return smoke_report(tmp_path_factory, "json")


# ---- the smoke run ----------------------------------------------------------------------------


def test_smoke_runs_spec_off_and_on_over_every_schema(smoke):
    out, report = smoke
    assert report["benchmark"] == "json" and report["smoke"] is True and "random weights" in report["source"]
    assert report["environment"]["command"] == f"graphrelay bench json --smoke --out {out}"
    assert list(report["runs"]) == ["none", "ngram"]
    grammars = report["grammars"]
    assert set(grammars["schemas"]) == set(SCHEMAS)
    assert all(g["states"] > 1 and g["compile_s"] > 0 for g in grammars["schemas"].values())
    assert grammars["grammar_states"] == grammars["states"] + 1  # all five resident at once
    for run in report["runs"].values():
        assert run["requests"] == 12 and run["constrained"] == 10
        assert all(c["requests"] == 2 for c in run["per_schema"].values())
        assert run["finish_reasons"]["unconstrained"] == {"length": 2}  # 8 tokens, no end of turn learned
        assert run["host_syncs_counted"] is False and run["tokens_per_s"] > 0


def test_smoke_constrained_outputs_complete_parse_and_validate(smoke):
    """The automaton ends every output itself (EOS allowed only once the JSON is complete), so
    no constrained request may hit max tokens, and every one must parse and validate: a random
    model tries every value the grammar allows, numeric bounds included."""
    for mode, run in smoke[1]["runs"].items():
        assert run["finish_reasons"]["constrained"] == {"stop": 10}, mode
        assert run["constrained_length_finishes"] == 0 and run["parses"] == 10, (mode, run["failures"])
        assert run["broken_keywords"] == {}, (mode, run["failures"])
        for name, counts in run["per_schema"].items():
            assert counts["valid"] == counts["requests"], (mode, name, run["failures"])


def test_smoke_speculative_outputs_equal_plain_ones(smoke):
    ngram = smoke[1]["runs"]["ngram"]
    assert ngram["divergences"] == [] and smoke[1]["runs"]["none"]["divergences"] is None
    (identity,) = [t for t in smoke[1]["targets"] if t["name"].startswith("requests whose ngram output differs")]
    assert identity["measured"] == 0 and identity["met"] is True


# ---- the output check and the workload -----------------------------------------------------


def test_schemas_are_valid_json_schemas():
    assert len(SCHEMAS) == 5
    for schema in SCHEMAS.values():
        jsonschema.validators.validator_for(schema).check_schema(schema)


def test_check_tells_valid_invalid_and_unparsable_apart():
    good = '{"product": "kettle", "rating": 2, "sentiment": "negative"}'
    assert check(good, "review").valid
    out_of_range = check('{"product": "kettle", "rating": 9, "sentiment": "negative"}', "review")
    assert out_of_range.parses and not out_of_range.valid and out_of_range.keywords == ("maximum",)
    assert check('{"product": "kettle", "rating": 2}', "review").keywords == ("required",)
    cut = check('{"product": "ket', "review")
    assert not cut.parses and cut.keywords == ("json",) and cut.error.startswith("not JSON")
    assert check('{"guest": "Al", "date": "2024-13-01", "time": "09:00", "room": "A-101"}', "booking").keywords == ("pattern",)


def test_requests_cycle_schemas_mix_sampling_and_spread_plain_ones(codec):
    requests = build_requests(codec, 10, 2, 160, 8, seed=3)
    names = [schema_of(r) for r in requests]
    assert names.count(None) == 2 and [n for n in names if n] == list(SCHEMAS) * 2
    assert 0 < names.index(None) < len(names) - 1  # a plain request among the constrained ones
    constrained = [r for r in requests if r.controls is not None]
    assert {r.sampling.temperature == 0 for r in constrained} == {True, False}  # greedy and seeded
    assert len({r.sampling.seed for r in constrained if r.sampling.temperature}) == 5
    assert all(r.max_new_tokens == 160 and r.stop_tokens == codec.stop_tokens for r in constrained)
    assert len({r.id for r in requests}) == 12


def test_interleave_keeps_order_and_every_request():
    assert interleave([1, 2, 3, 4], ["a", "b"]) == [1, 2, "a", 3, 4, "b"]
    assert interleave([1, 2], ["a", "b", "c"]) == [1, "a", 2, "b", "c"]
    assert interleave([1, 2], []) == [1, 2]


# ---- targets ----------------------------------------------------------------------------------


def test_targets_judge_validity_scale_syncs_and_identity():
    def run(valid, constrained=200, syncs=0.0, counted=True, divergences=None):
        return {"valid_percent": 100.0 * valid / constrained, "constrained": constrained, "host_syncs_per_iter": syncs,
                "host_syncs_counted": counted, "divergences": divergences}

    targets = {t.name: t for t in json_bench.json_targets(
        {"none": run(200), "ngram": run(199, syncs=0.5, divergences=[{"id": "x", "first_position": 3}])}, 5)}
    assert targets["constrained outputs that parse and validate, spec none (of 200)"].met is True
    assert targets["constrained outputs that parse and validate, spec ngram (of 200)"].met is False
    assert targets["constrained requests per run"].met is True and targets["schemas"].met is True
    assert targets["host syncs per iteration, overlap + ngram"].met is False
    assert targets["requests whose ngram output differs from spec off"].measured == 1
    cpu = {t.name: t for t in json_bench.json_targets({"none": run(5, 5, counted=False)}, 5)}
    assert cpu["host syncs per iteration, overlap + ngram"].measured is None  # not counted, not zero
    assert cpu["requests whose ngram output differs from spec off"].measured is None


# ---- bad options ------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--requests", "0"], "0 must be >= 1"),
    (["--unconstrained", "-1"], "--unconstrained must be >= 0"),
    (["--batch", "300"], "--batch value 300 is out of range 1..256"),
    (["--spec-k", "17"], "--spec-k value 17 is out of range 1..16"),
    (["--ngram", "1,9"], "got 1,9"),
    (["--weights", "random", "--gguf", "x.gguf"], "does not go with --gguf"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_options_exit_2_with_one_line(argv, message, capsys, tmp_path):
    assert_usage_error("json", argv, message, capsys, tmp_path)


def test_no_gpu_without_smoke_exits_2(capsys, tmp_path):
    assert_needs_gpu("json", capsys, tmp_path)


def test_the_table_leaves_out_schemas_no_request_used(smoke):
    """`--requests 2` compiles two of the five schemas: the table lists the used ones only
    (it once looked the others up among the compiled grammars and crashed after the runs)."""
    _, report = smoke
    used = "person"
    trimmed = json.loads(json.dumps(report))
    trimmed["grammars"]["schemas"] = {used: report["grammars"]["schemas"][used]}
    for run in trimmed["runs"].values():
        for name, counts in run["per_schema"].items():
            if name != used:
                counts.update(requests=0, parses=0, valid=0, length=0, tokens=0)
    text = json_bench.table(trimmed)
    assert f"none / {used}" in text and "none / order" not in text
