"""The load generator's HTTP/1.1 client (`tools/bench/sse_client.py`) against raw servers that
write exactly the bytes a test chooses: chunked and sized bodies cut anywhere, kept-alive
connections reused, a pooled connection the server closed meanwhile, and every way an answer
can fail to be a whole stream."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import pytest

from graphrelay.tools.bench.sse_client import SseClient, StreamFailed, parse_chunk

EVENTS = [b'{"choices":[{"index":0,"text":"he"}]}', b'{"choices":[{"index":0,"text":""}]}',
          b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":7,"total_tokens":10}}']
STREAM = b"".join(b"data: " + e + b"\n\n" for e in EVENTS) + b": keep-alive comment\n\ndata: [DONE]\n\n"


def chunked(body: bytes, cuts: list[int]) -> bytes:
    """`body` in chunked transfer coding, cut at `cuts` (offsets into body)."""
    edges = [0, *sorted(c for c in cuts if 0 < c < len(body)), len(body)]
    parts = [body[a:b] for a, b in zip(edges, edges[1:]) if b > a]
    return b"".join(b"%x\r\n" % len(p) + p + b"\r\n" for p in parts) + b"0\r\n\r\n"


def head(status: int = 200, **headers: str) -> bytes:
    lines = [f"HTTP/1.1 {status} X"] + [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@contextlib.asynccontextmanager
async def raw_server(answers):
    """A server that reads each request (head and Content-Length body) and writes the next of
    `answers` (bytes, or a callable(writer) for odd behaviour); yields (url, requests seen,
    connections accepted)."""
    seen, accepted = [], []

    async def handle(reader, writer):
        accepted.append(writer)
        while answers:
            try:
                request_head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            length = int(next(line.split(b":")[1] for line in request_head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            seen.append((request_head, msgspec.json.decode(await reader.readexactly(length))))
            answer = answers.pop(0)
            if callable(answer):
                answer(writer)
                break
            writer.write(answer)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen, accepted
    finally:
        server.close()


async def collect(client: SseClient, body: dict) -> list[bytes]:
    async with contextlib.aclosing(client.events("/v1/completions", body)) as events:
        return [data async for data in events]


@pytest.mark.parametrize("cuts", [[], [1], [5, 6, 7], list(range(1, len(STREAM))), [len(STREAM) - 3]])
def test_a_chunked_stream_cut_anywhere_yields_each_event_once(cuts):
    async def run():
        answer = head(transfer_encoding="chunked", content_type="text/event-stream") + chunked(STREAM, cuts)
        async with raw_server([answer]) as (url, seen, _):
            client = SseClient(url, 5)
            got = await collect(client, {"prompt": [1, 2], "stream": True})
            await client.close()
        assert got == EVENTS
        ((request_head, body),) = seen
        assert request_head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert body == {"prompt": [1, 2], "stream": True}
    asyncio.run(run())


def test_a_sized_body_works_like_a_chunked_one():
    async def run():
        async with raw_server([head(content_length=str(len(STREAM))) + STREAM]) as (url, _, _):
            client = SseClient(url, 5)
            assert await collect(client, {}) == EVENTS
            await client.close()
    asyncio.run(run())


def test_a_kept_alive_connection_is_reused_and_a_closed_one_replaced():
    async def run():
        answer = head(transfer_encoding="chunked") + chunked(STREAM, [10])
        # The server answers twice on the first connection, then closes it with the third
        # request unanswered: the client must send that request again on a new connection.
        async with raw_server([answer, answer, lambda w: None, answer]) as (url, seen, accepted):
            client = SseClient(url, 5)
            for _ in range(3):
                assert await collect(client, {}) == EVENTS
            await client.close()
        assert len(accepted) == 2 and len(seen) == 4
    asyncio.run(run())


@pytest.mark.parametrize("answer, message", [
    (head(500, content_length="19") + b'{"error":"boom!!!"}', r"HTTP 500: \{\"error\":\"boom!!!\"\}"),
    (head(transfer_encoding="chunked") + chunked(b"data: " + EVENTS[0] + b"\n\n", []), "without data: \\[DONE\\]"),
    (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.1 answer"),
])
def test_what_is_not_a_whole_stream_fails_clearly(answer, message):
    async def run():
        async with raw_server([answer]) as (url, _, _):
            client = SseClient(url, 5)
            with pytest.raises(StreamFailed, match=message):
                await collect(client, {})
            await client.close()
    asyncio.run(run())


def test_chunks_parse_to_what_the_timing_reads():
    assert [parse_chunk(e).has_text for e in EVENTS] == [True, False, False]
    assert parse_chunk(EVENTS[2]).usage.completion_tokens == 7
    with pytest.raises(StreamFailed, match="error event: .*overloaded"):
        parse_chunk(b'{"error":{"message":"overloaded"}}')
    with pytest.raises(StreamFailed, match="not a completion chunk"):
        parse_chunk(b"[1, 2")


def test_only_plain_http_urls():
    with pytest.raises(ValueError, match="plain http://HOST:PORT only"):
        SseClient("https://example.com", 5)
