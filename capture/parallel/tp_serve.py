"""One rank of a tensor-parallel serving run (what `graphrelay serve --tp N` runs per process).

Every rank builds the same `Engine` over its shard of the model and captures the same graphs
(NCCL all-reduces inside). Rank 0 runs the `ServingLoop`: it schedules, reads its host
mirror, and its engine hands every prefill and decode iteration to the other ranks over the
CPU control group; the others `follow`. Rank 0 always releases the followers, also when the
loop fails (then they return at once), so no rank is left waiting. At the end rank 0 gathers from every rank the host
syncs torch counted and its relay's contents, which must be identical on every rank.
"""

from __future__ import annotations

from typing import Optional

import msgspec
import torch.distributed as dist

from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.iteration.graph_runner import CaptureReport
from graphrelay.capture.serving.loop import LoopResult, ServingLoop
from graphrelay.capture.model.model import ModelWeights
from graphrelay.capture.parallel.tensor_parallel import TensorParallel
from graphrelay.capture.serving.workloads import Request


class RankState(msgspec.Struct, frozen=True):
    """What one rank reports after a run."""

    rank: int
    host_syncs: int  # torch's synchronizing ops during the run (rank 0: as its loop counted them)
    relay: dict[str, list]  # the relay's buffers, per field, slot by slot


class TPServeResult(msgspec.Struct, frozen=True):
    result: LoopResult  # rank 0's loop: outputs and stats
    capture: CaptureReport  # rank 0's
    ranks: list[RankState]  # every rank, in rank order


def serve_rank(tp: TensorParallel, config: EngineConfig, requests: list[Request], mode: str = "overlap",
               aborts: Optional[dict[str, int]] = None, weights: Optional[ModelWeights] = None,
               progress: bool = False, warmup: Optional[list[Request]] = None) -> Optional[TPServeResult]:
    """Serve `requests` on this rank (`config.device` is replaced by the rank's device);
    rank 0 returns the result, the others None. `warmup`: requests served first, untimed."""
    config = msgspec.structs.replace(config, device=str(tp.device))
    engine = Engine(config, weights=weights, progress=progress, tp=tp)
    capture = engine.capture()
    result = None
    if tp.leads:
        try:
            if warmup:
                ServingLoop(engine, mode).run(warmup)
            result = ServingLoop(engine, mode).run(requests, aborts=aborts)
        except BaseException:
            engine.release(failed=True)
            raise
        engine.release()
        syncs = result.stats.host_syncs
    else:
        syncs = engine.follow()
        if syncs is None:  # rank 0 failed and reports why; nothing more will come from it
            return None
    state = RankState(tp.rank, syncs, {name: buf.cpu().tolist() for name, buf in engine.relay.buffers.items()})
    states: list = [None] * tp.world if tp.leads else []
    dist.gather_object(state, states if tp.leads else None, dst=0, group=tp.control)
    return TPServeResult(result, capture, states) if tp.leads else None
