"""A lean HTTP/1.1 client for timing server-sent-event streams: the load generator's own.

`bench serve --url` must not be what bounds the run. httpx streams every event through
h11's pure-Python parser, its line splitter and an untyped JSON decode; on the H200 host 8
such client processes used 72% of their CPU to keep up with the server at 65k events/s, so
the run measured the client as much as the server. This client speaks just the HTTP/1.1 the
benchmark needs, on asyncio streams: one POST with a JSON body, a status line and headers,
then a chunked (or sized) body cut into events at blank lines; each event's JSON decodes into
a typed struct that keeps only what the timing needs (whether a choice carries text, the
usage's token count, an error). Connections are kept alive and reused one request at a
time, as a pooling client's are.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from typing import Any, Optional

import msgspec


class StreamFailed(Exception):
    """The server answered, but not with a whole stream."""


class _Choice(msgspec.Struct):
    text: str = ""


class _Usage(msgspec.Struct):
    completion_tokens: Optional[int] = None


class Chunk(msgspec.Struct):
    """One event of a completion stream, as far as the timing reads it."""

    choices: list[_Choice] = []
    usage: Optional[_Usage] = None
    error: Any = None

    @property
    def has_text(self) -> bool:
        return any(c.text for c in self.choices)


_decode_chunk = msgspec.json.Decoder(Chunk).decode
_HEADER_LIMIT = 1 << 16  # the longest head (or chunk-size line) a connection's reader takes


def parse_chunk(data: bytes) -> Chunk:
    """An event's `data:` payload; StreamFailed for one that is not a completion chunk."""
    try:
        chunk = _decode_chunk(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise StreamFailed(f"a stream event is not a completion chunk: {data[:200]!r}") from None
    if chunk.error is not None:
        raise StreamFailed(f"the server sent an error event: {str(chunk.error)[:200]}")
    return chunk


class SseClient:
    """POSTs JSON to one `http://host:port` server and yields the events of each answer."""

    def __init__(self, url: str, connect_timeout_s: float):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--url {url}: the load generator speaks plain http://HOST:PORT only")
        self.host, self.port = parts.hostname, parts.port or 80
        self._authority = f"{self.host}:{self.port}".encode()
        self._connect_timeout_s = connect_timeout_s
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()

    async def events(self, path: str, body: dict):
        """Each event's `data:` payload (bytes) up to `[DONE]`, exclusive. Raises StreamFailed
        for an answer other than a 200 stream, or one that ends without `[DONE]`; OSError and
        asyncio.IncompleteReadError for a broken connection. The connection goes back to the
        pool only after a whole answer."""
        payload = msgspec.json.encode(body)
        request = (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: " + self._authority +
                   b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(payload)).encode() +
                   b"\r\n\r\n" + payload)
        reader, writer, status, headers = await self._ask(request)
        reusable = False
        try:
            chunked = headers.get(b"transfer-encoding", b"").lower() == b"chunked"
            if status != 200:
                text = (await _read_whole(reader, headers, chunked)).decode("utf-8", "replace")
                raise StreamFailed(f"HTTP {status}: {text[:200]}")
            pending, done = b"", False
            async for data in _body_pieces(reader, headers, chunked):
                pending += data
                *whole, pending = pending.split(b"\n\n")
                for event in whole:
                    if not event.startswith(b"data:"):
                        continue  # a comment or a keep-alive line
                    value = event[5:].strip()
                    if value == b"[DONE]":
                        done = True
                    elif not done:
                        yield value
            if not done:
                raise StreamFailed("the stream ended without data: [DONE]")
            reusable = headers.get(b"connection", b"").lower() != b"close"
        finally:
            if reusable:
                self._idle.append((reader, writer))
            else:
                writer.close()


    async def _ask(self, request: bytes):
        """Send `request` on an idle connection, else a new one, and read the answer's head. A
        kept-alive connection the server has closed meanwhile fails before any answer: the
        request goes again on a new connection."""
        while self._idle:
            reader, writer = self._idle.pop()
            try:
                writer.write(request)
                return (reader, writer, *await _read_head(reader))
            except (OSError, asyncio.IncompleteReadError):
                writer.close()
        reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port, limit=_HEADER_LIMIT),
                                                self._connect_timeout_s)
        try:
            writer.write(request)
            return (reader, writer, *await _read_head(reader))
        except BaseException:
            writer.close()
            raise


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes]]:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise StreamFailed(f"the answer's headers exceed {_HEADER_LIMIT} bytes") from None
    status_line, *lines = head[:-4].split(b"\r\n")
    fields = status_line.split(b" ", 2)
    if len(fields) < 2 or not fields[0].startswith(b"HTTP/1.") or not fields[1].isdigit():
        raise StreamFailed(f"not an HTTP/1.1 answer: {status_line[:200]!r}")
    headers = {}
    for line in lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    return int(fields[1]), headers


async def _body_pieces(reader: asyncio.StreamReader, headers: dict[bytes, bytes], chunked: bool):
    """The body as it arrives: chunked transfer coding decoded, else Content-Length bytes (or
    up to the connection's end)."""
    if chunked:
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the blank line
                    pass
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    elif b"content-length" in headers:
        left = int(headers[b"content-length"])
        while left:
            data = await reader.read(min(left, 1 << 16))
            if not data:
                raise asyncio.IncompleteReadError(b"", left)
            left -= len(data)
            yield data
    else:
        while data := await reader.read(1 << 16):
            yield data


async def _read_whole(reader: asyncio.StreamReader, headers: dict[bytes, bytes], chunked: bool) -> bytes:
    return b"".join([piece async for piece in _body_pieces(reader, headers, chunked)])
