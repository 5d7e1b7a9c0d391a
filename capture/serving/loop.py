"""The overlap-scheduled continuous-batching loop.

Each turn of the loop (mode `overlap`):

    schedule iteration N: every running request's decode span first, then prompt chunks
        (unfinished prompts, then new arrivals) filling the token budget
        -> launch N (one graph replay for all of its tokens)
        -> read older iterations' host mirror (the GPU is busy with N meanwhile)
        -> append tokens, finish requests (stop token / length / abort) -> free slots

A long prompt is cut into chunks over several iterations, so it never stalls the running
decodes, and an arrival never waits for a separate prefill turn. Every sampled token, a
prompt's first one included, reaches the host through the mirror.

Requests come in through an `Inbox` (drained each turn, never blocking a turn that has work)
and results leave through a `Sink` (tokens as they are appended, then the finished output):
`serve` runs until the inbox is closed and everything it admitted has finished; `run` is a
batch of requests through the same path.

`no-overlap` reads iteration N right after launching it (the GPU idles while the CPU
schedules); `eager` is `overlap` without CUDA graphs (the engine decides that). A request
that finished while an iteration was in flight gets that iteration's extra token discarded,
and its slot returns to the free list only after every launched iteration that reads the
slot has been read back (reusing it earlier is the index race SGLang hit).
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from typing import Callable, Optional

import msgspec

from graphrelay.capture.iteration.controls.logprobs import TokenLogprobs
from graphrelay.capture.iteration.engine import Engine
from graphrelay.capture.iteration.spans import Span, decode_span, prefill_span
from graphrelay.capture.serving.inbox import CollectingSink, Inbox, Sink
from graphrelay.capture.serving.loop_stats import IterationClock, LoopStats
from graphrelay.capture.serving.request_checks import check_requests
from graphrelay.capture.serving.sync_count import HostSyncCounter
from graphrelay.capture.serving.workloads import Request

MODES = ("overlap", "no-overlap", "eager")
_IDLE_WAIT_S = 0.05  # longest idle wait for the inbox: bounds how late a future arrival starts


class RequestOutput(msgspec.Struct):
    id: str
    tokens: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    ttft_ms: Optional[float] = None  # arrival to the first token on the host (None if aborted first)
    text: Optional[str] = None  # the decoded completion, when the request came as text
    token_times_ms: list[float] = []  # run time at which each token reached the host (latency benchmarks)
    logprobs: Optional[list[TokenLogprobs]] = None  # per token, when the request asked (top cut to its n)


class LoopResult(msgspec.Struct):
    outputs: dict[str, RequestOutput]
    stats: LoopStats


class _Live:
    """A request holding a slot."""

    __slots__ = ("request", "arrival", "slot", "tokens", "logprobs", "token_times_ms", "sent", "prefilled",
                 "scheduled", "last_launch", "first_token_s", "done", "prompt_len", "max_new_tokens", "stop_tokens",
                 "logprobs_wanted", "decode")

    def __init__(self, request: Request, arrival: float, slot: int):
        self.request = request
        self.arrival = arrival  # run time when it became admissible
        self.slot = slot
        # What every iteration reads of the request, held here: the scheduler visits every
        # running request each iteration and the reader every token, so each attribute chain
        # walked there costs per token (at 256 requests, much of the loop's host time).
        self.prompt_len = len(request.prompt)
        self.max_new_tokens = request.max_new_tokens
        self.stop_tokens = request.stop_tokens
        self.logprobs_wanted = request.controls.logprobs if request.controls is not None else None
        # The same span every decode iteration (spans are immutable): the engine compares a
        # steady batch's spans with the last, and identical objects compare at once.
        self.decode: Span = decode_span(slot, request.sampling)
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.token_times_ms: list[float] = []
        self.sent = 0  # tokens handed to the sink so far
        self.prefilled = 0  # prompt tokens launched in chunks so far
        self.scheduled = 0  # tokens that will exist once launched work lands
        self.last_launch = -1  # last iteration (prefill or decode) that touches this slot
        self.first_token_s: Optional[float] = None  # run time when the first token was read
        self.done: Optional[str] = None

    def prompt_left(self) -> int:
        return self.prompt_len - self.prefilled


class ServingLoop:
    """Runs requests to completion on an `Engine` (capture it first for graph modes)."""

    def __init__(self, engine: Engine, mode: str = "overlap"):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        self.engine = engine
        self.mode = mode
        self._run: Optional[_Run] = None  # the current (or last) `serve`, for `occupancy`

    def check_requests(self, requests: list[Request]) -> None:
        """Reject requests the engine cannot hold, naming the request and the limit."""
        check_requests(requests, self.engine.config)
        for r in requests:
            if r.controls is not None and self.engine.controls is None:
                raise ValueError(f"request {r.id!r} has sampling controls; build the engine with EngineConfig.controls")
            if r.controls is not None:
                try:
                    self.engine.controls.check(r.controls, r.stop_tokens)
                except ValueError as e:
                    raise ValueError(f"request {r.id!r}: {e}") from None

    def run(
        self,
        requests: list[Request],
        *,
        aborts: Optional[dict[str, int]] = None,
        progress: Optional[Callable[[dict], None]] = None,
    ) -> LoopResult:
        """Serve `requests`; `aborts` maps a request id to the number of iterations launched
        when it is aborted (for tests and demos); `progress` gets a status
        dict about twice a second."""
        self.check_requests(requests)
        sink = CollectingSink()
        stats = self.serve(Inbox.of(requests), sink, aborts=aborts, progress=progress)
        return LoopResult(outputs=sink.outputs, stats=stats)

    def serve(
        self,
        inbox: Inbox,
        sink: Sink,
        *,
        aborts: Optional[dict[str, int]] = None,
        progress: Optional[Callable[[dict], None]] = None,
    ) -> LoopStats:
        """Serve what `inbox` brings until it is closed and all of it has finished, reporting
        to `sink` from this thread. Requests must pass `check_requests` before they are
        submitted (the loop does not check them again) and carry unique ids."""
        run = _Run(self.engine, self.mode, inbox, sink, aborts or {}, progress)
        self._run = run
        with self.engine.activate(), HostSyncCounter(self.engine.on_gpu) as syncs:
            run.serve()
        accepted = run.decode_tokens / run.request_steps if run.request_steps else 0.0
        return run.clock.stats(self.mode, self.engine.uses_graphs, run.admitted, run.tokens, syncs.count, accepted)

    def occupancy(self) -> dict[str, int]:
        """Slots and queues of the running (or last) `serve`, for health checks from any
        thread: counts only, read without locking, so exact only while the loop idles."""
        run = self._run
        if run is None:
            return {"slots": self.engine.max_reqs, "free_slots": self.engine.max_reqs, "running": 0, "retiring": 0, "waiting": 0}
        return {"slots": self.engine.max_reqs, "free_slots": len(run.free), "running": len(run.live),
                "retiring": len(run.retiring), "waiting": len(run.pending)}


class _Run:
    """The state of one `ServingLoop.run`."""

    def __init__(self, engine: Engine, mode: str, inbox: Inbox, sink: Sink, aborts: dict[str, int], progress):
        self.engine = engine
        self.overlap = mode != "no-overlap"
        self.inbox, self.sink = inbox, sink
        self.closed = False
        self.pending: list[tuple[float, Request]] = []  # (arrival, request), by arrival then submission
        self.aborts = dict(aborts)
        self.progress = progress
        self.free = list(range(engine.max_reqs, 0, -1))  # pop() hands out slot 1 first
        self.retiring: list[tuple[int, int]] = []  # (slot, last iteration that reads it)
        self.live: dict[int, _Live] = {}  # slot -> request
        self.order: list[int] = []  # live slots in admission order (FIFO batching)
        self.inflight: deque[int] = deque()
        self.completed = -1  # every iteration <= this has been read back
        self.admitted = 0  # requests taken from the inbox
        self.finished = 0
        self.tokens = 0  # tokens appended over the run
        self.clock = IterationClock(engine.stream)
        self.decode_slots: dict[int, set[int]] = {}  # iteration in flight -> slots it decodes
        self.request_steps = 0  # (request, decode iteration) pairs read back
        self.decode_tokens = 0  # tokens those produced (more than one each with speculation)

    def serve(self) -> None:
        self.clock.begin()
        self._take_inbox()
        while not self.closed or self.pending or self.live or self.inflight:
            self.clock.turn_start()
            self._apply_aborts(self._take_inbox())
            launched = self._launch()
            keep = 1 if (self.overlap and launched) else 0
            while len(self.inflight) > keep:
                self._process(self.inflight.popleft())
            if not (launched or self.inflight):
                self._idle()
            self._release_slots()
            self.clock.turn_end(launched)
            if self.progress is not None:
                self.clock.report(self.progress, len(self.live), self.finished, len(self.pending))
        self.clock.finish()

    def _take_inbox(self) -> list[str]:
        """Queue what was submitted (a request arriving now is admissible now; a batch run's
        `arrival` is kept) and return the ids to abort."""
        drained = self.inbox.drain()
        now = self.clock.elapsed()
        for request in drained.requests:
            arrival = max(request.arrival, now)
            bisect.insort(self.pending, (arrival, request), key=lambda item: item[0])
        self.admitted += len(drained.requests)
        self.closed = drained.closed
        return drained.aborts

    # ---- scheduling -----------------------------------------------------------------------

    def _schedule(self) -> tuple[list[Span], int]:
        """One iteration's spans: every running request's decode span first (FIFO), then
        prompt chunks filling the token budget: unfinished prompts first, then new arrivals.
        Returns the spans and how many are decode spans."""
        engine = self.engine
        spans: list[Span] = []
        prompts: list[_Live] = []  # unfinished prompts, in admission order
        max_batch = engine.max_batch
        for slot in self.order:  # one pass: it runs every iteration over every running request
            live = self.live[slot]
            if live.prefilled < live.prompt_len:
                prompts.append(live)
            # Its prompt's last chunk is launched (it samples token 1), so decode may follow it in
            # the next iteration at once: the token is resolved on the device.
            elif len(spans) < max_batch and live.done is None and live.scheduled < live.max_new_tokens:
                spans.append(live.decode)
                live.scheduled += 1  # at least one: speculation may add more, known an iteration late
        decodes = len(spans)
        budget = engine.max_tokens - decodes * engine.config.tokens_per_decode
        now = self.clock.elapsed()
        while budget > 0 and len(spans) < engine.max_batch:
            if prompts:
                live = prompts.pop(0)
            elif self.pending and self.free and self.pending[0][0] <= now and self._controls_fit(self.pending[0][1]):
                arrival, request = self.pending.pop(0)
                live = _Live(request, arrival, self.free.pop())
                if engine.controls is not None:
                    engine.admit_controls(live.slot, request.controls, request.stop_tokens, request.prompt)
                self.live[live.slot] = live
                self.order.append(live.slot)
            else:
                break
            n = min(budget, live.prompt_left())
            start = live.prefilled
            live.prefilled += n
            budget -= n
            last = live.prompt_left() == 0
            live.scheduled += int(last)
            spans.append(prefill_span(live.slot, live.request.sampling, live.request.prompt[start: start + n], start, last))
        return spans, decodes

    def _controls_fit(self, request: Request) -> bool:
        """A request whose grammar does not fit the pool beside those in use waits (FIFO) for
        one to finish; alone it always fits (checked before serving)."""
        controls = self.engine.controls
        return controls is None or controls.can_admit(request.controls)

    def _launch(self) -> bool:
        spans, decodes = self._schedule()
        if not spans:
            return False
        self.clock.launch_start()
        iteration = self.engine.launch(spans, before_replay=self.clock.replay_start)
        self.clock.launch_end(iteration)
        for span in spans:
            self.live[span.slot].last_launch = iteration
        self.inflight.append(iteration)
        if decodes:
            self.decode_slots[iteration] = {span.slot for span in spans[:decodes]}
        return True

    # ---- results --------------------------------------------------------------------------

    def _process(self, iteration: int) -> None:
        read = self.engine.read(iteration, block=False)
        if read is None:
            read = self.clock.wait(lambda: self.engine.read(iteration, block=True))
        self.completed = iteration
        self.clock.iteration_done(iteration)
        # The raw rows as lists, stale ones skipped in the same pass (`read.fresh()` would select
        # each field with a torch op: at 256 rows more host time than the pass itself).
        slots, tokens, stale = read.slots.tolist(), read.tokens.tolist(), read.stale.tolist()
        fresh_slots = [slot for slot, old in zip(slots, stale) if not old]
        decoded = self.decode_slots.pop(iteration, set())
        self.request_steps += len(decoded.intersection(fresh_slots))
        self.decode_tokens += sum(map(decoded.__contains__, fresh_slots))
        now = self.clock.elapsed()  # the read's instant: every token it carries arrived then
        logprobs = self.engine.read_logprobs(read) or itertools.repeat(None)
        touched: dict[int, _Live] = {}
        finished: list[RequestOutput] = []
        for slot, token, lp, old in zip(slots, tokens, logprobs, stale):
            if old:
                continue  # the slot went to a newer request after this iteration ran
            live = self.live.get(slot)
            if live is None or live.done is not None:
                continue  # the request finished while this iteration was in flight: discard
            touched[slot] = live
            output = self._append(live, token, lp, now)
            if output is not None:
                finished.append(output)
        # Tokens first, then the finishes: a request's last tokens reach the sink before its end.
        for live in touched.values():
            # live.logprobs stays empty unless the request asked: then None is passed.
            self.sink.on_tokens(live.request.id, live.tokens[live.sent:], live.logprobs[live.sent:] or None)
            live.sent = len(live.tokens)
        for output in finished:
            self.sink.on_finish(output)

    def _append(self, live: _Live, token: int, logprobs: Optional[TokenLogprobs], now: float) -> Optional[RequestOutput]:
        if not live.tokens:
            live.first_token_s = now
        live.tokens.append(token)
        live.token_times_ms.append(now * 1e3)
        self.tokens += 1
        wanted = live.logprobs_wanted
        # Only a request that asked has its rows' logprobs (admission flagged its slot): the
        # other rows read None, their logprobs not computed.
        if wanted is not None:
            live.logprobs.append(TokenLogprobs(logprobs.logprob, logprobs.top[:wanted]))
        if token in live.stop_tokens:
            return self._finish(live, "stop")
        if len(live.tokens) >= live.max_new_tokens:
            return self._finish(live, "length")
        return None

    def _finish(self, live: _Live, reason: str) -> RequestOutput:
        live.done = reason
        ttft = None if live.first_token_s is None else (live.first_token_s - live.arrival) * 1e3
        del self.live[live.slot]
        self.order.remove(live.slot)
        self.retiring.append((live.slot, live.last_launch))
        self.finished += 1
        if self.engine.controls is not None:
            self.engine.controls.release(live.slot)
        wanted = live.logprobs_wanted is not None
        return RequestOutput(live.request.id, list(live.tokens), reason, ttft_ms=ttft,
                             token_times_ms=live.token_times_ms, logprobs=list(live.logprobs) if wanted else None)

    def _release_slots(self) -> None:
        keep = []
        for slot, last in self.retiring:
            if last <= self.completed:
                self.free.append(slot)
            else:
                keep.append((slot, last))
        self.retiring = keep

    def _apply_aborts(self, asked: list[str]) -> None:
        """Abort the inbox's `asked` ids and the scheduled aborts that are due. A running
        request's slot retires by the usual rule (after every iteration that reads it)."""
        due = [rid for rid, at in self.aborts.items() if at <= self.engine.iterations_launched]
        for rid in due:
            del self.aborts[rid]
        for rid in asked + due:
            live = next((l for l in self.live.values() if l.request.id == rid), None)
            if live is not None:
                self.sink.on_finish(self._finish(live, "abort"))
                continue
            queued = next((item for item in self.pending if item[1].id == rid), None)
            if queued is not None:
                self.pending.remove(queued)
                self.finished += 1
                self.sink.on_finish(RequestOutput(rid, [], "abort"))

    def _idle(self) -> None:
        """Nothing launched and nothing in flight: wait for the inbox, or the next arrival."""
        wait = _IDLE_WAIT_S
        if self.pending:
            wait = min(wait, self.pending[0][0] - self.clock.elapsed())
        if wait > 0:
            self.inbox.wait(wait)
