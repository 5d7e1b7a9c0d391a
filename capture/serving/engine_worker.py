"""The engine thread behind the HTTP server, and the asyncio side's handle on it.

One thread, the only one that touches the GPU, runs `ServingLoop.serve` for the server's
whole life. The asyncio side talks to it through the loop's `Inbox` (submit, abort, close:
never blocking the engine) and hears back through this worker, the loop's `Sink`: results
are batched in a deque (no lock: its appends and pops are atomic) and handed to the event
loop with one `call_soon_threadsafe` per batch, not per token, then fanned out to each
request's `asyncio.Queue`. Those three calls and one stream of results are the whole
interface, so the engine could move into its own process behind a pipe without the HTTP
layer changing.

Admission is bounded here, on the asyncio side: at most `slots + max_waiting` requests are
outstanding (submitted and not yet reported finished); past that `submit` refuses, and the
server answers 429, so a burst never grows memory without bound.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import traceback
from collections import deque
from typing import Callable, NamedTuple, Optional, Union

import torch

from graphrelay.capture.iteration.controls.logprobs import TokenLogprobs
from graphrelay.capture.serving.inbox import Inbox
from graphrelay.capture.serving.loop import RequestOutput, ServingLoop
from graphrelay.capture.serving.loop_stats import LoopStats
from graphrelay.capture.serving.workloads import Request

class NewTokens(NamedTuple):
    tokens: list[int]
    logprobs: Optional[list[TokenLogprobs]]  # one per token when the request asked


# What a request's queue receives: new tokens, its end, or the engine's failure.
Event = Union[NewTokens, RequestOutput, BaseException]


def resident_bytes() -> Optional[int]:
    """This process's resident set size from /proc/self/statm (Linux); None elsewhere."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class Overloaded(Exception):
    """Every slot is busy and the waiting queue is full."""


class EngineStopped(Exception):
    """The engine thread failed or has shut down: nothing can be served."""


class EngineWorker:
    def __init__(self, loop: ServingLoop, max_waiting: int):
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.serving = loop
        self.capacity = loop.engine.max_reqs + max_waiting
        self.inbox = Inbox()
        self.failure: Optional[BaseException] = None
        self.stats: Optional[LoopStats] = None  # the loop's measurements, once it has returned
        self._outstanding = 0  # asyncio thread only
        self._finished: dict[str, int] = {}  # finish reason -> requests (asyncio thread only)
        self._queues: dict[str, asyncio.Queue] = {}  # asyncio thread only
        # engine -> asyncio: deque appends and pops are atomic, so the engine thread posts each
        # request's tokens without a lock (256 streams: one post each per iteration).
        self._batch: deque[tuple[str, Event]] = deque()
        self._wake_scheduled = False  # a _deliver is queued on the event loop and has not started
        self._events: Optional[asyncio.AbstractEventLoop] = None
        # Called once, from the engine thread, when it fails: the server stops (run_server
        # exits 1, as an engine whose GPU work died cannot be served from again).
        self.on_failure: Optional[Callable[[], None]] = None
        # The engine thread's CUDA device, fixed here: "cuda" without an index means the device
        # current on the thread that built the engine, which a new thread does not inherit.
        device = loop.engine.device if loop.engine.on_gpu else None
        self._cuda_index = None if device is None else (
            device.index if device.index is not None else torch.cuda.current_device())
        self._thread = threading.Thread(target=self._main, name="graphrelay-engine", daemon=True)

    # ---- asyncio side -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will `submit`."""
        self._events = asyncio.get_running_loop()
        self._thread.start()

    def submit(self, request: Request) -> asyncio.Queue:
        """Queue `request` (already validated); its events arrive on the returned queue."""
        if self.failure is not None or not self._thread.is_alive():
            raise EngineStopped("the engine is not running" + (f": {self.failure!r}" if self.failure else ""))
        if self._outstanding >= self.capacity:
            raise Overloaded(f"{self._outstanding} requests are running or waiting, the most this server holds")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request.id] = queue
        self._outstanding += 1
        self.inbox.submit(request)
        return queue

    def abort(self, request_id: str) -> None:
        self.inbox.abort(request_id)

    async def stop(self) -> None:
        """Admit nothing more, let the engine finish what it holds, wait for its thread."""
        self.inbox.close()
        await asyncio.to_thread(self._thread.join)

    def health(self) -> dict:
        """The loop's slots are the relay's rows and the KV cache's ranges both (the block table
        maps each slot to its own range): `free_slots == slots` means neither leaked.
        `rss_bytes`: this process's resident memory, for soak runs to watch."""
        return {"engine": "failed" if self.failure else ("running" if self._thread.is_alive() else "stopped"),
                "outstanding": self._outstanding, "capacity": self.capacity, "finished": dict(self._finished),
                **self.serving.occupancy(), "rss_bytes": resident_bytes()}

    def _deliver(self) -> None:
        # Cleared before draining: an event posted from here on either is drained below or
        # queues the next delivery itself; none is left waiting with no delivery to come.
        self._wake_scheduled = False
        batch = [self._batch.popleft() for _ in range(len(self._batch))]
        for request_id, event in batch:
            if isinstance(event, BaseException):
                for queue in self._queues.values():
                    queue.put_nowait(event)
                self._queues.clear()
                continue
            queue = self._queues.get(request_id)
            if isinstance(event, RequestOutput):
                self._queues.pop(request_id, None)
                self._outstanding -= 1
                self._finished[event.finish_reason] = self._finished.get(event.finish_reason, 0) + 1
            if queue is not None:
                queue.put_nowait(event)

    # ---- engine thread (the loop's Sink) ------------------------------------------------------

    def _main(self) -> None:
        try:
            if self._cuda_index is not None:
                torch.cuda.set_device(self._cuda_index)
            self.stats = self.serving.serve(self.inbox, self)
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting request and /health
            self.failure = exc
            self._post("", exc)
            print("graphrelay serve: the engine thread failed:", file=sys.stderr)
            traceback.print_exc()
            if self.on_failure is not None:
                self.on_failure()

    def on_tokens(self, request_id: str, tokens: list[int], logprobs: Optional[list[TokenLogprobs]] = None) -> None:
        self._post(request_id, NewTokens(tokens, logprobs))

    def on_finish(self, output: RequestOutput) -> None:
        self._post(output.id, output)

    def _post(self, request_id: str, event: Event) -> None:
        self._batch.append((request_id, event))
        if not self._wake_scheduled:
            self._wake_scheduled = True
            self._events.call_soon_threadsafe(self._deliver)
