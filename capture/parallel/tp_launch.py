"""Start a tensor-parallel job: one process per rank, spawned here rather than by torchrun.

`run_ranks(world, fn, *args, device_type=...)` spawns `world` processes, joins them into the
process groups of `capture.tensor_parallel` (rendezvous on a free localhost port) and calls
`fn(tp, *args)` in each; rank 0's return value comes back. Spawning our own processes keeps
`graphrelay serve --tp 2` one command with the same options as without, and lets the parent
own shutdown:

- a rank that raises ends the job: the parent stops the other ranks (which may be blocked in
  a collective waiting for the failed one) and raises `RankFailed` naming the rank and error;
- Ctrl-C (or any exception in the parent) terminates every rank, then kills what is left;
- on success each rank destroys its process groups before it exits.

`fn` and `args` must be picklable (a module-level function; plain data).
"""

from __future__ import annotations

import socket
from typing import Any, Callable

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from graphrelay.capture.parallel.tensor_parallel import TensorParallel

STOP_GRACE_S = 5.0  # after SIGTERM, how long a rank may take before it is killed
POLL_S = 0.5


class RankFailed(RuntimeError):
    """A rank of a tensor-parallel job raised or died; the other ranks were stopped."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, device_type: str) -> Any:
    """Run `fn(tp, *args)` on `world` ranks (cuda: rank r on GPU r over NCCL; cpu: gloo)."""
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"tensor parallelism runs on cuda or cpu, got {device_type!r}")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    processes = mp.start_processes(_rank_main, args=(world, init_method, device_type, fn, args, results),
                                   nprocs=world, join=False, start_method="spawn")
    reports: list[tuple] = []  # ("result", value) from rank 0, ("error", rank, text) from any
    try:
        while True:
            # Drain as reports arrive: a large result fills the pipe, and its rank cannot exit
            # until it is read.
            while not results.empty():
                reports.append(results.get())
            if processes.join(timeout=POLL_S):
                break
    except (ProcessRaisedException, ProcessExitedException) as exc:  # join() stopped the others
        while not results.empty():
            reports.append(results.get())
        # The first error reported is the cause; later ones are usually ranks that lost a peer.
        errors = [f"rank {r[1]}: {r[2]}" for r in reports if r[0] == "error"]
        raise RankFailed("; then ".join(errors) or f"rank {exc.error_index} died ({exc})") from None
    finally:
        _stop(processes.processes)
    while not results.empty():
        reports.append(results.get())
    return next(r[1] for r in reports if r[0] == "result")


def _rank_main(rank: int, world: int, init_method: str, device_type: str, fn: Callable[..., Any],
               args: tuple, results) -> None:
    try:
        tp = TensorParallel.join(rank, world, init_method, device_type)
        try:
            result = fn(tp, *args)
        finally:
            tp.close()
        if tp.leads:
            results.put(("result", result))
    except BaseException as exc:
        results.put(("error", rank, f"{type(exc).__name__}: {exc}"))
        raise


def _stop(processes) -> None:
    """Terminate every rank still running, then kill the ones that ignore it."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.terminate()
    for p in alive:
        p.join(STOP_GRACE_S)
        if p.is_alive():
            p.kill()
            p.join()
