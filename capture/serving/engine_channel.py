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
from graphrelay.capture.serving.engine_messages import (Abort, Finish, Rejection, Results, Submit, Tokens,
                                                       decode_to_engine, encode)
from graphrelay.capture.serving.frames import FrameReader, FrameWriter
from graphrelay.capture.serving.inbox import Drained
from graphrelay.capture.serving.loop import RequestOutput
from graphrelay.capture.serving.workloads import Request

HEARTBEAT_S = 0.2  # an idle engine's slot counts and memory reach /health at least this often


class EngineChannel:
    """`Inbox` (`drain`, `wait`) and `Sink` (`on_tokens`, `on_finish`) of one serving loop,
    over the request pipe's read end and the results pipe's write end."""

    def __init__(self, requests_fd: int, results_fd: int, loop):
        self._requests = FrameReader(requests_fd)
        self._results = FrameWriter(results_fd)  # blocking: the HTTP side's backpressure
        self._loop = loop
        self._controls = loop.engine.controls
        self._events: list = []  # Tokens / Finish since the last Results
        self._admitted: list[str] = []
        self._rejected: list[Rejection] = []
        self._taken: list[Request] = []  # admitted, not yet drained by the loop
        self._aborts: list[str] = []
        self._closed = False  # Close came, or the HTTP process is gone
        self._compiles: list[tuple[Request, Future]] = []
        self._abort_when_compiled: set[str] = set()  # aborted while its grammar compiled
        self._compiler: Optional[ThreadPoolExecutor] = None  # started by the first grammar
        self._wake_read, self._wake_write = os.pipe()  # a finished compile wakes an idle wait
        os.set_blocking(self._wake_read, False)
        self._last_sent = 0.0

    # ---- Sink --------------------------------------------------------------------------------

    def on_tokens(self, request_id: str, tokens: list[int], logprobs=None) -> None:
        self._events.append(Tokens(request_id, tokens, logprobs))

    def on_finish(self, output: RequestOutput) -> None:
        self._events.append(Finish(msgspec.structs.replace(output, token_times_ms=[])))  # unused there

    # ---- Inbox -------------------------------------------------------------------------------

    def drain(self) -> Drained:
        self._take()
        self.ship()
        drained = Drained(self._taken, self._aborts, self._closed and not self._compiles)
        self._taken, self._aborts = [], []
        return drained

    def wait(self, timeout: float) -> None:
        """Ship what is gathered, then sleep until a frame or a compiled grammar arrives, or
        `timeout` seconds pass."""
        self.ship()
        if self._closed and not self._compiles:
            return
        watched = [self._wake_read] + ([] if self._requests.closed else [self._requests.fd])
        select.select(watched, [], [], timeout)

    # ---- the pipes ---------------------------------------------------------------------------

    def ship(self, force: bool = False) -> None:
        """One Results frame with everything gathered; when idle, one every HEARTBEAT_S."""
        now = time.monotonic()
        heartbeat = now - self._last_sent >= HEARTBEAT_S
        if not (force or heartbeat or self._events or self._admitted or self._rejected):
            return
        message = Results(self._events, self._admitted, self._rejected, self._loop.occupancy(),
                          resident_bytes() if heartbeat or force else None)
        self._events, self._admitted, self._rejected = [], [], []
        self._results.send(encode(message))
        self._last_sent = now

    def send(self, message) -> None:
        self._results.send(encode(message))

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _take(self) -> None:
        for frame in self._requests.read():
            message = decode_to_engine(frame)
            if isinstance(message, Submit):
                self._check(message.request)
            elif isinstance(message, Abort):
                if any(request.id == message.request_id for request, _ in self._compiles):
                    self._abort_when_compiled.add(message.request_id)
                else:
                    self._aborts.append(message.request_id)
            else:
                self._closed = True
        if self._requests.closed:
            self._closed = True  # the HTTP process is gone: take nothing more, finish what is held
        if self._compiles:
            self._take_compiled()

    def _check(self, request: Request) -> None:
        params = request.controls
        if params is None or self._controls is None:
            self._admit(request)
        elif params.grammar is None:
            self._checked(request, self._check_error(request))
        else:
            if self._compiler is None:
                self._compiler = ThreadPoolExecutor(1, thread_name_prefix="graphrelay-grammar")
            future = self._compiler.submit(self._check_error, request)
            future.add_done_callback(lambda _: os.write(self._wake_write, b"!"))
            self._compiles.append((request, future))

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
        for request, future in self._compiles:
            if future.done():
                self._checked(request, future.result())
            else:
                waiting.append((request, future))
        self._compiles = waiting

    def _checked(self, request: Request, error: Optional[str]) -> None:
        if error is None:
            self._admit(request)
            if request.id in self._abort_when_compiled:
                self._aborts.append(request.id)  # the loop finishes it as aborted: the HTTP side's end
        else:
            self._rejected.append(Rejection(request.id, error))
        self._abort_when_compiled.discard(request.id)

    def _admit(self, request: Request) -> None:
        self._taken.append(request)
        self._admitted.append(request.id)
