"""Several API server processes on one port (`graphrelay serve --port P --api-servers N`).

One HTTP process is one core: the H200 measured it, not the engine, bounding the server's
throughput with many concurrent streams (detokenizing, framing and writing every chunk), so
by default there is one per four cores, up to four (`default_count`). With N > 1 the first
process (the one started) spawns N - 1 more. Each binds the same port
with SO_REUSEPORT, so the kernel spreads new connections over them, and talks to the one
engine process over its own pair of pipes (`engine_process.EngineLink`). The engine sends
each request's results to the server that submitted it (`engine_channel`).

The first process supervises: SIGINT or SIGTERM to it is passed on to the others as SIGTERM
(they ignore SIGINT, so a terminal's Ctrl-C, which reaches the whole process group, does not
reach them twice), and each drains its own requests. The engine finishes once every server
has sent `Close`. If another server exits unexpectedly, or the first one goes away, the rest
stop as when the engine fails (exit status 1).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
import time
from typing import Callable, NamedTuple, Optional

from graphrelay.capture.model.text import TextCodec
from graphrelay.capture.serving.engine_handle import HeldCount
from graphrelay.capture.serving.engine_process import EngineLink, ServerPipes
from graphrelay.capture.serving.http_server import ServerOptions, run_server

CORES_PER_SERVER = 4  # cores per API server by default: the rest are the engine process's and the machine's other work
MOST_BY_DEFAULT = 4  # enough for the 256-slot engine's all-at-once load on the H200 host (README)
JOIN_MARGIN_S = 30.0  # beyond the shutdown grace: a server that has not exited by then is killed
START_TIMEOUT_S = 600.0  # a server loads the tokenizer (seconds) and finds the engine ready (already)


def default_count() -> int:
    """API server processes when `--api-servers` is not given: one per CORES_PER_SERVER cores
    this process may run on, at most MOST_BY_DEFAULT, at least 1. On the 16-core H200 host one
    server reached 0.51x the in-process throughput with every stream in flight, four 0.96x."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MOST_BY_DEFAULT, cores // CORES_PER_SERVER))


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) that other processes may bind too (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({exc.strerror}): pick another --port or --host") from None
    sock.set_inheritable(False)
    return sock


class ServerSpec(NamedTuple):
    """What every API server process needs to serve (picklable: it travels to each)."""

    make_codec: Callable[[], TextCodec]  # the tokenizer, loaded in each process
    options: ServerOptions
    held: HeldCount  # the requests every server holds, one count (`EngineProcess.held`)


class Peers:
    """What `run_server` supervises besides its own server: `stop` when it is told to stop,
    `failure` polled while it serves, `join` (exit statuses) after it has stopped."""

    def stop(self) -> None:
        pass

    def failure(self) -> Optional[str]:
        return None

    def join(self) -> list[int]:
        return []


class OtherServers(Peers):
    """The first process's handle on the N - 1 API servers it spawned."""

    def __init__(self, spec: ServerSpec, pipes: list[ServerPipes], start_timeout_s: float = START_TIMEOUT_S):
        """Start them and wait until each serves: the first then serves too, so a client
        that finds it ready finds every one ready, and a stop passed on finds each able to
        take it."""
        context = multiprocessing.get_context("spawn")  # the process holds no CUDA, but its libraries' threads: no fork
        self._ready = [context.Event() for _ in pipes]
        self._processes = [context.Process(target=server_main, args=(spec, index, ends, ready), daemon=True,
                                           name=f"graphrelay-api-{index}")
                           for index, (ends, ready) in enumerate(zip(pipes, self._ready), 1)]
        self._stopping = False
        self._grace_s = spec.options.shutdown_grace_s
        for process, ends in zip(self._processes, pipes):
            process.start()
            for end in ends:  # that server's alone now: its pipes end when it goes
                end.close()
        deadline = time.monotonic() + start_timeout_s
        for process, ready in zip(self._processes, self._ready):
            while not ready.wait(0.2):
                if process.exitcode is not None or time.monotonic() > deadline:
                    self.join()
                    raise RuntimeError(f"API server process {process.name} did not start (exit status "
                                       f"{process.exitcode}); its output above says why")

    def stop(self) -> None:
        """SIGTERM to each, once: a second one could land after its server has returned, where
        the signal's default would kill it (exit status -15)."""
        if self._stopping:
            return
        self._stopping = True
        for process in self._processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)

    def failure(self) -> Optional[str]:
        if self._stopping:
            return None
        gone = next((p for p in self._processes if p.exitcode is not None), None)
        return None if gone is None else f"API server process {gone.name} exited with status {gone.exitcode}"

    def join(self) -> list[int]:
        self.stop()
        for process in self._processes:
            process.join(self._grace_s + JOIN_MARGIN_S)
            if process.exitcode is None:
                process.kill()
                process.join()
        return [process.exitcode for process in self._processes]


class FirstServer(Peers):
    """A spawned server's watch on the first one: once it is gone, nobody supervises."""

    def __init__(self) -> None:
        self._parent = os.getppid()

    def failure(self) -> Optional[str]:
        return None if os.getppid() == self._parent else "the first API server process is gone"


def server_main(spec: ServerSpec, index: int, pipes: ServerPipes, ready) -> None:
    """A spawned API server process's entry point; sets `ready` once it serves and handles
    SIGTERM (earlier, the signal's default would kill it: exit status -15, not 0)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the first process passes a stop on as SIGTERM
    codec = spec.make_codec()
    link = EngineLink(pipes, spec.options.max_waiting, held=spec.held)
    sock = listening_socket(spec.options.host, spec.options.port)
    sys.exit(run_server(link, codec, spec.options, lambda line: None, sockets=[sock], peers=FirstServer(),
                        index=index, on_start=ready.set))
