"""The serving loop's inbox and sink in the engine process: the pipes to the HTTP process,
read and written on the loop's own thread, at turn boundaries.

`ServingLoop.serve` calls `drain` at the start of every turn and `wait` when it idles; both
read every request frame that has arrived (never blocking) and send one `Results` frame with
what the previous turn produced: tokens, finishes, the requests just admitted and the slot
counts. No thread of the engine process waits for the interpreter lock between a request's
arrival and the loop, or between a token and the pipe: with the loop's thread busy (a small
batch's iteration is shorter than the loop's own CPU work), each such handoff waits up to the
lock's 5 ms switch interval, which is what a thread reading and a thread sending would cost
every request's first token.

With several API server processes (`serve --api-servers N`) each has its own pair of pipes
(a `_Server` here): requests come from all of them, and each request's results go back to
the one that sent it. The inbox closes once every server has sent `Close` or gone; a server
that goes (its results pipe breaks) has its requests aborted.

One request kind is not checked inline: a grammar (`json_schema` / `regex`) compiles on a
worker thread, so a slow compile holds up its own request, not every running stream; its
admission (or rejection) follows in a later turn.
"""

from __future__ import annotations

import os
import select
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import msgspec

from graphrelay.capture.serving.engine_handle import resident_bytes
from graphrelay.capture.serving.engine_messages import (Abort, Finish, Hello, Rejection, Results, Submit, Tokens,
                                                       decode_to_engine, encode)
from graphrelay.capture.serving.frames import FrameReader, FrameWriter
from graphrelay.capture.serving.inbox import Drained
from graphrelay.capture.serving.loop import RequestOutput
from graphrelay.capture.serving.workloads import Request

HEARTBEAT_S = 0.2  # an idle engine's slot counts and memory reach /health at least this often


class _Server:
    """One API server's pipes and what is gathered for it since the last Results."""

    def __init__(self, requests_fd: int, results_fd: int):
        self.requests = FrameReader(requests_fd)
        self.results = FrameWriter(results_fd)  # blocking: the HTTP side's backpressure
        self.events: list = []  # Tokens / Finish since the last Results
        self.admitted: list[str] = []
        self.rejected: list[Rejection] = []
        self.closed = False  # sent Close, or its request pipe ended
        self.gone = False  # its results pipe broke: nothing more is sent to it
        self.pid: Optional[int] = None  # from its Hello

    def has_news(self) -> bool:
        return bool(self.events or self.admitted or self.rejected)


class EngineChannel:
    """`Inbox` (`drain`, `wait`) and `Sink` (`on_tokens`, `on_finish`) of one serving loop,
    over each API server's request pipe read end and results pipe write end."""

    def __init__(self, pipes: list[tuple[int, int]], loop):
        self._servers = [_Server(requests_fd, results_fd) for requests_fd, results_fd in pipes]
        self._loop = loop
        self._controls = loop.engine.controls
        self._owner: dict[str, _Server] = {}  # request id -> the server that sent it, until it finishes
        self._taken: list[Request] = []  # admitted, not yet drained by the loop
        self._aborts: list[str] = []
        self._compiles: list[tuple[Request, _Server, Future]] = []
        self._abort_when_compiled: set[str] = set()  # aborted while its grammar compiled
        self._compiler: Optional[ThreadPoolExecutor] = None  # started by the first grammar
        self._wake_read, self._wake_write = os.pipe()  # a finished compile wakes an idle wait
        os.set_blocking(self._wake_read, False)
        self._last_sent = 0.0

    # ---- Sink --------------------------------------------------------------------------------

    def on_tokens(self, request_id: str, tokens: list[int], logprobs=None) -> None:
        server = self._owner[request_id]
        if not server.gone:
            server.events.append(Tokens(request_id, tokens, logprobs))

    def on_finish(self, output: RequestOutput) -> None:
        server = self._owner.pop(output.id)
        if not server.gone:
            server.events.append(Finish(msgspec.structs.replace(output, token_times_ms=[])))  # unused there

    # ---- Inbox -------------------------------------------------------------------------------

    def drain(self) -> Drained:
        self._take()
        self.ship()
        drained = Drained(self._taken, self._aborts, self._closed())
        self._taken, self._aborts = [], []
        return drained

    def wait(self, timeout: float) -> None:
        """Ship what is gathered, then sleep until a frame or a compiled grammar arrives, or
        `timeout` seconds pass."""
        self.ship()
        if self._closed():
            return
        watched = [self._wake_read] + [s.requests.fd for s in self._servers if not s.requests.closed]
        select.select(watched, [], [], timeout)

    def _closed(self) -> bool:
        return all(s.closed for s in self._servers) and not self._compiles

    # ---- the pipes ---------------------------------------------------------------------------

    def ship(self, force: bool = False) -> None:
        """One Results frame to each server with news; when idle, one to each every HEARTBEAT_S."""
        now = time.monotonic()
        heartbeat = force or now - self._last_sent >= HEARTBEAT_S
        occupancy = rss = None
        for server in self._servers:
            if server.gone or not (heartbeat or server.has_news()):
                continue
            if occupancy is None:
                occupancy = self._loop.occupancy()
                rss = self._server_rss() if heartbeat else None
            message = Results(server.events, server.admitted, server.rejected, occupancy, rss)
            server.events, server.admitted, server.rejected = [], [], []
            self._send_to(server, message)
        if heartbeat:
            self._last_sent = now

    def _server_rss(self) -> Optional[int]:
        """This process's resident memory and every API server's that said hello (Linux)."""
        parts = [resident_bytes()] + [resident_bytes(str(s.pid)) for s in self._servers
                                      if s.pid is not None and not s.gone]
        known = [p for p in parts if p is not None]
        return sum(known) if known else None

    def send(self, message) -> None:
        """`message` to every server still there."""
        for server in self._servers:
            if not server.gone:
                self._send_to(server, message)

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _send_to(self, server: _Server, message) -> None:
        try:
            server.results.send(encode(message))
        except BrokenPipeError:  # that API server died: its requests have nobody to go to
            server.gone = server.closed = True
            self._aborts += [rid for rid, owner in self._owner.items() if owner is server]
            self._abort_when_compiled.update(r.id for r, owner, _ in self._compiles if owner is server)

    def _take(self) -> None:
        for server in self._servers:
            if server.requests.closed:
                continue
            for frame in server.requests.read():
                message = decode_to_engine(frame)
                if isinstance(message, Submit):
                    self._check(message.request, server)
                elif isinstance(message, Hello):
                    server.pid = message.pid
                elif isinstance(message, Abort):
                    if any(request.id == message.request_id for request, _, _ in self._compiles):
                        self._abort_when_compiled.add(message.request_id)
                    else:
                        self._aborts.append(message.request_id)
                else:
                    server.closed = True  # it submits nothing more; an abort that follows still counts
            if server.requests.closed:
                server.closed = True  # that server is gone: take nothing more from it
        if self._compiles:
            self._take_compiled()

    def _check(self, request: Request, server: _Server) -> None:
        params = request.controls
        if params is None or self._controls is None:
            self._admit(request, server)
        elif params.grammar is None:
            self._checked(request, server, self._check_error(request))
        else:
            if self._compiler is None:
                self._compiler = ThreadPoolExecutor(1, thread_name_prefix="graphrelay-grammar")
            future = self._compiler.submit(self._check_error, request)
            future.add_done_callback(lambda _: os.write(self._wake_write, b"!"))
            self._compiles.append((request, server, future))

    def _check_error(self, request: Request) -> Optional[str]:
        try:
            self._controls.check(request.controls, request.stop_tokens)
        except ValueError as exc:
            return str(exc)
        return None

    def _take_compiled(self) -> None:
        try:
            os.read(self._wake_read, 4096)
        except BlockingIOError:
            pass
        waiting = []
        for request, server, future in self._compiles:
            if future.done():
                self._checked(request, server, future.result())
            else:
                waiting.append((request, server, future))
        self._compiles = waiting

    def _checked(self, request: Request, server: _Server, error: Optional[str]) -> None:
        if error is None:
            self._admit(request, server)
            if request.id in self._abort_when_compiled:
                self._aborts.append(request.id)  # the loop finishes it as aborted: the HTTP side's end
        else:
            server.rejected.append(Rejection(request.id, error))
        self._abort_when_compiled.discard(request.id)

    def _admit(self, request: Request, server: _Server) -> None:
        self._taken.append(request)
        self._owner[request.id] = server
        server.admitted.append(request.id)
