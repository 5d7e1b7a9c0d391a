"""The sampling controls over HTTP, on a real `graphrelay serve --port` process driven by the
`openai` client and httpx: each control changes the output against the same request without
it, logprobs come back in OpenAI's chat and completions shapes and equal between streamed and
non-streamed answers (also across a stop-string cut), constrained outputs match their JSON
schema or regex, and bad control values get a 400 naming the parameter while the server keeps
serving.

One server for the module per engine placement (thread or process, where the controls are
checked at admission): the tiny model with random weights and the real tokenizer on the CPU,
with small static control limits (4 logit_bias entries, a 256-state grammar pool) so the
limits are cheap to reach.
"""

from __future__ import annotations

import json
import math
import re

import httpx
import jsonschema
import openai
import pytest

from graphrelay.capture.iteration.controls.logprobs import TokenLogprobs
from graphrelay.capture.serving.detokenize import TextStream
from graphrelay.capture.serving.openai_logprobs import LogprobCursor
from controls_cases import REGEX, SCHEMA
from http_cases import ENGINE_PLACEMENTS, start_server, stop_server, wait_until_idle

MODEL = "tiny"
MAX_BIAS, GRAMMAR_STATES = 4, 256
START_TIMEOUT_S = 300  # tokenizer, model and grammar vocabulary load on a busy CPU
PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "Tell me a story."}]


# Every test runs against both engine placements: a thread in the server, its own process.
@pytest.fixture(scope="module", params=ENGINE_PLACEMENTS)
def server(request):
    process = start_server(request.param + ["--model", MODEL, "--weights", "random", "--tokenizer", "--device", "cpu",
                            "--max-reqs", "2", "--max-batch", "2", "--max-seq-len", "256",
                            "--max-logit-bias", str(MAX_BIAS), "--grammar-states", str(GRAMMAR_STATES)], START_TIMEOUT_S)
    yield process
    stop_server(process)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _text(client, **kwargs) -> str:
    return client.completions.create(model=MODEL, prompt=PROMPT, **kwargs).choices[0].text


def test_logit_bias_forces_a_token(client, codec):
    (token,) = codec.encode(" the")
    args = dict(max_tokens=4, temperature=1.0, seed=5)
    assert _text(client, **args, logit_bias={str(token): 100}) == " the" * 4
    assert _text(client, **args) != " the" * 4


@pytest.mark.parametrize("control", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"frequency_penalty": -2.0},
                                     {"repetition_penalty": 2.0}])
def test_each_penalty_changes_the_output(client, control):
    # Greedy on random weights repeats tokens within 16, so a penalty on repeats shows.
    args = dict(max_tokens=16, temperature=0)
    assert _text(client, **args, extra_body=control) != _text(client, **args)


def test_min_tokens_holds_back_the_end_of_turn_token(client, codec):
    end = {str(t): 100 for t in codec.stop_tokens}  # an end-of-turn token at once, unless min_tokens masks it
    early = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, logit_bias=end)
    held = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, logit_bias=end, extra_body={"min_tokens": 5})
    assert (early.choices[0].finish_reason, early.usage.completion_tokens) == ("stop", 1)
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 6


@pytest.mark.parametrize("text, stop", [("a \U0001d518 b c", ()), ("one XY two XYZ three", ("XYZ",))])
def test_each_piece_carries_the_tokens_whose_text_it_completes(codec, text, stop):
    """Token by token as the engine may send them: a character split over byte tokens, and
    text held back because it may begin a stop string."""
    tokens = codec.encode(text)
    stream = TextStream(codec, stop)
    cursor = LogprobCursor(stream)
    shown, delivered = "", []
    for i, token in enumerate(tokens):
        cursor.add([TokenLogprobs(-float(i), [])])
        piece = stream.push([token])
        entries = cursor.take(piece, stream.stopped)
        shown += piece
        delivered += entries
        for k in range(len(delivered) - len(entries), len(delivered)):  # their text is shown (but at a cut)
            assert stream.stopped or len(codec.decode(tokens[: k + 1])) <= len(shown)
        if stream.stopped:
            break
    if not stream.stopped:
        last = stream.finish()
        delivered += cursor.take(last, True)
        shown += last
    assert [e.logprobs.logprob for e in delivered] == [-float(i) for i in range(len(delivered))], "once each, in order"
    assert shown == (text[: text.index(stop[0])] if stop else text)
    # The text before each token (a token inside a split character starts where the character does).
    kept = [codec.decode(tokens[:i]).rstrip("\ufffd") for i in range(len(delivered))]
    assert all(len(start) < len(shown) for start in kept), "no token that starts after the cut"
    assert [e.offset for e in delivered] == [len(start) for start in kept]


def _check_top(top: list[tuple[str, float]], sampled: tuple[str, float], n: int) -> None:
    values = [lp for _, lp in top]
    assert len(top) == n and values == sorted(values, reverse=True), "top logprobs are the best n, best first"
    assert all(lp <= 0 for lp in values) and sum(math.exp(lp) for lp in values) <= 1 + 1e-5
    assert sampled[1] <= values[0] + 1e-6
    for text, lp in top:
        if text == sampled[0]:
            assert lp == pytest.approx(sampled[1])


def _chat_logprobs(client, stream: bool, **args) -> tuple[str, list[dict]]:
    if not stream:
        choice = client.chat.completions.create(model=MODEL, messages=CHAT, **args).choices[0]
        return choice.message.content, [c.model_dump() for c in choice.logprobs.content]
    text, content = "", []
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **args):
        text += chunk.choices[0].delta.content or ""
        if chunk.choices[0].logprobs is not None:
            content += [c.model_dump() for c in chunk.choices[0].logprobs.content]
    return text, content


def test_chat_logprobs_streamed_equal_non_streamed(client):
    args = dict(max_tokens=10, temperature=0.8, seed=11, logprobs=True, top_logprobs=3)
    text, content = _chat_logprobs(client, stream=False, **args)
    assert _chat_logprobs(client, stream=True, **args) == (text, content)
    assert len(content) == 10 and "".join(c["token"] for c in content) == text
    for c in content:
        assert c["bytes"] == list(c["token"].encode())
        _check_top([(t["token"], t["logprob"]) for t in c["top_logprobs"]], (c["token"], c["logprob"]), 3)
    greedy = _chat_logprobs(client, stream=False, max_tokens=6, temperature=0, logprobs=True, top_logprobs=1)[1]
    assert all(c["top_logprobs"][0]["token"] == c["token"] and c["top_logprobs"][0]["logprob"] == pytest.approx(c["logprob"])
               for c in greedy), "greedy samples the most likely token"


def _completion_logprobs(client, stream: bool, **args) -> tuple[str, dict]:
    if not stream:
        choice = client.completions.create(model=MODEL, prompt=PROMPT, **args).choices[0]
        return choice.text, choice.logprobs.model_dump()
    text, merged = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **args):
        text += chunk.choices[0].text
        for key in merged:
            merged[key] += getattr(chunk.choices[0].logprobs, key)
    return text, merged


def test_completion_logprobs_streamed_equal_non_streamed(client):
    args = dict(max_tokens=10, temperature=0.8, seed=12, logprobs=2)
    text, logprobs = _completion_logprobs(client, stream=False, **args)
    assert _completion_logprobs(client, stream=True, **args) == (text, logprobs)
    tokens = logprobs["tokens"]
    assert len(tokens) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 10
    assert "".join(tokens) == text
    assert logprobs["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    for token, lp, top in zip(tokens, logprobs["token_logprobs"], logprobs["top_logprobs"]):
        items = list(top.items())  # the top 2, then the sampled token when it is not among them
        _check_top(items[:2], (token, lp), 2)
        assert top[token] == pytest.approx(lp) and len(items) == (2 if token in dict(items[:2]) else 3)


def test_a_stop_string_cut_drops_the_logprobs_after_it(client):
    args = dict(max_tokens=16, temperature=0, logprobs=0)
    full, _ = _completion_logprobs(client, stream=False, **args)
    stop = full[len(full) // 2: len(full) // 2 + 2]
    for stream in (False, True):
        text, logprobs = _completion_logprobs(client, stream=stream, stop=stop, **args)
        assert text == full[: full.index(stop)] and text
        joined = "".join(logprobs["tokens"])
        assert joined.startswith(text) and len(joined) - len(logprobs["tokens"][-1]) < len(text), \
            "the last token kept is the one the cut falls in"


def test_json_schema_output_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    answer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=48, seed=3, response_format=fmt)
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)


@pytest.mark.parametrize("grammar", [{"structured_outputs": {"regex": REGEX}}, {"guided_regex": REGEX}])
def test_regex_output_matches_streamed_and_not(client, grammar):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=16, seed=4, extra_body=grammar)
    whole = client.completions.create(**args).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **args))
    assert re.fullmatch(REGEX, whole) and streamed == whole


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


COMPLETION, CHAT_PATH = "/v1/completions", "/v1/chat/completions"
BAD_CONTROLS = {
    "frequency_penalty above 2": (COMPLETION, {"frequency_penalty": 2.5}, "frequency_penalty", "2.0"),
    "presence_penalty of the wrong type": (COMPLETION, {"presence_penalty": "high"}, "presence_penalty", "float"),
    "repetition_penalty zero": (COMPLETION, {"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    "logit_bias above 100": (COMPLETION, {"logit_bias": {"5": 101}}, "logit_bias", "100"),
    "logit_bias key not a token id": (COMPLETION, {"logit_bias": {"the": 1}}, "logit_bias", "token ids"),
    "logit_bias token outside the vocabulary": (COMPLETION, {"logit_bias": {"999999": 1}}, "logit_bias", "vocabulary"),
    "logit_bias past the static width": (COMPLETION, {"logit_bias": {str(t): 1 for t in range(MAX_BIAS + 1)}},
                                         "logit_bias", "--max-logit-bias"),
    "min_tokens negative": (COMPLETION, {"min_tokens": -1}, "min_tokens", ">= 0"),
    "min_tokens with a grammar": (COMPLETION, {"min_tokens": 2, "guided_regex": "a+"}, "min_tokens", "grammar"),
    "completions logprobs above 20": (COMPLETION, {"logprobs": 21}, "logprobs", "0..20"),
    "completions logprobs as a bool": (COMPLETION, {"logprobs": True}, "logprobs", "int"),
    "chat top_logprobs above 20": (CHAT_PATH, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "0..20"),
    "chat top_logprobs without logprobs": (CHAT_PATH, {"top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    "chat logprobs as a number": (CHAT_PATH, {"logprobs": 3}, "logprobs", "bool"),
    "unknown response_format": (COMPLETION, {"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    "json_schema without a schema": (CHAT_PATH, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                                     "response_format", "schema"),
    "regex that does not compile": (COMPLETION, {"guided_regex": "(("}, "guided_regex", "compiled"),
    "grammar too big for the pool": (COMPLETION, {"structured_outputs": {"regex": f"[ab]{{{2 * GRAMMAR_STATES}}}"}},
                                     "structured_outputs", "--grammar-states"),
    "two grammars": (COMPLETION, {"guided_regex": "a+", "guided_json": {"type": "integer"}}, "guided_json", "one of"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONTROLS))
def test_bad_control_gets_400_naming_it_and_the_server_keeps_serving(server, case):
    path, controls, param, said = BAD_CONTROLS[case]
    prompt = {"prompt": PROMPT} if path == COMPLETION else {"messages": CHAT}
    response = _post(server, path, {**prompt, "max_tokens": 4, **controls})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and said in error["message"], error
    assert _post(server, COMPLETION, {"prompt": PROMPT, "max_tokens": 2, "logprobs": 1}).status_code == 200


def test_nothing_leaks(server):
    wait_until_idle(server)
