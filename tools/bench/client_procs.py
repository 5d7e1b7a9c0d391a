"""Client processes for a load generator: one share of the requests each, one start instant.

A share runs `send(*head, jobs, timeout_s, wait_start)` in a spawned process (the parent may
hold CUDA and threads, which fork would copy half-alive). Each process builds its client, says
"ready", and blocks in `wait_start` until the parent hands every process the same start
instant; then it keeps its requests' schedule from there and reports its result. A process
that raises reports its traceback, one that dies or hangs is found by polling: either way
`ClientFailed`, never a hang.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import time
import traceback
from typing import Callable

READY_TIMEOUT_S = 120.0  # a spawned client imports torch (via graphrelay) before it is ready: seconds on a busy host
START_LEAD_S = 0.25  # the shared start is this far after the last client is ready, so every one is waiting
POLL_S = 0.2  # how often the parent looks for a client process that died without a word
JOIN_S = 10.0  # a client that has reported exits at once: past this it is ended


class ClientFailed(RuntimeError):
    """A client process crashed, or did not report in time: the run has no figures."""


def default_client_procs() -> int:
    """Half the cores (the server may share the host), at least 1, at most 8: one process was
    client-bound at 100 requests/s, and 8 split the default sweep's top finite rate (800) so."""
    return min(8, max(1, (os.cpu_count() or 1) // 2))


def _client_process(index: int, send, head: tuple, jobs: list, timeout_s: float, go, results) -> None:
    """A spawned client: build the client, say "ready", wait for the start instant, send its
    share, report it. Any failure is reported with its traceback rather than left to a hang."""
    def wait_start() -> float:
        results.put(("ready", index))
        return go.get(timeout=READY_TIMEOUT_S)  # the parent gave up if it never comes

    try:
        results.put(("done", index, asyncio.run(send(*head, jobs, timeout_s, wait_start))))
    except BaseException:  # whatever it was, the parent must hear of it
        results.put(("failed", index, traceback.format_exc()))


def run_shares(send: Callable, head: tuple, shares: list[list], timeout_s: float, last_arrival: float) -> list:
    """`send(*head, jobs, timeout_s, wait_start)` (a coroutine function at module level: spawn
    pickles it by name) in one spawned process per share; each one's result, in share order."""
    context = multiprocessing.get_context("spawn")  # no fork: the parent may hold CUDA and threads
    go, results = context.Queue(), context.Queue()
    processes = [context.Process(target=_client_process, args=(k, send, head, jobs, timeout_s, go, results),
                                 name=f"bench-serve-client-{k}", daemon=True) for k, jobs in enumerate(shares)]
    try:
        for process in processes:
            process.start()
        _gather(processes, results, "ready", READY_TIMEOUT_S)
        # On Linux time.perf_counter() (like time.monotonic()) is CLOCK_MONOTONIC: one clock for
        # the whole system, so an instant read here means the same instant in every child.
        start = time.perf_counter() + START_LEAD_S
        for _ in processes:
            go.put(start)
        # Every request is due by last_arrival and then gives up after timeout_s of silence; a
        # live client that has not reported by then (plus a margin) counts as hung.
        done = _gather(processes, results, "done", START_LEAD_S + last_arrival + timeout_s + JOIN_S)
        return [done[k][2] for k in range(len(processes))]
    except BaseException:  # the others would wait out their own timeouts: end them now
        for process in processes:
            if process.is_alive():
                process.terminate()
        raise
    finally:  # every result was read (or the run failed): no child is left blocked on a full pipe
        for process in (p for p in processes if p.pid is not None):
            process.join(timeout=JOIN_S)
            if process.is_alive():
                process.terminate()
                process.join(timeout=JOIN_S)


def _gather(processes: list, results, kind: str, within_s: float) -> dict[int, tuple]:
    """Each process's `kind` message, by index. Raises `ClientFailed` for a failure a child
    reports, a child that exits without reporting, or none of that within `within_s`."""
    got: dict[int, tuple] = {}
    deadline = time.monotonic() + within_s
    while len(got) < len(processes):
        try:
            message = results.get(timeout=POLL_S)
        except queue.Empty:
            silent = [k for k, p in enumerate(processes) if k not in got and not p.is_alive()]
            if silent and not _drained(results, got, kind):  # not a message put just before it exited
                raise ClientFailed(f"bench serve client process {silent[0]} exited (status "
                                   f"{processes[silent[0]].exitcode}) before it reported {kind}") from None
            if not silent and time.monotonic() > deadline:
                missing = sorted(set(range(len(processes))) - set(got))
                raise ClientFailed(f"bench serve client processes {missing} did not report {kind} "
                                   f"within {within_s:.0f} s") from None
            continue
        _take(message, got, kind)
    return got


def _drained(results, got: dict, kind: str) -> bool:
    """One more look at the queue: a child may put its message and exit between two looks."""
    try:
        _take(results.get(timeout=POLL_S), got, kind)
        return True
    except queue.Empty:
        return False


def _take(message: tuple, got: dict, kind: str) -> None:
    if message[0] == "failed":
        raise ClientFailed(f"bench serve client process {message[1]} failed:\n{message[2]}")
    assert message[0] == kind, f"a client process said {message[0]!r} when {kind!r} was due"
    got[message[1]] = message
