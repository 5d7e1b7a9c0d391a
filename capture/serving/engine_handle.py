"""The HTTP server's handle on its engine, wherever the engine runs: what both the engine
thread (`engine_worker`) and the engine process (`engine_process`) give the asyncio side.

Requests go in with `submit` / `abort` (never blocking the event loop). Results come back in
batches: the engine side `_post`s them (from any thread) into a deque, and one
`call_soon_threadsafe` per batch, not per token, fans them out to each request's
`asyncio.Queue`. Admission is bounded here: at most `slots + max_waiting` requests are
outstanding (submitted and not yet reported finished; with N API server processes, each
holds 1/N of that); past that `submit` refuses and the server answers 429, so a burst never
grows memory without bound.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from typing import Callable, NamedTuple, Optional, Union

import msgspec

from graphrelay.capture.iteration.controls.logprobs import TokenLogprobs
from graphrelay.capture.model.model import ModelConfig
from graphrelay.capture.serving.loop import RequestOutput
from graphrelay.capture.serving.loop_stats import LoopStats
from graphrelay.capture.serving.workloads import Request


class NewTokens(NamedTuple):
    tokens: list[int]
    logprobs: Optional[list[TokenLogprobs]]  # one per token when the request asked


# What a request's queue receives: new tokens, its end, or the engine's failure.
Event = Union[NewTokens, RequestOutput, BaseException]


class EngineInfo(msgspec.Struct, frozen=True):
    """What the HTTP side needs to know of an engine it may not touch."""

    model: ModelConfig
    max_reqs: int
    max_top_k: int
    has_controls: bool
    device: str  # the engine's device by name (`GET /health`), e.g. "NVIDIA H100 80GB HBM3", or "cpu"

    @classmethod
    def of(cls, engine) -> "EngineInfo":
        from graphrelay.capture.model.plan_file import device_name  # the engine's side only: it imports Triton

        return cls(engine.model.config, engine.max_reqs, engine.config.max_top_k, engine.controls is not None,
                   device_name(engine.device))


def resident_bytes(pid: str = "self") -> Optional[int]:
    """A process's resident set size from /proc/PID/statm (Linux); None elsewhere."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class Overloaded(Exception):
    """Every slot is busy and the waiting queue is full."""


class EngineStopped(Exception):
    """The engine failed or has shut down: nothing can be served."""


class Rejected(Exception):
    """The engine refused a request's sampling controls (its limits, or a grammar that does
    not compile): the message begins with the field it is about."""


class HeldCount:
    """How many requests a server holds (running or waiting): `take` one under a bound, `give`
    it back. One process's count, for a server of one API server process."""

    def __init__(self) -> None:
        self._held = 0

    @property
    def value(self) -> int:
        return self._held

    def take(self, bound: int) -> bool:
        if self._held >= bound:
            return False
        self._held += 1
        return True

    def give(self) -> None:
        self._held -= 1


class SharedHeldCount(HeldCount):
    """One count in shared memory for every API server process of one port, so that the bound
    is the whole server's wherever the kernel's port spread sends each connection. A bound
    split evenly over the processes refused part of a burst it should have held: 64 streams
    under a bound of 80, four servers holding 20 each, and one of them handed more than 20
    (the H100, 2026-12-06). Made by the first process before it spawns the others, which
    inherit it with their arguments."""

    def __init__(self, context) -> None:
        self._shared = context.Value("i", 0)

    @property
    def value(self) -> int:
        return self._shared.value

    def take(self, bound: int) -> bool:
        with self._shared.get_lock():
            if self._shared.value >= bound:
                return False
            self._shared.value += 1
            return True

    def give(self) -> None:
        with self._shared.get_lock():
            self._shared.value -= 1


class EngineHandle:
    """The asyncio side's bookkeeping: per-request queues, bounded admission, batched delivery.
    Subclasses run the engine and call `on_tokens` / `on_finish` / `_fail` as results arrive."""

    def __init__(self, info: EngineInfo, max_waiting: int, held: Optional[HeldCount] = None):
        """held: the count the bound applies to; with several API server processes, the one
        they share (`SharedHeldCount`), else this handle's own."""
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.info = info
        self.capacity = info.max_reqs + max_waiting  # the whole server's, over every API server process
        self._held = HeldCount() if held is None else held
        self.failure: Optional[BaseException] = None
        self.stats: Optional[LoopStats] = None  # the loop's measurements, once it has returned
        # Called once, from the engine side, when it fails: the server stops (run_server exits
        # 1, as an engine whose GPU work died cannot be served from again).
        self.on_failure: Optional[Callable[[], None]] = None
        self._finished: dict[str, int] = {}  # finish reason -> requests (asyncio thread only)
        self._queues: dict[str, asyncio.Queue] = {}  # asyncio thread only
        # engine -> asyncio: deque appends and pops are atomic, so results are posted without a
        # lock (256 streams: one post each per iteration).
        self._batch: deque[tuple[str, Event]] = deque()
        self._wake_scheduled = False  # a _deliver is queued on the event loop and has not started
        self._events: Optional[asyncio.AbstractEventLoop] = None

    @property
    def controls(self):
        """The engine's sampling controls when they can be checked on this side (None: the
        engine checks them at admission and `admit` raises `Rejected`)."""
        return None

    def _bind(self) -> None:
        self._events = asyncio.get_running_loop()

    def _register(self, request: Request) -> asyncio.Queue:
        if self.failure is not None or not self.running():
            raise EngineStopped("the engine is not running" + (f": {self.failure!r}" if self.failure else ""))
        if not self._held.take(self.capacity):
            raise Overloaded(f"{self.capacity} requests are running or waiting, the most this server holds")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request.id] = queue
        return queue

    def running(self) -> bool:
        raise NotImplementedError

    def occupancy(self) -> dict:
        """The loop's slot and queue counts, and the engine's resident memory."""
        raise NotImplementedError

    async def admit(self, request: Request) -> asyncio.Queue:
        """`submit`, then wait until the engine has accepted the request (raises `Rejected`)."""
        return self.submit(request)

    def submit(self, request: Request) -> asyncio.Queue:
        raise NotImplementedError

    def health(self) -> dict:
        """The loop's slots are the relay's rows and the KV cache's ranges both (the block table
        maps each slot to its own range): `free_slots == slots` means neither leaked.
        `rss_bytes`: the server's resident memory (every process of it), for soak runs; `device`:
        what the engine runs on, so a client's benchmark can name the card it measured."""
        occupancy = dict(self.occupancy())
        # An engine process measures the whole server (itself and every API server process);
        # until it first has, or with the engine in this process, this process's own.
        rss = occupancy.pop("server_rss_bytes", None) or resident_bytes()
        return {"engine": "failed" if self.failure else ("running" if self.running() else "stopped"),
                "outstanding": self._held.value, "capacity": self.capacity, "finished": dict(self._finished),
                **occupancy, "rss_bytes": rss, "device": self.info.device}

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
                self._held.give()
                self._finished[event.finish_reason] = self._finished.get(event.finish_reason, 0) + 1
            if queue is not None:
                queue.put_nowait(event)

    # ---- the engine side (any thread) ------------------------------------------------------------

    def on_tokens(self, request_id: str, tokens: list[int], logprobs: Optional[list[TokenLogprobs]] = None) -> None:
        self._post(request_id, NewTokens(tokens, logprobs))

    def on_finish(self, output: RequestOutput) -> None:
        self._post(output.id, output)

    def _fail(self, exc: BaseException) -> None:
        """The engine died: every waiting request and every later one fails, the server stops."""
        self.failure = exc
        self._post("", exc)
        if self.on_failure is not None:
            self.on_failure()

    def _post(self, request_id: str, event: Event) -> None:
        self._batch.append((request_id, event))
        self._schedule_delivery()

    def _schedule_delivery(self) -> None:
        """From the engine's thread: one `_deliver` queued on the event loop per batch."""
        if not self._wake_scheduled:
            self._wake_scheduled = True
            self._events.call_soon_threadsafe(self._deliver)
