"""The OpenAI-compatible HTTP server, as a real process on 127.0.0.1 driven by the `openai`
client and httpx: streamed text equals the non-streamed text, exactly one chunk carries the
finish reason, usage is exact, stop strings cut exactly, bad requests get 400 error JSON and
the server keeps serving, a full server answers 429, a client that disconnects aborts its
request and frees its slot, and SIGTERM shuts down cleanly with exit status 0.

One server for the module per engine placement (a thread in the server, or its own process:
the default, `--engine-placement process`, or `thread`): the tiny model with random weights and the real tokenizer, 2 slots and 2
waiting places (so overload is easy to reach), run on the CPU, without sampling controls (a
request that uses them gets a 400 saying so; test_http_controls serves them).
"""

from __future__ import annotations

import json
import signal

import httpx
import openai
import pytest

from http_cases import ENGINE_PLACEMENTS, health, start_server, stop_server, wait_until_idle

MODEL = "tiny"
SLOTS, WAITING, CONTEXT, BODY_LIMIT = 2, 2, 1024, 65536
START_TIMEOUT_S = 300  # tokenizer and model load on a busy CPU
PROMPT = "The quick brown fox jumps over the lazy dog"


# Every test runs against both engine placements: a thread in the server, its own process.
@pytest.fixture(scope="module", params=ENGINE_PLACEMENTS)
def server(request):
    process = start_server(request.param + ["--model", MODEL, "--weights", "random", "--tokenizer", "--device", "cpu",
                            "--max-reqs", str(SLOTS), "--max-batch", str(SLOTS), "--max-waiting", str(WAITING),
                            "--max-seq-len", str(CONTEXT), "--max-body-bytes", str(BODY_LIMIT), "--no-controls"],
                           START_TIMEOUT_S)
    yield process
    stop_server(process)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_and_health(server):
    models = httpx.get(f"{server.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == CONTEXT
    state = wait_until_idle(server)
    assert state["engine"] == "running" and state["slots"] == SLOTS and state["capacity"] == SLOTS + WAITING
    assert state["device"] == "cpu"  # the engine's, which `bench serve --url` records as the server's


def _stream_completion(client, **kwargs):
    chunks = list(client.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kwargs))
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finishing) == 1, "exactly one chunk carries the finish reason"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None, "the usage chunk comes last"
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, finishing[0].choices[0].finish_reason, chunks[-1].usage


def test_completion_streamed_equals_non_streamed_and_usage_is_exact(client, codec):
    args = dict(prompt=PROMPT, max_tokens=12, temperature=0.8, top_p=0.9, seed=7, extra_body={"top_k": 40})
    whole = client.completions.create(model=MODEL, **args)
    text, reason, usage = _stream_completion(client, **args)
    assert text == whole.choices[0].text and reason == whole.choices[0].finish_reason
    assert usage.prompt_tokens == whole.usage.prompt_tokens == len(codec.encode(PROMPT))
    if reason == "length":
        assert usage.completion_tokens == whole.usage.completion_tokens == 12
    else:  # an end-of-turn token came first
        assert usage.completion_tokens == whole.usage.completion_tokens < 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    other = client.completions.create(model=MODEL, **{**args, "seed": 8})
    assert other.choices[0].text != whole.choices[0].text, "the seed does not reach the sampler"


def test_a_long_text_prompt_is_prepared_off_the_event_loop_and_counted_exactly(client, codec):
    """Past INLINE_PREPARE_CHARS the prompt is tokenized on a worker thread: same answer."""
    from graphrelay.capture.serving.http_server import INLINE_PREPARE_CHARS

    prompt = (PROMPT + ". ") * (INLINE_PREPARE_CHARS // len(PROMPT) + 1)
    assert len(prompt) > INLINE_PREPARE_CHARS and len(codec.encode(prompt)) < CONTEXT - 8
    args = dict(prompt=prompt, max_tokens=4, temperature=0)
    whole = client.completions.create(model=MODEL, **args)
    text, _, usage = _stream_completion(client, **args)
    assert text == whole.choices[0].text
    assert usage.prompt_tokens == whole.usage.prompt_tokens == len(codec.encode(prompt))


def test_token_id_prompt_counts_its_tokens(client):
    out = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0)
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens <= 3


def test_chat_streamed_equals_non_streamed(client, codec):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    args = dict(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0.7, seed=3)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finishing) == 1
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens == len(codec.encode_chat(messages))
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_cut_exactly(client, server):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    full = base.choices[0].text
    assert base.choices[0].finish_reason == "length" and len(full) > 12
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    want = full[: full.index(stop)]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "\x00never"])
    assert cut.choices[0].text == want and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 24
    text, reason, usage = _stream_completion(client, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop)
    assert (text, reason, usage.completion_tokens) == (want, "stop", cut.usage.completion_tokens)
    wait_until_idle(server)


def _post(server, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json"},
                      timeout=60, **kwargs)


BAD_REQUESTS = {
    "unknown model": ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, "model"),
    "max_tokens beyond the context": ("/v1/completions", {"prompt": "hi", "max_tokens": CONTEXT}, "max_tokens"),
    "max_tokens zero": ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    "wrong type": ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    "wrong type, bool for int": ("/v1/completions", {"prompt": "hi", "seed": True}, "seed"),
    "prompt too long": ("/v1/completions", {"prompt": [1] * (CONTEXT + 1), "max_tokens": 1}, "prompt"),
    # long text is tokenized on a worker thread: its error still comes back as the 400
    "text prompt too long": ("/v1/completions", {"prompt": "hello " * (CONTEXT + 1), "max_tokens": 1}, "prompt"),
    "token id outside the vocabulary": ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    "empty prompt": ("/v1/completions", {"prompt": ""}, "prompt"),
    "missing prompt": ("/v1/completions", {"max_tokens": 3}, "prompt"),
    "n above 1": ("/v1/completions", {"prompt": "hi", "n": 2}, "n"),
    "negative temperature": ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    "top_p zero": ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    "top_k below -1": ("/v1/completions", {"prompt": "hi", "top_k": -5}, "top_k"),
    "top_k above the engine's width": ("/v1/completions", {"prompt": "hi", "top_k": 100000}, "top_k"),
    "empty stop string": ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
    "unsupported parameter": ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
    "controls on a server without them": ("/v1/completions", {"prompt": "hi", "frequency_penalty": 0, "logprobs": 2},
                                          "logprobs"),
    "no messages": ("/v1/chat/completions", {"messages": []}, "messages"),
    "message of the wrong shape": ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    "chat max tokens disagree": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 3, "max_completion_tokens": 4},
                                 "max_completion_tokens"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_gets_400_error_json_and_the_server_keeps_serving(server, case):
    path, body, param = BAD_REQUESTS[case]
    response = _post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param
    assert (error["code"] == "controls_disabled") == (case == "controls on a server without them")
    assert _post(server, "/v1/completions", {"prompt": "still there?", "max_tokens": 2}).status_code == 200


def test_neutral_controls_need_no_controls_in_the_engine(server):
    neutral = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "logit_bias": {}, "min_tokens": 0,
               "logprobs": False, "response_format": {"type": "text"}}
    response = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                       **neutral})
    assert response.status_code == 200 and response.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("body", [b"{not json", b"", b'["a list"]', b"\xff\xfe"])
def test_invalid_json_gets_400(server, body):
    response = _post(server, "/v1/completions", body)
    assert response.status_code == 400 and response.json()["error"]["message"]


def test_oversized_body_gets_400(server):
    response = _post(server, "/v1/completions", {"prompt": "x" * (BODY_LIMIT + 1)})
    assert response.status_code == 400 and response.json()["error"]["code"] == "body_too_large"
    assert _post(server, "/v1/completions", {"prompt": "still there?", "max_tokens": 2}).status_code == 200


def test_unknown_path_gets_openai_error_json(server):
    response = httpx.get(f"{server.url}/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


def _open_stream(http: httpx.Client, max_tokens: int = CONTEXT - 64):
    """A long streaming request, admitted once its first event has arrived."""
    request = http.build_request("POST", "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens, "stream": True, "temperature": 0})
    response = http.send(request, stream=True)
    assert response.status_code == 200
    lines = response.iter_lines()
    assert next(lines).startswith("data: ")
    return response, lines


def test_past_the_queue_bound_the_server_answers_429_and_frees_everything(server):
    aborted = health(server)["finished"].get("abort", 0)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        streams = [_open_stream(http) for _ in range(SLOTS + WAITING)]
        busy = _post(server, "/v1/completions", {"prompt": "one more", "max_tokens": 2})
        assert busy.status_code == 429 and int(busy.headers["retry-after"]) >= 1
        assert busy.json()["error"]["type"] == "rate_limit_error"
        for response, _ in streams:
            response.close()  # disconnect: each request is aborted
    state = wait_until_idle(server)
    assert state["finished"].get("abort", 0) == aborted + SLOTS + WAITING
    assert _post(server, "/v1/completions", {"prompt": "and now?", "max_tokens": 2}).status_code == 200


def test_disconnect_mid_stream_aborts_and_frees_the_slot(server):
    aborted = health(server)["finished"].get("abort", 0)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        response, lines = _open_stream(http)
        got = [line for line, _ in zip(lines, range(8)) if line]
        assert len(got) >= 3, "the stream delivered tokens before the disconnect"
        response.close()
    state = wait_until_idle(server)
    assert state["finished"].get("abort", 0) == aborted + 1


def test_disconnect_before_a_non_streamed_answer_aborts(server):
    aborted = health(server)["finished"].get("abort", 0)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 900 tokens
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "tell me everything", "max_tokens": CONTEXT - 100,
                                                          "temperature": 0}, timeout=httpx.Timeout(60, read=0.5))
    state = wait_until_idle(server)
    assert state["finished"].get("abort", 0) == aborted + 1


def test_sigterm_finishes_the_running_stream_and_exits_0(server):
    """Last in the module: it stops the shared server."""
    with httpx.Client(base_url=server.url, timeout=120) as http:
        response, lines = _open_stream(http, max_tokens=32)
        server.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    finishing = [json.loads(line[6:]) for line in rest[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in finishing if c["choices"][0]["finish_reason"]] in (["length"], ["stop"])
    assert server.wait(timeout=120) == 0, server.stdout.read().decode()
