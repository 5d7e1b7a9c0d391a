"""How requests reach a running serving loop and how its results leave it.

`Inbox` is the only way in: any thread may `submit`, `abort` or `close`; the loop's thread
`drain`s it once per turn without blocking, and `wait`s on it (briefly) only when it has
nothing else to do. A `Sink` is the only way out: the loop calls it from its own thread as
tokens are appended and as requests finish. The loop never touches anything else shared, so
the same pair can later become the two ends of a pipe to an engine in its own process.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, NamedTuple, Optional, Protocol, Sequence

from graphrelay.capture.serving.workloads import Request

if TYPE_CHECKING:
    from graphrelay.capture.iteration.controls.logprobs import TokenLogprobs
    from graphrelay.capture.serving.loop import RequestOutput


class InboxClosed(RuntimeError):
    """`submit` after `close`: the loop is shutting down and admits nothing new."""


class Drained(NamedTuple):
    requests: list[Request]  # submitted since the last drain, in submission order
    aborts: list[str]  # request ids to abort, after those submissions
    closed: bool  # no submission will ever follow


class Inbox:
    """A thread-safe mailbox of submissions and aborts for one serving loop."""

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._requests: list[Request] = []
        self._aborts: list[str] = []
        self._closed = False

    @classmethod
    def of(cls, requests: Sequence[Request]) -> "Inbox":
        """An inbox holding `requests` and already closed: a batch run."""
        inbox = cls()
        for r in requests:
            inbox.submit(r)
        inbox.close()
        return inbox

    def submit(self, request: Request) -> None:
        with self._changed:
            if self._closed:
                raise InboxClosed(f"request {request.id!r}: the serving loop is shutting down and admits no new requests")
            self._requests.append(request)
            self._changed.notify()

    def abort(self, request_id: str) -> None:
        """Finish `request_id` as soon as the loop sees it; an id that is unknown or already
        finished is ignored (the request may have finished on its own meanwhile)."""
        with self._changed:
            self._aborts.append(request_id)
            self._changed.notify()

    def close(self) -> None:
        """No more submissions; the loop finishes what it holds, then returns. Aborts are
        still taken after closing."""
        with self._changed:
            self._closed = True
            self._changed.notify()

    def drain(self) -> Drained:
        """Everything that arrived since the last drain (never blocks on an empty inbox)."""
        with self._changed:
            out = Drained(self._requests, self._aborts, self._closed)
            self._requests, self._aborts = [], []
            return out

    def wait(self, timeout: float) -> None:
        """Block until something arrives or `timeout` seconds pass (the loop's idle wait)."""
        with self._changed:
            if not (self._requests or self._aborts or self._closed):
                self._changed.wait(timeout)


class Sink(Protocol):
    """Receives a loop's results, on the loop's thread: keep each call short."""

    def on_tokens(self, request_id: str, tokens: list[int], logprobs: Optional[list["TokenLogprobs"]] = None) -> None:
        """New tokens of a running request, in order; called before its `on_finish`.
        `logprobs`: one per token when the request asked for them (else None)."""

    def on_finish(self, output: "RequestOutput") -> None:
        """The request is done (stop, length or abort); no call for it follows."""


class CollectingSink:
    """Keeps every finished request's output (a batch run's result), in finishing order."""

    def __init__(self) -> None:
        self.outputs: dict[str, "RequestOutput"] = {}

    def on_tokens(self, request_id: str, tokens: list[int], logprobs=None) -> None:
        pass  # the output carries every token and its logprobs

    def on_finish(self, output: "RequestOutput") -> None:
        self.outputs[output.id] = output
