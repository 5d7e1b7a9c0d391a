"""A measured projection plan kept in a file, so that a restarted server, or a second process
of the same shape, launches the same kernels as the first.

`LinearPlan.measured` times the backends and tilings at start-up. Where two of them run within
noise of each other, another start may keep the other one, and with it another order of
float32 sums: bf16 greedy text can then differ between two starts of one server (a bf16
near-tie flips). A plan file pins the choice: `Engine.capture(plan_file=PATH)` (`serve
--kernel-plan PATH`) reads it when it exists, else measures and writes it there. The file
names the GPU, the model shape and the row counts it was measured for; one from another GPU,
model or bucket set is an error that says so, never a silent re-measure.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import msgspec
import torch

from graphrelay.capture.files import write_atomically
from graphrelay.capture.kernels import gemv_tiles
from graphrelay.capture.model.linear_plan import LinearPlan, model_shape, shared_memory_bytes, tiles_fit

if TYPE_CHECKING:
    from graphrelay.capture.model.model import LlamaModel


class PlanRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A plan on disk and what it was measured for."""

    gpu: str
    shape: dict[str, int | str]
    rows: list[int]  # the row counts measured (the engine's token buckets a skinny GEMM may take)
    default: str
    choices: dict[int, dict[str, str]]
    tiles: dict[int, dict[str, gemv_tiles.Tiles]] = msgspec.field(default_factory=dict)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def load_or_measure(path: Path, model: "LlamaModel", rows: Sequence[int], *,
                    stream: torch.cuda.Stream | None = None) -> LinearPlan:
    """The plan in `path` when the file exists (checked against this GPU, model and rows),
    else `LinearPlan.measured`, written to `path` first."""
    if path.exists():
        return load_plan(path, model, rows)
    plan = LinearPlan.measured(model, rows, stream=stream)
    record = PlanRecord(gpu=device_name(model.device), shape=model_shape(model), rows=sorted(set(rows)),
                        default=plan.default, choices=plan.choices, tiles=plan.tiles)
    write_atomically(path, msgspec.json.format(msgspec.json.encode(record)))
    return plan


def load_plan(path: Path, model: "LlamaModel", rows: Sequence[int]) -> LinearPlan:
    try:
        record = msgspec.json.decode(path.read_bytes(), type=PlanRecord)
    except OSError as exc:
        raise ValueError(f"kernel plan {path}: cannot read it ({exc.strerror})") from None
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ValueError(f"kernel plan {path} is not a plan file ({exc}); delete it and the next start "
                         f"measures and writes a new one") from None
    ours = {"GPU": device_name(model.device), "model shape": model_shape(model), "row counts": sorted(set(rows))}
    theirs = {"GPU": record.gpu, "model shape": record.shape, "row counts": record.rows}
    for what, value in ours.items():
        if theirs[what] != value:
            raise ValueError(f"kernel plan {path} was measured for {what} {theirs[what]}, this engine has {value}; "
                             f"pass another path (a missing file is measured and written), or delete this one")
    try:
        plan = LinearPlan(record.choices, default=record.default, tiles=record.tiles)
    except ValueError as exc:
        raise ValueError(f"kernel plan {path}: {exc}") from None
    # A file from an older version may name a tiling too deep for this GPU with the residual the step
    # may pass it: refused here, not as a compiler error at capture.
    shared_memory = shared_memory_bytes(model.device)
    for rows_planned, by_projection in plan.tiles.items():
        for projection, tiles in by_projection.items():
            if not tiles_fit(tiles, projection, model.shard.torch_dtype, shared_memory):
                raise ValueError(f"kernel plan {path}: {projection} at {rows_planned} rows in {tiles} needs more "
                                 f"shared memory than this GPU has ({shared_memory} bytes a block); delete the file "
                                 f"and the next start measures and writes a new one")
    return plan
