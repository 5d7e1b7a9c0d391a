"""`bench serve --url`: the workload sent to any OpenAI-compatible server, streamed.

One asyncio task per request sleeps until its arrival time, then POSTs `/v1/completions`
with `stream: true` and `stream_options.include_usage`, and timestamps every server-sent
event that carries text. The token count is the final usage chunk's `completion_tokens` (a
chunk may carry several tokens); a server that sends no usage gets one token per text chunk.
Connections are not pooled down: at rate inf every request is in flight at once. The requests
go out through the load generator's own lean HTTP/1.1 client (`sse_client`), which costs a
fraction of httpx's CPU per event.

One Python process cannot parse every event of a fast server (measured on the H200 host with
httpx: at 100 requests/s one client sat at 100% CPU and sent 221 ms late at p99), so `run_http` spreads the
requests over `procs` client processes (`client_procs`, one start instant for all): request i
goes to process i % procs. With procs = 1 the requests go out from this process, nothing
spawned.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Callable, Optional, Union

import httpx
import msgspec

from graphrelay.capture.serving.workloads import Request
from graphrelay.tools.bench.client_procs import run_shares
from graphrelay.tools.bench.options import UsageError
from graphrelay.tools.bench.serve_metrics import Timing
from graphrelay.tools.bench.sse_client import SseClient, StreamFailed, parse_chunk

CONNECT_TIMEOUT_S = 10.0


def served_models(url: str) -> list[str]:
    """`GET {url}/v1/models`: the ids the server serves. Checked before any work, so a wrong
    URL is one clear error rather than a sweep of failed requests."""
    try:
        response = httpx.get(f"{url}/v1/models", timeout=CONNECT_TIMEOUT_S)
        response.raise_for_status()
        return [m["id"] for m in response.json()["data"]]
    except httpx.HTTPError as exc:
        raise UsageError(f"--url {url}: cannot list the served models at {url}/v1/models ({exc}); "
                         f"start the server or fix the URL") from None
    except (ValueError, KeyError, TypeError):
        raise UsageError(f"--url {url}: {url}/v1/models did not answer an OpenAI model list; "
                         f"is this an OpenAI-compatible server?") from None


def server_device(url: str) -> Optional[str]:
    """The device a graphrelay server names in `GET {url}/health`; None from a server that
    names none (another OpenAI-compatible server) or does not answer there. The report's own
    environment is the client's machine: this says which card answered."""
    try:
        device = httpx.get(f"{url}/health", timeout=CONNECT_TIMEOUT_S).json().get("device")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return device if isinstance(device, str) else None


def pick_model(url: str, asked: Optional[str]) -> str:
    """The model to request: `asked` (--served-model) if the server serves it, else the first
    it lists; a usage error otherwise."""
    models = served_models(url)
    if asked is not None and asked not in models:
        raise UsageError(f"--served-model {asked!r} is not served at {url} (it serves {models}); pick one of those")
    if not models:
        raise UsageError(f"{url}/v1/models lists no model; is the server still loading?")
    return asked or models[0]


class HttpRun(msgspec.Struct):
    timings: list[Timing]  # in the order of the requests, whichever process sent each
    duration_s: float  # the start to the last token
    # The busiest client process's CPU time meanwhile (the only one, with procs = 1): near
    # duration_s, that process was the bottleneck, whatever the others did.
    client_cpu_s: float


def run_http(url: str, model: str, requests: list[Request], prompts: list[Union[list[int], str]],
             timeout_s: float, procs: int = 1) -> HttpRun:
    """Send `requests` (their `prompts` as ids or text) on their arrival schedule, from `procs`
    client processes (request i from process i % procs)."""
    jobs = list(zip(requests, prompts))
    procs = max(1, min(procs, len(jobs)))
    if procs == 1:
        shares = [asyncio.run(_send_share(url, model, jobs, timeout_s, time.perf_counter))]
    else:
        last_arrival = max(r.arrival for r in requests)
        shares = run_shares(_send_share, (url, model), [jobs[k::procs] for k in range(procs)], timeout_s,
                            last_arrival)
    timings = [shares[i % procs][0][i // procs] for i in range(len(jobs))]  # back in request order
    ends = [t.token_times_s[-1] for t in timings if t.ok]
    duration = max(ends, default=max(end for _, _, end in shares))
    return HttpRun(timings, duration, max(cpu for _, cpu, _ in shares))


Share = tuple[list[Timing], float, float]  # one process's timings, CPU seconds, end (s from the start)


async def _send_share(url: str, model: str, jobs: list, timeout_s: float, wait_start: Callable[[], float]) -> Share:
    """Send `jobs` (request, prompt) on their schedule from `wait_start()`, the start instant on
    the perf_counter clock; it is called once the client is built and may block (nothing else
    runs on this loop yet)."""
    client = SseClient(url, CONNECT_TIMEOUT_S)
    try:
        start = wait_start()
        cpu = time.process_time()
        timings = await asyncio.gather(*(_one(client, model, r, p, start, timeout_s) for r, p in jobs))
        return list(timings), time.process_time() - cpu, time.perf_counter() - start
    finally:
        await client.close()


async def _one(client: SseClient, model: str, request: Request, prompt, start: float, timeout_s: float) -> Timing:
    await asyncio.sleep(max(0.0, request.arrival - (time.perf_counter() - start)))
    # ignore_eos: the in-process workload has no stop tokens, so each request makes its planned
    # length; without it a real model's early end of text would shorten the HTTP run's work.
    body = {"model": model, "prompt": prompt, "max_tokens": request.max_new_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter() - start
    times: list[float] = []
    usage_tokens: Optional[int] = None
    error = None

    async def stream() -> None:
        nonlocal usage_tokens
        async with contextlib.aclosing(client.events("/v1/completions", body)) as events:
            async for data in events:
                chunk = parse_chunk(data)
                if chunk.has_text:
                    times.append(time.perf_counter() - start)
                if chunk.usage is not None:
                    usage_tokens = chunk.usage.completion_tokens
    try:
        await asyncio.wait_for(stream(), timeout_s)
    except StreamFailed as exc:
        error = str(exc)
    except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    output_tokens = usage_tokens if usage_tokens is not None else len(times)
    return Timing(request.id, len(request.prompt), request.max_new_tokens, output_tokens, sent, times, error)
