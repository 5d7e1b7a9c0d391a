"""`graphrelay bench serve`: the in-process smoke sweep, the `--url` mode against a stub
OpenAI-compatible streaming server on 127.0.0.1, the metrics arithmetic, the arrival schedule,
and bad options.

httpx, starlette and uvicorn (the `test` extra) are imported where used, so collecting this file
(`pytest -m gpu` on a GPU machine collects every file) needs none of them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import threading
import time

import pytest
import torch

from bench_cases import assert_needs_gpu, assert_usage_error
from graphrelay.capture.iteration.engine import DEFAULT_MAX_TOKENS
from graphrelay.tools.bench import bench_main
from graphrelay.tools.bench.serve import SMOKE, rate_list
from graphrelay.tools.bench.serve_metrics import Timing, highest_rate_within, summarize
from graphrelay.tools.bench.serve_report import plot_panels
from graphrelay.tools.bench.serve_workload import Lengths, at_rate, make_requests, unit_arrivals

QUANTILES = ("p50", "p90", "p99")


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path, even on a GPU host


def smoke_requests():
    """The smoke run's workload, as `bench serve --smoke` draws it (seed 0)."""
    return make_requests(SMOKE["requests"], Lengths(SMOKE["prompt_len"], SMOKE["output_len"]), 0, vocab_size=512)


def assert_ordered(dist: dict) -> None:
    values = [dist[q] for q in QUANTILES]
    assert all(v is not None and v >= 0 for v in values)
    assert values == sorted(values)


# ---- in process ---------------------------------------------------------------------------


def test_smoke_sweep_in_process_serves_every_request_exactly(tmp_path, capsys):
    assert bench_main(["serve", "--smoke", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "serve_bench.json").read_text())
    assert report["benchmark"] == "serve" and report["served"]["mode"] == "in-process"
    assert report["environment"]["command"] == f"graphrelay bench serve --smoke --out {tmp_path}"
    requests = smoke_requests()
    points = report["points"]
    assert [p["rate"] for p in points] == ["50", "inf"]
    for p in points:
        # Every request completed with exactly its max_tokens: no stop tokens in the workload.
        assert p["requests"] == p["completed"] == len(requests) and p["failed"] == 0 and p["ended_early"] == 0
        assert p["output_tokens"] == sum(r.max_new_tokens for r in requests)
        assert p["prompt_tokens"] == sum(len(r.prompt) for r in requests)
        assert p["duration_s"] > 0
        assert p["output_tokens_per_s"] == pytest.approx(p["output_tokens"] / p["duration_s"])
        assert p["requests_per_s"] == pytest.approx(len(requests) / p["duration_s"])
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "latency_ms"):
            assert_ordered(p[metric])
        # A request's last token comes no earlier than its first, and the run outlasts both.
        assert p["latency_ms"]["p99"] >= p["ttft_ms"]["p50"] > 0
        assert p["latency_ms"]["p99"] <= p["duration_s"] * 1e3
        assert p["loop"]["requests"] == len(requests) and p["loop"]["tokens"] == p["output_tokens"]
        assert p["loop"]["iterations"] > 0 and p["loop"]["gpu_step_us_median"] is None  # CPU: no GPU timing
    assert report["highest_rate_within_slo"] in (50.0, None)
    assert [t["name"] for t in report["targets"]][-1] == "highest rate with TTFT p99 <= 1000 ms"
    assert (tmp_path / report["plot"]).read_bytes().startswith(b"\x89PNG")
    assert "TTFT p50" in printed and "highest rate with TTFT p99" in printed
    assert report["plan"]["max_tokens"] == DEFAULT_MAX_TOKENS  # the engine's default budget


def test_a_tuned_token_budget_is_the_engines_and_is_recorded(tmp_path):
    # 6 tokens an iteration against prompts of up to 16: every long prompt is chunked.
    assert bench_main(["serve", "--smoke", "--rates", "inf", "--max-tokens", "6", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "serve_bench.json").read_text())
    assert report["plan"]["max_tokens"] == 6
    (point,) = report["points"]
    requests = smoke_requests()
    assert point["completed"] == len(requests) and point["output_tokens"] == sum(r.max_new_tokens for r in requests)
    # Every prompt token passed through iterations of at most 6 tokens: more of them than prompts.
    assert point["loop"]["iterations"] > sum(len(r.prompt) for r in requests) // 6


def test_smoke_sweep_at_tp_1_and_2_serves_the_same_workload_on_gloo_ranks(tmp_path, capsys):
    """`--tp 1,2`: size 1 in process, size 2 on two spawned gloo ranks; each size writes a plain
    run's report, and the summary sets their highest rates within the SLO side by side."""
    assert bench_main(["serve", "--smoke", "--tp", "1,2", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    requests = smoke_requests()
    summary = json.loads((tmp_path / "serve_tp_bench.json").read_text())
    assert [r["tp"] for r in summary["sizes"]] == [1, 2] and not (tmp_path / "serve_bench.json").exists()
    for row in summary["sizes"]:
        report = json.loads((tmp_path / row["report"]).read_text())
        assert report["served"]["tp"] == row["tp"] and report["plan"]["tp"] == [1, 2]
        assert report["highest_rate_within_slo"] == row["highest_rate_within_slo"]
        assert row["host_syncs_per_rank"] == [0] * row["tp"] and row["relays_identical"] is True
        for p in report["points"]:
            assert p["completed"] == len(requests) and p["failed"] == 0
            assert p["output_tokens"] == sum(r.max_new_tokens for r in requests)
        assert (tmp_path / report["plot"]).read_bytes().startswith(b"\x89PNG")
    target = summary["targets"][0]
    assert target["name"] == "TP=2's highest rate with TTFT p99 <= 1000 ms over TP=1's" and target["limit"] == 1.5
    assert "online load by tensor-parallel size" in printed and "over TP=1's >= 1.5 x" in printed


def test_needs_a_gpu_without_smoke(tmp_path, capsys):
    assert_needs_gpu("serve", capsys, tmp_path)


# ---- over HTTP, against a stub server -------------------------------------------------------

FIRST_TOKEN_S = 0.03  # the stub's "prefill": every TTFT it serves is at least this


def stub_token_count(body: dict) -> int:
    """Tokens the stub streams: max_tokens, or half of it for prompts of a length divisible by
    3 (an end of turn before max_tokens)."""
    n = body["max_tokens"]
    return -(-n // 2) if len(body["prompt"]) % 3 == 0 else n


def stub_app(seen: list[dict]):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    async def health(request):  # as graphrelay's server names its engine's device
        return JSONResponse({"engine": "running", "device": "Stub GPU"})

    async def completions(request):
        body = await request.json()
        seen.append(body)
        n = stub_token_count(body)

        async def events():
            await asyncio.sleep(FIRST_TOKEN_S)
            sent = 0
            while sent < n:
                k = min(n - sent, 2 if sent % 3 == 0 else 1)  # some chunks carry two tokens
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'ab' * k, 'finish_reason': None}]})}\n\n"
                sent += k
                await asyncio.sleep(0.002)
            reason = "length" if n == body["max_tokens"] else "stop"
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': '', 'finish_reason': reason}]})}\n\n"
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": len(body["prompt"]) + n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/health", health),
                             Route("/v1/completions", completions, methods=["POST"])])


@contextlib.contextmanager
def serving(app):
    """`app` under uvicorn on a free port of 127.0.0.1, in a thread; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the stub server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(scope="module")
def stub_server():
    """(base URL, request bodies received) of the stub OpenAI-compatible server."""
    seen: list[dict] = []
    with serving(stub_app(seen)) as url:
        yield url, seen


def test_http_counts_tokens_from_usage_and_times_from_the_stream(stub_server):
    from graphrelay.tools.bench.serve_http import run_http

    url, seen = stub_server
    requests = at_rate(smoke_requests(), unit_arrivals(SMOKE["requests"], 0), 200.0)
    seen.clear()
    run = run_http(url, "stub-model", requests, [r.prompt for r in requests], timeout_s=30)
    timings, duration = run.timings, run.duration_s
    assert 0 < run.client_cpu_s
    bodies = {tuple(b["prompt"]): b for b in seen}
    assert len(bodies) == len(requests)
    for request, timing in zip(requests, timings):
        body = bodies[tuple(request.prompt)]
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["model"] == "stub-model" and body["max_tokens"] == request.max_new_tokens
        assert body["ignore_eos"] is True  # the in-process workload's lengths, not the model's end of text
        assert timing.ok and timing.id == request.id
        assert timing.output_tokens == stub_token_count(body)  # from usage, not from the chunk count
        # Sent no earlier than due; the first token a stub "prefill" later; chunks in order.
        assert timing.due_s >= request.arrival
        assert timing.token_times_s[0] - timing.due_s >= FIRST_TOKEN_S
        assert timing.token_times_s == sorted(timing.token_times_s) and timing.token_times_s[-1] <= duration


def test_smoke_sweep_over_http_writes_its_own_report(stub_server, tmp_path, capsys):
    url, _ = stub_server
    assert bench_main(["serve", "--smoke", "--url", url, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "serve_http_bench.json").read_text())
    assert not (tmp_path / "serve_bench.json").exists()  # the in-process results stay apart
    assert report["served"] == {"mode": "http", "url": url, "served_model": "stub-model", "server_device": "Stub GPU"}
    requests = smoke_requests()
    want = [stub_token_count({"max_tokens": r.max_new_tokens, "prompt": r.prompt}) for r in requests]
    for p in report["points"]:
        assert p["completed"] == len(requests) and p["failed"] == 0
        assert p["output_tokens"] == sum(want)
        assert p["ended_early"] == sum(w < r.max_new_tokens for w, r in zip(want, requests)) > 0
        assert_ordered(p["ttft_ms"])
        assert p["ttft_ms"]["p50"] >= FIRST_TOKEN_S * 1e3
        assert p["latency_ms"]["p99"] >= p["ttft_ms"]["p99"]
        assert "loop" not in p  # no iteration figures from outside the server
        lag = p["client_send_lag_ms"]  # each request waits for its arrival time (to the event loop's clock)
        assert -1 < lag["p50"] <= lag["p90"] <= lag["p99"]
        assert p["client_cpu_fraction"] > 0
    # No in-process results in --out to compare with: the HTTP targets are not measured.
    assert [t["measured"] for t in report["targets"]] == [None, None]
    assert "no in-process results for this workload" in capsys.readouterr().err
    assert (tmp_path / report["plot"]).read_bytes().startswith(b"\x89PNG")


def test_http_targets_compare_with_the_in_process_run_of_the_same_workload(stub_server, tmp_path):
    url, _ = stub_server
    sweep = ["--smoke", "--rates", "100,inf", "--out", str(tmp_path)]
    assert bench_main(["serve", *sweep]) == 0
    assert bench_main(["serve", *sweep, "--url", url]) == 0
    local, http = (json.loads((tmp_path / name).read_text()) for name in ("serve_bench.json", "serve_http_bench.json"))
    added, ratio = (t["measured"] for t in http["targets"])
    assert added == pytest.approx(http["points"][0]["ttft_ms"]["p50"] - local["points"][0]["ttft_ms"]["p50"])
    assert ratio == pytest.approx(http["points"][1]["output_tokens_per_s"] / local["points"][1]["output_tokens_per_s"])
    # Another workload (seed) does not compare with those in-process figures.
    assert bench_main(["serve", *sweep, "--url", url, "--seed", "1"]) == 0
    other = json.loads((tmp_path / "serve_http_bench.json").read_text())
    assert [t["measured"] for t in other["targets"]] == [None, None]


def test_a_failing_server_is_reported_not_raised(tmp_path, capsys):
    """A server that lists models but answers completions with 500: every request fails, the
    report says why, and the exit status is 1."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def models(request):
        return JSONResponse({"data": [{"id": "m"}]})

    async def broken(request):
        return JSONResponse({"error": {"message": "boom"}}, status_code=500)

    app = Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", broken, methods=["POST"])])
    with serving(app) as url:
        assert bench_main(["serve", "--smoke", "--url", url, "--rates", "inf", "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "serve_http_bench.json").read_text())
    assert report["served"]["server_device"] is None  # no /health naming one: another OpenAI-compatible server
    (point,) = report["points"]
    assert point["failed"] == point["requests"] and point["completed"] == 0
    assert point["first_error"].startswith("HTTP 500") and "boom" in point["first_error"]
    assert point["ttft_ms"]["p50"] is None


# ---- metrics and workload -------------------------------------------------------------------


def test_summary_of_hand_made_timings():
    timings = [
        Timing("a", 10, 3, 3, due_s=1.0, token_times_s=[1.1, 1.3, 1.7]),  # TTFT 100, TPOT 300, ITL 200, 400
        Timing("b", 20, 4, 2, due_s=2.0, token_times_s=[2.5, 2.6]),  # TTFT 500, TPOT 100, ITL 100; ended early
        Timing("c", 5, 4, 0, due_s=0.0, token_times_s=[], error="HTTP 503"),
    ]
    s = summarize(timings, duration_s=4.0)
    assert (s["requests"], s["completed"], s["failed"], s["ended_early"]) == (3, 2, 1, 1)
    assert s["first_error"] == "HTTP 503"
    assert (s["prompt_tokens"], s["output_tokens"]) == (30, 5)
    assert s["output_tokens_per_s"] == pytest.approx(5 / 4) and s["requests_per_s"] == pytest.approx(2 / 4)
    assert s["ttft_ms"]["mean"] == pytest.approx(300) and s["ttft_ms"]["p50"] == pytest.approx(300)
    assert s["tpot_ms"]["mean"] == pytest.approx(200)
    assert s["itl_ms"]["p50"] == pytest.approx(200) and s["itl_ms"]["mean"] == pytest.approx(700 / 3)
    assert s["latency_ms"]["p99"] == pytest.approx(700, rel=0.01)


def test_highest_rate_within_the_slo_skips_failures_and_all_at_once():
    def point(rate, p99, failed=0):
        return {"rate": rate, "failed": failed, "ttft_ms": {"p99": p99}}

    points = [point(25, 50), point(50, 900), point(100, 1200), point(200, 500, failed=1), point(math.inf, 10)]
    assert highest_rate_within(points, 1000) == 50
    assert highest_rate_within(points, 40) is None


def test_arrivals_scale_with_the_rate_and_requests_stay_the_same():
    requests = smoke_requests()
    unit = unit_arrivals(len(requests), seed=0)
    slow, fast, burst = (at_rate(requests, unit, r) for r in (10.0, 40.0, math.inf))
    assert all(b > a > 0 for a, b in zip(unit, unit[1:]))
    assert [r.arrival for r in fast] == pytest.approx([r.arrival / 4 for r in slow])
    assert {r.arrival for r in burst} == {0.0}
    assert [(r.prompt, r.max_new_tokens) for r in slow] == [(r.prompt, r.max_new_tokens) for r in requests]
    low, high = SMOKE["prompt_len"]
    assert all(low <= len(r.prompt) <= high for r in requests) and len({len(r.prompt) for r in requests}) > 1
    # The mean gap of a Poisson process at 1 request/s is 1 s (loosely: 12 draws).
    assert 0.3 < unit[-1] / len(unit) < 3


def test_rates_parse_sorted_with_inf_last():
    assert rate_list("inf,100,25,100") == [25.0, 100.0, math.inf]


def test_plot_has_one_point_per_rate(tmp_path):
    point = summarize([Timing("a", 4, 2, 2, 0.0, [0.1, 0.2])], 1.0)
    panels = plot_panels([{"rate": 10.0, **point}, {"rate": math.inf, **point}], 1000)
    assert [p.title for p in panels] == ["time to first token", "decode pace", "throughput"]
    assert all(list(p.xticklabels) == ["10", "inf"] for p in panels)
    assert [line.label for line in panels[0].lines] == ["TTFT p50", "TTFT p99", "SLO 1000 ms"]


# ---- bad options ----------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--rates", "0,10"], "must be > 0 requests/s"),
    (["--rates", "fast"], "'fast' in 'fast' is not a rate"),
    (["--prompt-len", "64,8"], "LOW must be <= HIGH"),
    (["--output-len", "8"], "must be LOW,HIGH"),
    (["--num-requests", "0"], "must be >= 1"),
    (["--served-model", "m"], "--served-model applies to --url only"),
    (["--prompt-format", "text"], "--prompt-format applies to --url only"),
    (["--url", "127.0.0.1:8000"], "must start with http:// or https://"),
    (["--url", "http://127.0.0.1:9", "--max-reqs", "8"], "--max-reqs sizes the in-process engine"),
    (["--url", "http://127.0.0.1:9", "--max-tokens", "8192"], "--max-tokens sizes the in-process engine"),
    (["--max-reqs", "8", "--max-tokens", "4"], "--max-tokens 4 with --max-reqs 8: EngineConfig.max_tokens (4) must hold"),
    (["--max-tokens", "0"], "must be >= 1"),
    (["--url", "http://127.0.0.1:9"], "cannot list the served models"),
    (["--slo-ttft-ms", "-5"], "must be a finite number > 0"),
    (["--tp", "2", "--url", "http://127.0.0.1:9"], "--tp sizes the in-process engine"),
    (["--kv-cache-dtype", "fp8", "--url", "http://127.0.0.1:9"], "--kv-cache-dtype sizes the in-process engine"),
    (["--kv-cache-dtype", "int4"], "invalid choice: 'int4'"),
    (["--tp", "1,2", "--model", "smollm2-135m", "--weights", "random"], "--tp 2: tensor parallelism over 2 ranks needs num_heads (9)"),
])
def test_bad_options_exit_2_with_one_line(argv, message, tmp_path, capsys):
    assert_usage_error("serve", argv, message, capsys, tmp_path)


def test_bad_options_against_a_live_server(stub_server, tmp_path, capsys):
    url, seen = stub_server
    seen.clear()
    assert_usage_error("serve", ["--url", url, "--served-model", "other"], "'other' is not served", capsys, tmp_path)
    assert_usage_error("serve", ["--url", url, "--prompt-format", "text"], "needs a tokenizer", capsys, tmp_path)
    assert seen == []  # refused before any request was sent
