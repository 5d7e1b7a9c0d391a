"""The engine in its own process (`serve --port`, the default placement): its pipe messages carry
results intact, and an engine process that dies stops the server (exit status 1) instead of
leaving it listening. The HTTP behaviour itself runs in both placements in test_http_server
and test_http_controls."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from graphrelay.capture.iteration.controls.logprobs import TokenLogprobs
from graphrelay.capture.serving import engine_messages as em
from graphrelay.capture.iteration.controls.params import ControlParams
from graphrelay.capture.serving.loop import RequestOutput
from graphrelay.capture.serving.workloads import Request
from http_cases import start_server, stop_server

START_TIMEOUT_S = 300


def test_results_cross_the_pipe_intact():
    logprobs = [TokenLogprobs(-0.5, [(3, -0.5), (9, -1.25)]), TokenLogprobs(-2.0, [(4, -2.0)])]
    output = RequestOutput("r1", [3, 4], "stop", ttft_ms=1.5, text="ab", logprobs=logprobs)
    message = em.Results([em.Tokens("r1", [3, 4], logprobs), em.Tokens("r2", [7], None), em.Finish(output)],
                         ["r3"], [em.Rejection("r4", "logit_bias: too many")],
                         {"slots": 2, "free_slots": 1, "running": 1, "retiring": 0, "waiting": 0}, 1 << 20)
    assert em.decode_to_server(em.encode(message)) == message
    request = Request(id="r9", prompt=[1, 2], max_new_tokens=4, stop=("x",),
                      controls=ControlParams(logit_bias={5: 1.5}, logprobs=2))
    for sent in (em.Hello(4242), em.Submit(request), em.Abort("r9"), em.Close()):
        assert em.decode_to_engine(em.encode(sent)) == sent


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc (Linux)")
def test_a_dead_engine_process_stops_the_server_with_status_1():
    server = start_server(["--model", "tiny", "--weights", "random", "--tokenizer", "--device",
                           "cpu", "--max-reqs", "2", "--max-batch", "2", "--max-seq-len", "256"], START_TIMEOUT_S)
    try:
        answer = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                            timeout=120)
        assert answer.status_code == 200
        engines = [pid for pid in _children(server.pid)
                   if "spawn_main" in open(f"/proc/{pid}/cmdline").read().replace("\0", " ")]
        assert len(engines) == 1, f"one engine process under the server, found {engines}"
        os.kill(engines[0], signal.SIGKILL)
        assert server.wait(timeout=120) == 1, server.stdout.read().decode()
    finally:
        stop_server(server)


def test_the_server_process_reads_the_tokenizer_and_no_weights(monkeypatch):
    from graphrelay.capture.model import model_source

    monkeypatch.setattr(model_source, "read_gguf", lambda *a, **k: pytest.fail("weights were read"))
    codec = model_source.load_codec("smollm2-135m")
    assert codec is not None and codec.decode(codec.encode("Hello there")) == "Hello there"
    assert model_source.load_codec("tiny", weights="random") is None
    with pytest.raises(ValueError, match="goes with random weights only"):
        model_source.load_codec("smollm2-135m", tokenizer="")
