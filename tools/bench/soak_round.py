"""One pass of `bench soak`'s clients against the server, and the check of each stream.

Every client of a pass is in flight at once (`async_client`, no connection limit;
the server queues what its slots cannot hold). The reference pass asks each request once
without streaming; a streaming round sends the same requests with `stream: true`, and the
clients picked to disconnect close their connection after a few text chunks. A stream that
completes must match its reference exactly: the joined text, the finish reason, the usage;
and carry exactly one chunk with the finish reason, the usage chunk, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Optional

import httpx
import msgspec

from graphrelay.tools.bench.serve_http import CONNECT_TIMEOUT_S
from graphrelay.tools.bench.sse_client import StreamFailed

_decode = msgspec.json.Decoder()


class Answer(msgspec.Struct):
    """What one client got: a whole answer, a stream it closed on purpose, or an error."""

    text: Optional[str] = None
    finish_reason: Optional[str] = None
    usage: Optional[dict[str, int]] = None
    finish_chunks: int = 0  # stream chunks that carried a finish reason: exactly one is right
    disconnected: bool = False
    error: Optional[str] = None


def reference_pass(url: str, bodies: list[dict[str, Any]], timeout_s: float) -> list[Answer]:
    return asyncio.run(_all(url, timeout_s, [_whole(body) for body in bodies]))


def streaming_pass(url: str, bodies: list[dict[str, Any]], leave_after: dict[int, int], timeout_s: float) -> list[Answer]:
    """`leave_after`: request index -> text chunks after which that client disconnects."""
    return asyncio.run(_all(url, timeout_s, [_streamed(body, leave_after.get(i)) for i, body in enumerate(bodies)]))


async def _all(url: str, timeout_s: float, clients) -> list[Answer]:
    async with async_client(url, timeout_s) as client:
        return list(await asyncio.gather(*(one(client) for one in clients)))


def _whole(body: dict[str, Any]):
    async def one(client: httpx.AsyncClient) -> Answer:
        try:
            response = await client.post("/v1/completions", json=body)
        except httpx.HTTPError as exc:
            return Answer(error=f"{type(exc).__name__}: {exc}")
        if response.status_code != 200:
            return Answer(error=f"HTTP {response.status_code}: {response.text[:200]}")
        answer = response.json()
        choice = answer["choices"][0]
        return Answer(choice["text"], choice["finish_reason"], answer["usage"])

    return one


def _streamed(body: dict[str, Any], leave_after: Optional[int]):
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}

    async def one(client: httpx.AsyncClient) -> Answer:
        pieces: list[str] = []
        got = Answer()
        chunks = 0
        try:
            async with contextlib.aclosing(stream_events(client, body)) as events:
                async for event in events:
                    if event.get("usage"):
                        got.usage = event["usage"]
                    for choice in event.get("choices") or ():
                        pieces.append(choice.get("text") or "")
                        chunks += bool(choice.get("text"))
                        if choice.get("finish_reason") is not None:
                            got.finish_chunks += 1
                            got.finish_reason = choice["finish_reason"]
                    if leave_after is not None and chunks >= leave_after and got.finish_reason is None:
                        return Answer(disconnected=True)  # leaving the `with` closes the connection
        except (httpx.HTTPError, StreamFailed) as exc:
            return Answer(error=f"{type(exc).__name__}: {exc}")
        got.text = "".join(pieces)
        return got

    return one


def problems(streamed: Answer, reference: Answer, max_tokens: int) -> list[str]:
    """How a completed stream differs from its reference answer (empty: exact)."""
    found = []
    if streamed.finish_chunks != 1:
        found.append(f"{streamed.finish_chunks} chunks carried a finish reason, not 1")
    if streamed.text != reference.text:
        common = next((i for i, (a, b) in enumerate(zip(streamed.text, reference.text)) if a != b),
                      min(len(streamed.text), len(reference.text)))
        found.append(f"text differs from char {common} (streamed {len(streamed.text)} chars, reference "
                     f"{len(reference.text)}): {streamed.text[common:common + 20]!r} vs {reference.text[common:common + 20]!r}")
    if streamed.finish_reason != reference.finish_reason:
        found.append(f"finish_reason {streamed.finish_reason!r}, reference {reference.finish_reason!r}")
    if streamed.usage != reference.usage:
        found.append(f"usage {streamed.usage}, reference {reference.usage}")
    usage = streamed.usage or {}
    if usage.get("total_tokens") != usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0):
        found.append(f"usage does not add up: {usage}")
    if streamed.finish_reason == "length" and usage.get("completion_tokens") != max_tokens:
        found.append(f"finish_reason length after {usage.get('completion_tokens')} of {max_tokens} tokens")
    return found


# ---- the clients: httpx, as users' clients are (the load generator's lean one is `sse_client`) ----


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
