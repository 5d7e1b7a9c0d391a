"""Where an iteration's GPU time goes, kernel by kernel: torch's profiler over graph replays.

A captured iteration is one graph launch to the host, so host-side timers see only its total;
CUPTI still reports each kernel the graph runs. `profile_kernels` records `iterations` calls of
a launch function and `breakdown` folds the records into one row per kernel name: calls and GPU
µs per iteration. Under programmatic dependent launch a kernel's recorded span starts while its
predecessor finishes, so the per-kernel sums can exceed the iteration's wall time; the kernel
count per iteration is exact. On a CPU the profiler records the ops that ran instead (the
`--smoke` path).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

# Kernel names are C++ template spellings on cuBLAS / ATen kernels: cut for a readable table.
NAME_CHARS = 90


def profile_kernels(run: Callable[[], None], iterations: int, device: torch.device) -> dict[str, Any]:
    """Run `run` (one iteration, ending synchronized) `iterations` times under the profiler and
    return `breakdown` of what the device ran."""
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        for _ in range(iterations):
            run()
    wanted = DeviceType.CUDA if cuda else DeviceType.CPU
    events = [(e.name, e.time_range.elapsed_us()) for e in prof.events()
              if e.device_type == wanted and (cuda or e.cpu_parent is None)]
    return breakdown(events, iterations)


def breakdown(events: Iterable[tuple[str, float]], iterations: int) -> dict[str, Any]:
    """(name, µs) records of `iterations` iterations -> per-iteration totals and one row per
    name, the largest share first."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    by_name: dict[str, list[float]] = {}
    for name, us in events:
        by_name.setdefault(name, []).append(float(us))
    rows = [{"name": name[:NAME_CHARS], "calls_per_iteration": len(spans) / iterations,
             "us_each": sum(spans) / len(spans), "us_per_iteration": sum(spans) / iterations}
            for name, spans in by_name.items()]
    rows.sort(key=lambda r: -r["us_per_iteration"])
    return {"kernels_per_iteration": sum(r["calls_per_iteration"] for r in rows),
            "gpu_us_per_iteration": sum(r["us_per_iteration"] for r in rows), "kernels": rows}


def format_breakdown(shape: str, profile_row: dict[str, Any], top: int = 8) -> str:
    lines = [f"{shape}: {profile_row['kernels_per_iteration']:.0f} kernels, "
             f"{profile_row['gpu_us_per_iteration']:.1f} us of kernel time per iteration"]
    for r in profile_row["kernels"][:top]:
        lines.append(f"  {r['calls_per_iteration']:6.1f} x {r['us_each']:7.2f} us = {r['us_per_iteration']:8.1f} us  "
                     f"{r['name']}")
    return "\n".join(lines)
