"""`bench serve --url`: the workload sent to any OpenAI-compatible server, streamed.

One asyncio task per request sleeps until its arrival time, then POSTs `/v1/completions`
with `stream: true` and `stream_options.include_usage`, and timestamps every server-sent
event that carries text. The token count is the final usage chunk's `completion_tokens` (a
chunk may carry several tokens); a server that sends no usage gets one token per text chunk.
Connections are not pooled down: at rate inf every request is in flight at once.
`async_client` and `stream_events` are the pieces `bench soak` drives its clients with too.

One Python process cannot parse every event of a fast server (measured on the H200 host: at 100
requests/s one client sat at 100% CPU and sent 221 ms late at p99), so `run_http` spreads the
requests over `procs` client processes (`client_procs`, one start instant for all): request i
goes to process i % procs. With procs = 1 the requests go out from this process, nothing
spawned.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator, Callable, Optional, Union

import httpx
import msgspec

from graphrelay.capture.serving.workloads import Request
from graphrelay.tools.bench.client_procs import run_shares
from graphrelay.tools.bench.options import UsageError
from graphrelay.tools.bench.serve_metrics import Timing

CONNECT_TIMEOUT_S = 10.0
_decode = msgspec.json.Decoder()


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
    async with async_client(url, timeout_s) as client:
        start = wait_start()
        cpu = time.process_time()
        timings = await asyncio.gather(*(_one(client, model, r, p, start) for r, p in jobs))
        return list(timings), time.process_time() - cpu, time.perf_counter() - start


def async_client(url: str, timeout_s: float) -> httpx.AsyncClient:
    """A client with no connection limit, so every request is in flight at once if asked."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S))


async def stream_events(client: httpx.AsyncClient, body: dict) -> AsyncIterator[dict[str, Any]]:
    """POST `body` to /v1/completions and yield each server-sent event's JSON payload as it
    arrives, up to `[DONE]`. Raises `StreamFailed` for an answer that is not a stream, an
    error event, or a stream that ends without `[DONE]`. Closing the generator early (use
    `contextlib.aclosing`) closes the connection: the server sees the client go away."""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise StreamFailed(f"HTTP {response.status_code}: {response.text[:200]}")
        done = False  # read on to the end of the body, so the connection can be reused
        async for line in response.aiter_lines():
            if line.startswith("data:") and line[5:].strip() == "[DONE]":
                done = True
            elif (event := _event(line)) is not None:
                yield event
    if not done:
        raise StreamFailed("the stream ended without data: [DONE]")


async def _one(client: httpx.AsyncClient, model: str, request: Request, prompt, start: float) -> Timing:
    await asyncio.sleep(max(0.0, request.arrival - (time.perf_counter() - start)))
    # ignore_eos: the in-process workload has no stop tokens, so each request makes its planned
    # length; without it a real model's early end of text would shorten the HTTP run's work.
    body = {"model": model, "prompt": prompt, "max_tokens": request.max_new_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter() - start
    times: list[float] = []
    usage_tokens: Optional[int] = None
    error = None
    try:
        async with contextlib.aclosing(stream_events(client, body)) as events:
            async for event in events:
                if any(choice.get("text") for choice in event.get("choices") or ()):
                    times.append(time.perf_counter() - start)
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
    except (httpx.HTTPError, StreamFailed) as exc:
        error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, StreamFailed) else str(exc)
    output_tokens = usage_tokens if usage_tokens is not None else len(times)
    return Timing(request.id, len(request.prompt), request.max_new_tokens, output_tokens, sent, times, error)


class StreamFailed(Exception):
    """The server answered, but not with a whole stream."""


def _event(line: str) -> Optional[dict[str, Any]]:
    """A server-sent event's JSON payload; None for blank lines and comments."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    try:
        event = _decode.decode(data)
    except msgspec.DecodeError:
        raise StreamFailed(f"a stream event is not JSON: {data[:200]!r}") from None
    if isinstance(event, dict) and "error" in event:
        raise StreamFailed(f"the server sent an error event: {str(event['error'])[:200]}")
    return event if isinstance(event, dict) else None
