"""`bench soak` at CI scale against a real `graphrelay serve --port` process (the tiny random
model with the real tokenizer, 4 slots, on the CPU): 16 streaming clients, a quarter leaving
mid-stream, 2 rounds; every completed stream equals its non-streamed reference, no slot or
request leaks, the server reports its resident memory, and SIGTERM still exits 0. Also: the
stream check itself flags what it is there to catch."""

from __future__ import annotations

import json
import signal

import pytest

from graphrelay.tools.bench import bench_main
from graphrelay.tools.bench.soak import SMOKE, leavers
from graphrelay.tools.bench.soak_round import Answer, problems
from http_cases import start_server, stop_server

START_TIMEOUT_S = 300  # tokenizer and model load on a busy CPU


@pytest.fixture
def server():
    process = start_server(["--model", "tiny", "--weights", "random", "--tokenizer", "--device", "cpu", "--max-reqs", "4",
                            "--max-batch", "4", "--max-seq-len", "1024"], START_TIMEOUT_S)
    yield process
    stop_server(process)


def test_smoke_soak_is_exact_and_leaks_nothing(server, tmp_path):
    # The timeouts only bound a hang: the run takes about ten seconds.
    args = ["--smoke", "--url", server.url, "--out", str(tmp_path), "--timeout-s", "120", "--idle-timeout-s", "60"]
    assert bench_main(["soak", *args]) == 0
    report = json.loads((tmp_path / "soak_bench.json").read_text())
    assert report["correct"] and report["reference"]["errors"] == 0
    rounds = report["rounds"]
    assert len(rounds) == SMOKE["rounds"] == 2
    planned = round(SMOKE["clients"] * SMOKE["disconnect"])
    for r in rounds:
        assert r["mismatches"] == 0 and r["errors"] == 0, r
        assert r["slots_leaked"] == 0 and r["requests_leaked"] == 0 and r["idle"], r["health"]
        assert r["engine_finished"] == SMOKE["clients"]  # disconnected requests were finished (aborted) too
        # A client leaves only while its stream is still going; one that ended first completed.
        assert r["planned_disconnects"] == planned and 1 <= r["disconnected"] <= planned
        assert r["completed"] + r["disconnected"] == SMOKE["clients"]
        assert r["rss_mib"] > 0
    assert report["memory_verdict"] in ("flat", "GROWING") and report["rss_growth_mib"] is not None
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=120) == 0


def test_each_round_disconnects_other_clients():
    plan = {"seed": 0, "clients": 512, "disconnect": 0.1}
    first, second = leavers(plan, 1), leavers(plan, 2)
    assert len(first) == len(second) == 51 and set(first) != set(second)
    assert leavers(plan, 1) == first and set(first.values()) <= {1, 2, 3}


def test_the_stream_check_flags_each_kind_of_difference():
    usage = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    reference = Answer("abcd", "length", usage)
    assert problems(Answer("abcd", "length", usage, finish_chunks=1), reference, max_tokens=4) == []
    assert "text differs from char 2" in problems(Answer("abXd", "length", usage, finish_chunks=1), reference, 4)[0]
    assert "2 chunks carried a finish reason" in problems(Answer("abcd", "length", usage, finish_chunks=2), reference, 4)[0]
    short = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    found = problems(Answer("abcd", "length", short, finish_chunks=1), reference, 4)
    assert any("usage" in p for p in found) and any("after 3 of 4 tokens" in p for p in found)
    assert any("finish_reason 'stop'" in p for p in problems(Answer("abcd", "stop", usage, finish_chunks=1), reference, 4))
