"""A real `graphrelay serve --port` process for the HTTP tests (CPU and GPU): started on a free
127.0.0.1 port, ready once /health answers, and its slot and queue counters."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest


# `graphrelay serve --port` flags for each place the engine can run (ids: the flags).
ENGINE_PLACEMENTS = [pytest.param([], id="engine-process"),  # the default
                     pytest.param(["--engine-placement", "thread"], id="engine-thread")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], timeout_s: float) -> subprocess.Popen:
    """`graphrelay serve --port P ARGS`; the process gets `.url`. Fails the test with the
    server's output when it exits or does not come up within `timeout_s`."""
    port = free_port()
    cmd = [sys.executable, "-m", "graphrelay.tools.cli", "serve", "--port", str(port), "--quiet", *args]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ))
    process.url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{process.stdout.read().decode()}")
        try:
            if httpx.get(f"{process.url}/health", timeout=5).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the server did not come up in {timeout_s} s:\n{process.stdout.read().decode()}")
        time.sleep(0.5)


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=30).json()


def wait_until_idle(server, timeout_s: float = 120) -> dict:
    """Every request finished and every slot back on the free list (no leaks)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = health(server)
        if state["outstanding"] == 0 and state["free_slots"] == state["slots"] and state["running"] == 0 \
                and state["retiring"] == 0 and state["waiting"] == 0:
            return state
        assert time.monotonic() < deadline, f"slots or requests leaked: {state}"
        time.sleep(0.1)
