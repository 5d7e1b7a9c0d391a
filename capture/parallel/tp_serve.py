"""One rank of a tensor-parallel serving run (what `graphrelay serve --tp N` runs per process).

Every rank builds the same `Engine` over its shard of the model and captures the same graphs
(NCCL all-reduces inside). Rank 0 runs the `ServingLoop` (`serve_rank`: one workload;
`lead_rank`: any function of the engine, e.g. `bench serve`'s sweep of rates): it schedules,
reads its host mirror, and its engine hands every prefill and decode iteration to the other
ranks over the CPU control group; the others `follow`. Rank 0 always releases the followers,
also when the loop fails (then they return at once), so no rank is left waiting. At the end
rank 0 gathers from every rank the host syncs torch counted and its relay's contents, which
must be identical on every rank."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import msgspec
import torch
import torch.distributed as dist

from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.iteration.graph_runner import CaptureReport
from graphrelay.capture.serving.loop import LoopResult, ServingLoop
from graphrelay.capture.model.memory_plan import check_fits
from graphrelay.capture.model.model import ModelWeights
from graphrelay.capture.parallel.tensor_parallel import TensorParallel
from graphrelay.capture.serving.workloads import Request


class RankState(msgspec.Struct, frozen=True):
    """What one rank reports after a run."""

    rank: int
    host_syncs: int  # torch's synchronizing ops during the run (rank 0: as its loop counted them)
    relay: dict[str, list]  # the relay's buffers, per field, slot by slot


class TPServeResult(msgspec.Struct, frozen=True):
    result: Any  # rank 0's lead's result (serve_rank: its LoopResult)
    capture: CaptureReport  # rank 0's
    ranks: list[RankState]  # every rank, in rank order


def check_ranks(config: EngineConfig, world: int) -> None:
    """Before any rank is spawned: the model splits over `world`, there are `world` GPUs, and
    on the CPU, where every rank takes its share from the same RAM, all of them fit (each rank
    checks only itself, and they check at once, so none would see the others)."""
    plan = config.memory_plan(world)
    device = torch.device(config.device)
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"--tp {world} needs {world} GPUs, this machine has {torch.cuda.device_count()}; lower --tp")
    if device.type == "cpu":
        check_fits(plan, device, ranks=world)


def lead_rank(tp: TensorParallel, config: EngineConfig, lead: Callable[[Engine], tuple[Any, int]],
              weights: Optional[ModelWeights] = None, progress: bool = False) -> Optional[TPServeResult]:
    """Build and capture the engine on this rank (`config.device` is replaced by the rank's
    device); rank 0 calls `lead(engine)` -> (its result, the host syncs its loops counted) while
    the others follow. Rank 0 returns the result, the others None. `lead` must be picklable."""
    config = msgspec.structs.replace(config, device=str(tp.device))
    engine = Engine(config, weights=weights, progress=progress, tp=tp)
    capture = engine.capture()
    result = None
    if tp.leads:
        try:
            result, syncs = lead(engine)
        except BaseException:
            engine.release(failed=True)
            raise
        engine.release()
    else:
        syncs = engine.follow()
        if syncs is None:  # rank 0 failed and reports why; nothing more will come from it
            return None
    state = RankState(tp.rank, syncs, {name: buf.cpu().tolist() for name, buf in engine.relay.buffers.items()})
    states: list = [None] * tp.world if tp.leads else []
    dist.gather_object(state, states if tp.leads else None, dst=0, group=tp.control)
    return TPServeResult(result, capture, states) if tp.leads else None


def serve_rank(tp: TensorParallel, config: EngineConfig, requests: list[Request], mode: str = "overlap",
               aborts: Optional[dict[str, int]] = None, weights: Optional[ModelWeights] = None,
               progress: bool = False, warmup: Optional[list[Request]] = None) -> Optional[TPServeResult]:
    """Serve `requests` on this rank (see `lead_rank`). `warmup`: requests served first, untimed."""
    return lead_rank(tp, config, partial(_serve, requests, mode, aborts, warmup), weights, progress)


def _serve(requests: list[Request], mode: str, aborts: Optional[dict[str, int]], warmup: Optional[list[Request]],
           engine: Engine) -> tuple[LoopResult, int]:
    if warmup:
        ServingLoop(engine, mode).run(warmup)
    result = ServingLoop(engine, mode).run(requests, aborts=aborts)
    return result, result.stats.host_syncs
