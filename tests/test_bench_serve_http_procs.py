"""`bench serve --url` from several client processes: every request sent once, timings back in
request order, one arrival schedule across the processes, and a crashed client process as an
error rather than a hang. Against the stub server of test_bench_serve, here in this process, so
its clock (perf_counter: CLOCK_MONOTONIC, system-wide) is the clients' clock too."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from bench_cases import assert_usage_error
from graphrelay.capture.serving.workloads import Request
from graphrelay.tools.bench import bench_main
from test_bench_serve import FIRST_TOKEN_S, serving, smoke_requests, stub_app, stub_token_count

GAP_S = 1.2  # between arrivals: wider than the tolerance, so a kept schedule is also an order
# A request reaches a localhost stub within ms; this is loose enough for a busy 2-core machine
# (it bounds a stall, it expects no speed) and still well under the offset a late start makes.
TOLERANCE_S = 1.0
LATE_READY_S = 2.5  # one client process gets ready this much later than the other


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


class Stamped(list):
    """The stub's record of request bodies, each with the instant it came in."""

    def append(self, body: dict) -> None:
        super().append((time.perf_counter(), body))


@pytest.fixture(scope="module")
def stamped_server():
    seen = Stamped()
    with serving(stub_app(seen)) as url:
        yield url, seen


def spaced(requests: list[Request]) -> list[Request]:
    """`requests` arriving GAP_S apart, the first at 0."""
    return [Request(r.id, r.prompt, r.max_new_tokens, arrival=i * GAP_S) for i, r in enumerate(requests)]


def after_a_pause(prompt: list[int]) -> list[int]:
    time.sleep(LATE_READY_S)
    return prompt


class LateToUnpickle:
    """A prompt that the client process receiving it unpickles LATE_READY_S late: that process is
    ready so much after the other, and only a shared start keeps the two on one schedule."""

    def __init__(self, prompt: list[int]):
        self.prompt = prompt

    def __reduce__(self):
        return after_a_pause, (self.prompt,)


def test_two_client_processes_send_each_request_once_on_one_schedule(stamped_server):
    from graphrelay.tools.bench.serve_http import run_http

    url, seen = stamped_server
    requests = spaced(smoke_requests()[:6])  # three each, interleaved: 0, 2, 4 and 1, 3, 5
    prompts = [LateToUnpickle(r.prompt) if i == 1 else r.prompt for i, r in enumerate(requests)]
    seen.clear()
    run = run_http(url, "stub-model", requests, prompts, timeout_s=30, procs=2)
    received = {tuple(body["prompt"]): (at, body) for at, body in seen}
    assert len(seen) == len(received) == len(requests)  # each prompt once, none twice
    assert set(received) == {tuple(r.prompt) for r in requests}
    assert [t.id for t in run.timings] == [r.id for r in requests]
    for request, timing in zip(requests, run.timings):
        _, body = received[tuple(request.prompt)]
        assert timing.ok and body["max_tokens"] == request.max_new_tokens
        assert timing.output_tokens == stub_token_count(body)  # this request's own stream
        assert timing.token_times_s[0] - timing.due_s >= FIRST_TOKEN_S
        assert request.arrival <= timing.due_s < request.arrival + TOLERANCE_S  # slept until due, from the start
        assert timing.token_times_s[-1] <= run.duration_s
    # On the server's clock too, across both processes: received in arrival order, each as long
    # after the first as the schedule says (a process with its own start would be offset).
    at = [received[tuple(r.prompt)][0] for r in requests]
    assert at == sorted(at)
    for request, instant in zip(requests, at):
        assert abs((instant - at[0]) - request.arrival) < TOLERANCE_S
    assert run.client_cpu_s > 0  # the busiest process's, measured in the process


def test_the_option_reaches_the_sweep(stamped_server, tmp_path, capsys):
    url, _ = stamped_server
    argv = ["serve", "--smoke", "--url", url, "--client-procs", "2", "--rates", "inf", "--out", str(tmp_path)]
    assert bench_main(argv) == 0
    report = json.loads((tmp_path / "serve_http_bench.json").read_text())
    (point,) = report["points"]
    requests = smoke_requests()
    assert report["plan"]["client_procs"] == 2
    assert point["completed"] == len(requests) and point["failed"] == 0
    assert point["output_tokens"] == sum(stub_token_count({"max_tokens": r.max_new_tokens, "prompt": r.prompt})
                                         for r in requests)
    assert "from 2 client processes" in capsys.readouterr().err


class ExitsWhenUnpickled:
    """A prompt whose unpickling in the client process ends that process at once (status 3)."""

    def __reduce__(self):
        return os._exit, (3,)


def test_a_client_process_that_dies_is_an_error_not_a_hang(stamped_server):
    from graphrelay.tools.bench.client_procs import READY_TIMEOUT_S, ClientFailed
    from graphrelay.tools.bench.serve_http import run_http

    url, _ = stamped_server
    requests = smoke_requests()[:2]
    began = time.monotonic()
    with pytest.raises(ClientFailed, match=r"client process 0 exited \(status 3\) before it reported ready"):
        run_http(url, "stub-model", requests, [ExitsWhenUnpickled(), requests[1].prompt], timeout_s=30, procs=2)
    assert time.monotonic() - began < READY_TIMEOUT_S  # seen exiting, not waited out


def test_a_client_process_that_raises_reports_its_traceback(stamped_server):
    from graphrelay.tools.bench.client_procs import ClientFailed
    from graphrelay.tools.bench.serve_http import run_http

    url, _ = stamped_server
    requests = smoke_requests()[:2]
    # A plain object is no JSON: encoding the request body raises TypeError inside the client process.
    with pytest.raises(ClientFailed, match=r"(?s)client process \d failed:.*TypeError"):
        run_http(url, object(), requests, [r.prompt for r in requests], timeout_s=30, procs=2)


@pytest.mark.parametrize("argv, message", [
    (["--client-procs", "2"], "--client-procs applies to --url only"),
    (["--url", "http://127.0.0.1:9", "--client-procs", "0"], "0 must be >= 1"),
    (["--url", "http://127.0.0.1:9", "--client-procs", "two"], "'two' is not an integer"),
    (["--url", "http://127.0.0.1:9", "--client-procs", "1000"], "--client-procs value 1000 is out of range 1..128"),
])
def test_bad_client_procs_exit_2_before_any_request(argv, message, tmp_path, capsys):
    # http://127.0.0.1:9 serves nothing: an option checked after the server would say so instead.
    assert_usage_error("serve", argv, message, capsys, tmp_path)
