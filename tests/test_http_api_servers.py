"""`graphrelay serve --port P --api-servers 2`: two API server processes on one port over one
engine process. Connections reach both; every answer is the same as one server's (greedy text
and exact usage, streamed or not); SIGTERM to the first process stops both with exit status
0; a second server that dies stops the first with status 1; and the flag refuses what it
cannot do before any model loads."""

from __future__ import annotations

import os
import signal

import httpx
import openai
import pytest

from graphrelay.capture.serving.cli import serve_main
from graphrelay.capture.serving.engine_handle import resident_bytes
from http_cases import health, start_server, stop_server, wait_until_idle
from test_engine_process import _children
from test_http_server import _open_stream

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the server's processes from /proc (Linux)")

MODEL = "tiny"
START_TIMEOUT_S = 300
FRESH_CONNECTIONS = 24  # each one new: both servers answer some unless the port's spread is broken (2^-23)
ARGS = ["--api-servers", "2", "--model", MODEL, "--weights", "random", "--tokenizer", "--device", "cpu",
        "--max-reqs", "4", "--max-batch", "4", "--max-waiting", "4", "--max-seq-len", "1024", "--no-controls"]
HELD = 4 + 4  # slots + waiting: what the whole server holds


def _pids(server) -> dict[int, int]:
    """API server index -> its process id, as /health tells over fresh connections."""
    found = {}
    for _ in range(FRESH_CONNECTIONS):
        state = httpx.get(f"{server.url}/health", timeout=30).json()
        found[state["api_server"]] = state["pid"]
    return found


@pytest.fixture(scope="module")
def server():
    process = start_server(ARGS, START_TIMEOUT_S)
    yield process
    stop_server(process)


def test_fresh_connections_reach_both_servers(server):
    pids = _pids(server)
    assert sorted(pids) == [0, 1] and pids[0] == server.pid and pids[1] != server.pid
    state = health(server)
    assert state["api_servers"] == 2 and state["capacity"] == HELD  # the whole server's, not a share
    engine = [pid for pid in _children(server.pid) if pid != pids[1] and _is_spawned(pid)]
    assert len(engine) == 1, f"one engine process beside the second server, found {engine}"
    every = sum(resident_bytes(str(pid)) for pid in (server.pid, pids[1], engine[0]))
    assert health(server)["rss_bytes"] >= 0.9 * every  # the whole server's, not one process's


def _is_spawned(pid: int) -> bool:
    with open(f"/proc/{pid}/cmdline") as cmdline:
        return "spawn_main" in cmdline.read().replace("\0", " ")


def test_every_server_gives_the_same_greedy_answer_streamed_or_not(server):
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
    answers = []
    for _ in range(8):  # a fresh connection each: both servers answer some
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
        answers.append((answer["choices"][0]["text"], answer["usage"]["completion_tokens"]))
    assert len(set(answers)) == 1 and answers[0][1] == 12
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **body) if c.choices)
    assert streamed == answers[0][0]


def _connection_to(server, index: int) -> httpx.Client:
    """A client whose kept-alive connection the port gave to API server `index`."""
    for _ in range(64):
        http = httpx.Client(base_url=server.url, timeout=60)
        if http.get("/health").json()["api_server"] == index:
            return http
        http.close()
    pytest.fail(f"64 fresh connections and none reached API server {index}")


def test_the_bound_is_the_whole_servers_wherever_connections_land(server):
    """Slots + waiting requests, all on connections the port gave to one API server, are held
    (the port may send a burst's connections anywhere: a bound split per server refused the
    fifth here), one more on the other server is refused with 429 (the count is shared), and
    once the clients go, both servers count nothing outstanding."""
    clients = [_connection_to(server, 1) for _ in range(HELD)]
    try:
        streams = [_open_stream(http) for http in clients]
        other = _connection_to(server, 0)
        busy = other.post("/v1/completions", json={"model": MODEL, "prompt": "one more", "max_tokens": 2})
        assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_error"
        other.close()
        for response, _ in streams:
            response.close()
    finally:
        for http in clients:
            http.close()
    wait_until_idle(server)
    for index in (0, 1):
        http = _connection_to(server, index)
        assert http.get("/health").json()["outstanding"] == 0
        http.close()


def test_sigterm_to_the_first_stops_every_server_with_status_0():
    server = start_server(ARGS, START_TIMEOUT_S)
    try:
        other = _pids(server)[1]
        assert httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3},
                          timeout=120).status_code == 200
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 0, server.stdout.read().decode()
        assert not os.path.exists(f"/proc/{other}"), "the second API server outlived the first"
    finally:
        stop_server(server)


def test_a_second_server_that_dies_stops_the_first_with_status_1():
    server = start_server(ARGS, START_TIMEOUT_S)
    try:
        os.kill(_pids(server)[1], signal.SIGKILL)
        assert server.wait(timeout=120) == 1, server.stdout.read().decode()
    finally:
        stop_server(server)


def test_api_servers_refuse_what_they_cannot_do(capsys):
    tiny = ["--model", "tiny", "--weights", "random", "--tokenizer", "--device", "cpu", "--quiet", "--port", "0"]
    assert serve_main([*tiny, "--api-servers", "0"]) == 2
    assert "--api-servers must be at least 1" in capsys.readouterr().err
    assert serve_main([*tiny, "--api-servers", "2", "--engine-placement", "thread"]) == 2
    assert "drop --engine-placement thread" in capsys.readouterr().err


@pytest.mark.parametrize("cores, servers", [(1, 1), (2, 1), (7, 1), (8, 2), (12, 3), (16, 4), (128, 4)])
def test_the_default_is_one_api_server_per_four_cores_up_to_four(monkeypatch, cores, servers):
    from graphrelay.capture.serving import api_servers

    monkeypatch.setattr(api_servers.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert api_servers.default_count() == servers


def test_the_thread_placement_defaults_to_one_api_server(monkeypatch):
    """The engine as a thread of the one HTTP process: the default cannot be several servers
    there, whatever the machine (a busy 16-core one would otherwise refuse its own default)."""
    from graphrelay.capture.serving import api_servers, cli

    monkeypatch.setattr(api_servers, "default_count", lambda: 4)
    args = cli.build_parser().parse_args(["--port", "0", "--engine-placement", "thread"])
    cli._check_http_args(args)
    assert args.api_servers == 1
    args = cli.build_parser().parse_args(["--port", "0"])
    cli._check_http_args(args)
    assert args.api_servers == 4
