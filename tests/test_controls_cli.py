"""Serve JSONL takes the names an OpenAI or vLLM user sends, and serve --json carries the
logprobs; on the real model, JSON-schema and regex requests come back valid."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from graphrelay.capture.serving.cli import serve_main
from graphrelay.capture.serving.request_controls import move_openai_names

TINY = ["--model", "tiny", "--device", "cpu", "--quiet"]


def test_openai_and_vllm_names_map_onto_sampling_and_controls():
    raw = {"temperature": 0.5, "top_k": 7, "frequency_penalty": 0.5, "repetition_penalty": 1.1, "min_tokens": 3,
           "logit_bias": {"12": -5}, "logprobs": True, "top_logprobs": 4,
           "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}}
    move_openai_names(raw)
    assert raw == {"sampling": {"temperature": 0.5, "top_k": 7},
                   "controls": {"frequency_penalty": 0.5, "repetition_penalty": 1.1, "min_tokens": 3,
                                "logit_bias": {12: -5}, "logprobs": 4, "json_schema": '{"type":"integer"}'}}
    for given, want in (({"logprobs": 3}, 3), ({"logprobs": False}, None), ({"guided_regex": "a+"}, None)):
        move_openai_names(given)
        assert given["controls"].get("logprobs") == want
    vllm = {"structured_outputs": {"regex": "[0-9]+"}}
    move_openai_names(vllm)
    assert vllm["controls"] == {"regex": "[0-9]+"}


@pytest.mark.parametrize("raw, message", [
    ({"temperature": 1.0, "sampling": {"temperature": 0.5}}, "both at the top level"),
    ({"logprobs": 2, "top_logprobs": 2}, "not both"),
    ({"response_format": {"type": "yaml"}}, "json_schema, json_object or text"),
    ({"guided_regex": "a", "guided_json": {}}, "give one of"),
    ({"logit_bias": {"x": 1}}, "token ids"),
])
def test_conflicting_or_malformed_names_are_refused(raw, message):
    with pytest.raises(ValueError, match=message):
        move_openai_names(raw)


def test_serve_json_carries_logprobs_and_each_control_acts(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text(
        '{"id": "plain", "prompt": [5, 6, 7], "max_new_tokens": 4}\n'
        '{"id": "biased", "prompt": [5, 6, 7], "max_new_tokens": 4, "logit_bias": {"42": 100}, "logprobs": 2}\n'
        '{"id": "chat-style", "prompt": [5, 6, 7], "max_new_tokens": 4, "logprobs": true, "top_logprobs": 1}\n'
    )
    out = tmp_path / "out.json"
    assert serve_main([*TINY, "--requests", str(path), "--json", str(out)]) == 0
    outputs = {o["id"]: o for o in json.loads(out.read_text())["outputs"]}
    assert outputs["biased"]["tokens"] == [42] * 4 != outputs["plain"]["tokens"]
    assert outputs["plain"]["logprobs"] is None
    assert [len(lp["top"]) for lp in outputs["biased"]["logprobs"]] == [2] * 4
    chat = outputs["chat-style"]
    assert chat["tokens"] == outputs["plain"]["tokens"]  # logprobs alone change nothing
    for token, lp in zip(chat["tokens"], chat["logprobs"]):
        assert lp["top"][0][0] == token and lp["logprob"] == pytest.approx(lp["top"][0][1])  # greedy: the top one


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
          "required": ["city", "population"]}


def test_real_model_json_schema_and_regex_outputs_are_valid(tmp_path):
    path = tmp_path / "requests.jsonl"
    question = "Describe Paris as JSON with its city name and population."
    lines = [
        {"id": "schema", "prompt": question, "max_new_tokens": 48,
         "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}},
        {"id": "regex", "prompt": "What is 12 times 12?", "max_new_tokens": 8, "structured_outputs": {"regex": "[0-9]{1,4}"}},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.json"
    assert serve_main(["--device", "cpu", "--quiet", "--requests", str(path), "--json", str(out), "--show", "0"]) == 0
    outputs = {o["id"]: o for o in json.loads(out.read_text())["outputs"]}
    assert outputs["schema"]["finish_reason"] == "stop", outputs["schema"]
    jsonschema.validate(json.loads(outputs["schema"]["text"]), SCHEMA)
    assert re.fullmatch("[0-9]{1,4}", outputs["regex"]["text"].strip()), outputs["regex"]


def test_bench_controls_smoke_times_every_variant(tmp_path):
    from graphrelay.tools.bench import bench_main
    from graphrelay.tools.bench.controls import VARIANTS

    assert bench_main(["controls", "--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "controls_bench.json").read_text())
    assert set(report["rows"]) == set(VARIANTS) and report["smoke"] is True
    assert all(row["step_us"] > 0 for row in report["rows"].values())
    assert report["rows"]["off"]["controls_bytes"] == 0 < report["rows"]["idle"]["controls_bytes"]
    assert all(t["measured"] is None for t in report["targets"])  # smoke numbers are not GPU numbers
