"""The engine in its own process behind the HTTP server (`graphrelay serve --port P`, the
default placement): the HTTP process and the loop share no interpreter lock.

The child process builds and captures the engine (`build`, a picklable callable returning the
`ServingLoop`), then runs `ServingLoop.serve` on its main thread with an `EngineChannel` as
both its inbox and its sink: the loop itself reads the request pipe and writes the results
pipe at its turn boundaries (`engine_channel` says why no thread of its own does). The two
processes talk over two one-way pipes in length-prefixed msgpack frames (`frames`,
`engine_messages`).

The parent (`EngineProcess`, an `EngineHandle`) starts the child and waits for `Ready` before
the server listens; from then on the event loop itself reads the results pipe (`add_reader`)
and fans each `Results` frame out to the streams at once, and writes requests without ever
blocking. When the loop returns, the child sends `Finished` with its stats and exits; if it dies
or fails first, the parent fails every request and stops the server (exit status 1). The child
ignores SIGINT and SIGTERM: the parent shuts it down with `Close` once its own requests have
drained.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import select
import signal
import time
import traceback
from multiprocessing.connection import Connection
from typing import Callable, Optional

from graphrelay.capture.serving.engine_channel import EngineChannel
from graphrelay.capture.serving.engine_handle import (EngineHandle, EngineInfo, EngineStopped, HeldCount, Rejected,
                                                    SharedHeldCount)
from graphrelay.capture.serving.engine_messages import (Abort, Close, Failed, Finished, Hello, Ready, Results, Submit,
                                                       Tokens, decode_to_server, encode)
from graphrelay.capture.serving.frames import FrameReader, FrameWriter, widen
from graphrelay.capture.serving.heap import frozen_startup_heap
from graphrelay.capture.serving.loop import ServingLoop
from graphrelay.capture.serving.workloads import Request

START_TIMEOUT_S = 3600.0  # loading and capturing a large model on a busy machine


# ---- the child -------------------------------------------------------------------------------

def child_main(build: Callable[[], ServingLoop], pipes: list[tuple[Connection, Connection]]) -> None:
    """The engine process's entry point (`multiprocessing`, spawn): one (requests, results)
    pair of connections per API server. The connections only carry their pipes' descriptors,
    which the frames read and write directly."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the servers decide when to stop (Close)
    writers = [FrameWriter(results.fileno()) for _, results in pipes]

    def tell_all(message) -> None:
        for writer in writers:
            try:
                writer.send(encode(message))
            except OSError:  # that server is gone already
                pass
    try:
        loop = build()
        tell_all(Ready(EngineInfo.of(loop.engine)))
        channel = EngineChannel([(requests.fileno(), results.fileno()) for requests, results in pipes], loop)
        with frozen_startup_heap():
            stats = loop.serve(channel, channel)
        channel.ship(force=True)
        channel.send(Finished(stats))
        channel.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the servers, which fail their requests
        traceback.print_exc()
        tell_all(Failed(f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None


# ---- the parent ------------------------------------------------------------------------------

# An API server's two pipe ends: requests (write), results (read). Picklable: a spawned API
# server process takes its pair with it.
ServerPipes = tuple[Connection, Connection]


class EngineLink(EngineHandle):
    """One API server process's handle on the engine process, over its own pair of pipes;
    constructing it waits until the engine is captured and ready."""

    def __init__(self, pipes: ServerPipes, max_waiting: int, *, held: Optional[HeldCount] = None,
                 start_timeout_s: float = START_TIMEOUT_S):
        self._pipes = pipes  # the connections own the descriptors: kept for as long as they are used
        requests, results = pipes
        self._reader = FrameReader(results.fileno())
        self._early: list[bytes] = []  # frames read with Ready (a late server's heartbeats): `_read`'s first
        first = self._first_message(start_timeout_s)
        if not isinstance(first, Ready):
            raise RuntimeError(f"the engine process failed to start: {getattr(first, 'message', first)}")
        super().__init__(first.info, max_waiting, held)
        self._requests_fd = requests.fileno()
        self._writer: Optional[FrameWriter] = None  # on the event loop, from `start`
        self._occupancy: dict = {"slots": first.info.max_reqs, "free_slots": first.info.max_reqs, "running": 0,
                                 "retiring": 0, "waiting": 0}
        self._server_rss: Optional[int] = None  # the engine's sum over every process of the server
        self._admissions: dict[str, asyncio.Future] = {}  # asyncio thread only
        self._finished_run: Optional[asyncio.Event] = None  # set once the child sent Finished, or failed

    def _first_message(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while True:
            frames = self._reader.read()
            if frames:
                self._early = frames[1:]
                return decode_to_server(frames[0])
            if self._reader.closed:
                return Failed(f"the engine process exited{self._exit_status()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the engine process did not come up in {timeout_s} s")
            select.select([self._reader.fd], [], [], left)

    def _exit_status(self) -> str:
        return ""  # only the process that started the engine can tell

    # ---- asyncio side -----------------------------------------------------------------------

    def start(self) -> None:
        self._bind()
        self._finished_run = asyncio.Event()
        self._writer = FrameWriter(self._requests_fd, self._events)
        self._writer.send(encode(Hello(os.getpid())))
        self._events.add_reader(self._reader.fd, self._read)

    def submit(self, request: Request) -> asyncio.Queue:
        queue = self._register(request)
        self._admissions[request.id] = self._events.create_future()
        self._writer.send(encode(Submit(request)))
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
        if self.running() and not self._writer.broken:
            self._writer.send(encode(Abort(request_id)))

    async def stop(self) -> None:
        """Admit nothing more from here; the engine finishes what it holds once every API
        server has stopped."""
        if self.running() and not self._writer.broken:
            self._writer.send(encode(Close()))
        await self._finished_run.wait()

    def running(self) -> bool:
        return self.failure is None and not self._reader.closed and not (
            self._finished_run is not None and self._finished_run.is_set())

    def occupancy(self) -> dict:
        return {**self._occupancy, "server_rss_bytes": self._server_rss}

    def _admitted(self, request_id: str, error: Optional[str]) -> None:
        """Resolve `admit`'s wait; a rejected request is no longer outstanding."""
        future = self._admissions.get(request_id)
        if error is not None:
            self._queues.pop(request_id, None)
            self._held.give()
        if future is not None and not future.done():
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(Rejected(error))

    # ---- results (on the event loop, whenever the pipe is readable) ------------------------

    def _schedule_delivery(self) -> None:
        pass  # `_read` delivers what it posted before it returns: it runs on the event loop already

    def _read(self) -> None:
        try:
            frames, self._early = self._early + self._reader.read(), []
            for frame in frames:
                message = decode_to_server(frame)
                if isinstance(message, Results):
                    self._take_results(message)
                elif isinstance(message, Finished):
                    self.stats = message.stats
                    self._stop_reading()
                    return
                else:
                    raise RuntimeError(f"the engine process failed: {message.message}")
            if self._reader.closed:
                raise RuntimeError(f"the engine process exited{self._exit_status()}")
        except BaseException as exc:  # noqa: BLE001 - the child died, or reported its failure
            self._stop_reading()
            self._fail_admissions(exc)
            self._fail(exc)
        finally:
            self._deliver()

    def _take_results(self, message: Results) -> None:
        self._occupancy = message.occupancy
        if message.rss_bytes is not None:
            self._server_rss = message.rss_bytes
        for request_id in message.admitted:
            self._admitted(request_id, None)
        for rejection in message.rejected:
            self._admitted(rejection.request_id, rejection.message)
        for event in message.events:
            if isinstance(event, Tokens):
                self.on_tokens(event.request_id, event.tokens, event.logprobs)
            else:
                self.on_finish(event.output)

    def _stop_reading(self) -> None:
        self._events.remove_reader(self._reader.fd)
        self._finished_run.set()

    def _fail_admissions(self, exc: BaseException) -> None:
        for future in self._admissions.values():
            if not future.done():
                future.set_exception(EngineStopped(f"the engine failed: {exc}"))


class EngineProcess(EngineLink):
    """Starts the engine process with a pair of pipes for each of `servers` API server
    processes, and is the first one's link; `spare_pipes` are the others', for their processes,
    and `held` the count of requests every one of them shares."""

    def __init__(self, build: Callable[[], ServingLoop], max_waiting: int, *, servers: int = 1,
                 start_timeout_s: float = START_TIMEOUT_S):
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        engine_ends, server_ends = [], []
        for _ in range(servers):
            engine_requests, server_requests = context.Pipe(duplex=False)
            server_results, engine_results = context.Pipe(duplex=False)
            widen(server_results.fileno())
            engine_ends.append((engine_requests, engine_results))
            server_ends.append((server_requests, server_results))
        self._process = context.Process(target=child_main, args=(build, engine_ends), name="graphrelay-engine",
                                        daemon=True)
        self._process.start()
        for ends in engine_ends:  # only the engine holds these now: a pipe ends when its one holder goes
            for end in ends:
                end.close()
        self.spare_pipes: list[ServerPipes] = server_ends[1:]
        self.held = SharedHeldCount(context) if servers > 1 else HeldCount()
        try:
            super().__init__(server_ends[0], max_waiting, held=self.held, start_timeout_s=start_timeout_s)
        except TimeoutError:
            self._process.kill()
            raise RuntimeError(f"the engine process did not come up in {start_timeout_s} s") from None
        except RuntimeError:
            self._process.join(10)
            raise

    def _exit_status(self) -> str:
        self._process.join(5)
        return f" (status {self._process.exitcode})"

    async def stop(self) -> None:
        await super().stop()
        await asyncio.to_thread(self._process.join)
