"""The engine in its own process behind the HTTP server (`graphrelay serve --port P`, the
default placement): the HTTP process and the loop share no interpreter lock.

The child process builds and captures the engine (`build`, a picklable callable returning the
`ServingLoop`), then runs `ServingLoop.serve` on its main thread. Two more threads there talk to
the parent over one duplex pipe, every message msgpack-encoded (`msgspec`):

- the reader takes `Submit` / `Abort` / `Close`. It checks a submitted request's sampling
  controls against the engine (compiling its grammar, as the HTTP side's prepare thread does
  for an engine thread), answers `Admitted` or `RejectedRequest`, and hands the request to the
  loop's `Inbox`. A closed pipe (the parent died) closes the inbox: the loop finishes what it
  holds and the process exits.
- the sender is the loop's `Sink`: results are appended to a deque on the loop's thread, and
  the sender ships what has gathered as one `Results` message, with the loop's slot counts and
  the child's resident memory (for `/health`); idle, it sends those counts every HEARTBEAT_S.

The parent (`EngineProcess`, an `EngineHandle`) starts the child and waits for `Ready` before
the server listens; from then on the event loop itself reads the pipe (`add_reader`), so no
thread of the HTTP process waits on the interpreter lock between the engine's results and the
streams (a handoff that costs up to the lock's 5 ms switch interval while the loop is busy).
When the loop returns, the child sends `Finished` with its stats and exits; if it dies or fails
first, the parent fails every request and stops the server (exit status 1). The child ignores
SIGINT and SIGTERM: the parent shuts it down with `Close` once its own requests have drained.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import threading
import traceback
from collections import deque
from multiprocessing.connection import Connection
from typing import Callable, Optional, Union

import msgspec

from graphrelay.capture.iteration.controls.logprobs import TokenLogprobs
from graphrelay.capture.serving.engine_handle import EngineHandle, EngineInfo, EngineStopped, Rejected, resident_bytes
from graphrelay.capture.serving.inbox import Inbox
from graphrelay.capture.serving.loop import RequestOutput, ServingLoop
from graphrelay.capture.serving.loop_stats import LoopStats
from graphrelay.capture.serving.workloads import Request

HEARTBEAT_S = 0.2  # an idle child's slot counts reach /health at least this often
START_TIMEOUT_S = 3600.0  # loading and capturing a large model on a busy machine


# ---- messages ----------------------------------------------------------------------------------

class Submit(msgspec.Struct, tag=True, array_like=True):
    request: Request


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_id: str


class Close(msgspec.Struct, tag=True, array_like=True):
    pass


class Ready(msgspec.Struct, tag=True, array_like=True):
    info: EngineInfo


class Admitted(msgspec.Struct, tag=True, array_like=True):
    request_id: str


class RejectedRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    message: str


class Tokens(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    tokens: list[int]
    logprobs: Optional[list[TokenLogprobs]]


class Finish(msgspec.Struct, tag=True, array_like=True):
    output: RequestOutput


class Results(msgspec.Struct, tag=True, array_like=True):
    events: list[Union[Tokens, Finish]]
    occupancy: dict[str, int]
    rss_bytes: Optional[int]


class Finished(msgspec.Struct, tag=True, array_like=True):
    stats: LoopStats


class Failed(msgspec.Struct, tag=True, array_like=True):
    message: str


ToChild = Union[Submit, Abort, Close]
ToParent = Union[Ready, Admitted, RejectedRequest, Results, Finished, Failed]
_encode = msgspec.msgpack.Encoder().encode
_to_child = msgspec.msgpack.Decoder(ToChild)
_to_parent = msgspec.msgpack.Decoder(ToParent)


class _Pipe:
    """One end of the pipe: whole messages, sent from any thread (one lock keeps them whole)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message) -> None:
        data = _encode(message)
        with self._lock:
            self.conn.send_bytes(data)


# ---- the child -------------------------------------------------------------------------------

class _PipeSink:
    """The loop's Sink in the child: appends on the loop's thread, a sender thread ships."""

    def __init__(self, pipe: _Pipe, loop: ServingLoop):
        self.pipe, self.loop = pipe, loop
        self._events: deque = deque()
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._ship, name="graphrelay-engine-sender", daemon=True)
        self._thread.start()

    def on_tokens(self, request_id: str, tokens: list[int], logprobs=None) -> None:
        self._events.append(Tokens(request_id, tokens, logprobs))
        self._wake_sender()

    def on_finish(self, output: RequestOutput) -> None:
        self._events.append(Finish(msgspec.structs.replace(output, token_times_ms=[])))  # unused by the parent
        self._wake_sender()

    def _wake_sender(self) -> None:
        # Event.set takes a lock each call: once per batch, not once per stream an iteration.
        if not self._wake.is_set():
            self._wake.set()

    def close(self) -> None:
        """Ship what is left, then stop the sender."""
        self._stopped = True
        self._wake.set()
        self._thread.join()

    def _ship(self) -> None:
        while True:
            self._wake.wait(HEARTBEAT_S)
            self._wake.clear()
            events = [self._events.popleft() for _ in range(len(self._events))]
            self.pipe.send(Results(events, self.loop.occupancy(), resident_bytes()))
            if self._stopped and not self._events:
                return


def _read_requests(pipe: _Pipe, loop: ServingLoop, inbox: Inbox) -> None:
    controls = loop.engine.controls
    try:
        while True:
            message = _to_child.decode(pipe.conn.recv_bytes())
            if isinstance(message, Submit):
                request = message.request
                if request.controls is not None and controls is not None:
                    try:
                        controls.check(request.controls, request.stop_tokens)
                    except ValueError as exc:
                        pipe.send(RejectedRequest(request.id, str(exc)))
                        continue
                inbox.submit(request)
                pipe.send(Admitted(request.id))
            elif isinstance(message, Abort):
                inbox.abort(message.request_id)
            else:
                inbox.close()
                return
    except (EOFError, OSError):  # the parent is gone: take nothing more, finish what is held, exit
        inbox.close()


def child_main(build: Callable[[], ServingLoop], conn: Connection) -> None:
    """The engine process's entry point (`multiprocessing`, spawn)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the parent decides when to stop (Close)
    pipe = _Pipe(conn)
    try:
        loop = build()
        pipe.send(Ready(EngineInfo.of(loop.engine)))
        inbox = Inbox()
        sink = _PipeSink(pipe, loop)
        threading.Thread(target=_read_requests, args=(pipe, loop, inbox), name="graphrelay-engine-reader",
                         daemon=True).start()
        stats = loop.serve(inbox, sink)
        sink.close()
        pipe.send(Finished(stats))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails its requests
        traceback.print_exc()
        try:
            pipe.send(Failed(f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        raise SystemExit(1) from None


# ---- the parent ------------------------------------------------------------------------------

class EngineProcess(EngineHandle):
    """The HTTP process's handle on an engine process; `launch` before serving."""

    def __init__(self, build: Callable[[], ServingLoop], max_waiting: int, *, start_timeout_s: float = START_TIMEOUT_S):
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._conn, child_end = context.Pipe(duplex=True)
        self._process = context.Process(target=child_main, args=(build, child_end), name="graphrelay-engine",
                                        daemon=True)
        self._process.start()
        child_end.close()
        if not self._conn.poll(start_timeout_s):
            self._process.kill()
            raise RuntimeError(f"the engine process did not come up in {start_timeout_s} s")
        try:
            first = _to_parent.decode(self._conn.recv_bytes())
        except EOFError:
            self._process.join(5)
            first = Failed(f"the engine process exited with status {self._process.exitcode}")
        if not isinstance(first, Ready):
            self._process.join(10)
            raise RuntimeError(f"the engine process failed to start: {getattr(first, 'message', first)}")
        super().__init__(first.info, max_waiting)
        self._pipe = _Pipe(self._conn)
        self._occupancy: dict = {"slots": first.info.max_reqs, "free_slots": first.info.max_reqs, "running": 0,
                                 "retiring": 0, "waiting": 0}
        self._engine_rss: Optional[int] = None
        self._admissions: dict[str, asyncio.Future] = {}  # asyncio thread only
        self._finished_run: Optional[asyncio.Event] = None  # set once the child sent Finished, or failed

    # ---- asyncio side -----------------------------------------------------------------------

    def start(self) -> None:
        self._bind()
        self._finished_run = asyncio.Event()
        self._events.add_reader(self._conn.fileno(), self._read)

    def submit(self, request: Request) -> asyncio.Queue:
        queue = self._register(request)
        self._admissions[request.id] = self._events.create_future()
        self._pipe.send(Submit(request))
        return queue

    async def admit(self, request: Request) -> asyncio.Queue:
        queue = self.submit(request)
        try:
            await self._admissions[request.id]
        except asyncio.CancelledError:  # the client left while the engine admitted it
            self.abort(request.id)
            raise
        finally:
            self._admissions.pop(request.id, None)
        return queue

    def abort(self, request_id: str) -> None:
        if self._process.is_alive():
            self._pipe.send(Abort(request_id))

    async def stop(self) -> None:
        """Admit nothing more, let the engine finish what it holds, wait for the process."""
        if self._process.is_alive():
            try:
                self._pipe.send(Close())
            except OSError:
                pass
        await self._finished_run.wait()
        await asyncio.to_thread(self._process.join)

    def running(self) -> bool:
        return self._process.is_alive() and not (self._finished_run is not None and self._finished_run.is_set())

    def occupancy(self) -> dict:
        return {**self._occupancy, "engine_rss_bytes": self._engine_rss}

    def _admitted(self, request_id: str, error: Optional[str]) -> None:
        """On the event loop: resolve `admit`'s wait; a rejected request is no longer outstanding."""
        future = self._admissions.get(request_id)
        if error is not None:
            self._queues.pop(request_id, None)
            self._outstanding -= 1
        if future is not None and not future.done():
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(Rejected(error))

    # ---- results (on the event loop, whenever the pipe is readable) ------------------------

    def _read(self) -> None:
        try:
            while self._conn.poll():  # every whole message waiting, then back to the loop
                message = _to_parent.decode(self._conn.recv_bytes())
                if isinstance(message, Results):
                    self._occupancy, self._engine_rss = message.occupancy, message.rss_bytes
                    for event in message.events:
                        if isinstance(event, Tokens):
                            self.on_tokens(event.request_id, event.tokens, event.logprobs)
                        else:
                            self.on_finish(event.output)
                elif isinstance(message, (Admitted, RejectedRequest)):
                    self._admitted(message.request_id, getattr(message, "message", None))
                elif isinstance(message, Finished):
                    self.stats = message.stats
                    self._stop_reading()
                    return
                else:
                    raise RuntimeError(f"the engine process failed: {message.message}")
        except BaseException as exc:  # noqa: BLE001 - EOF (the child died) or its failure
            if isinstance(exc, EOFError):
                self._process.join(5)
                exc = RuntimeError(f"the engine process exited (status {self._process.exitcode})")
            self._stop_reading()
            self._fail_admissions(exc)
            self._fail(exc)

    def _stop_reading(self) -> None:
        self._events.remove_reader(self._conn.fileno())
        self._finished_run.set()

    def _fail_admissions(self, exc: BaseException) -> None:
        for future in self._admissions.values():
            if not future.done():
                future.set_exception(EngineStopped(f"the engine failed: {exc}"))
