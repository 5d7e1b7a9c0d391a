"""Where an iteration's GPU time goes, kernel by kernel: torch's profiler over graph replays.

A captured iteration is one graph launch to the host, so host-side timers see only its total;
CUPTI still reports each kernel the graph runs. `profile_kernels` records `iterations` calls of
a launch function and `breakdown` folds the records into one row per kernel name: calls, GPU
µs per iteration, and the µs each adds to the iteration. Under programmatic dependent launch a
kernel starts while its predecessor finishes, so the per-kernel durations overlap and their sum
exceeds the iteration's wall time; what a kernel adds is its end minus the latest end before it
(all of it when nothing before it still runs), and those sum to the time the device was busy.
That is the figure to read for what bounds the iteration: a kernel that mostly waits inside its
predecessor's tail has a long duration and adds little. The kernel count per iteration is
exact. On a CPU the profiler records the ops that ran instead (the `--smoke` path).
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
    events = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
              if e.device_type == wanted and (cuda or e.cpu_parent is None)]
    return breakdown(events, iterations)


def breakdown(events: Iterable[tuple[str, float, float]], iterations: int) -> dict[str, Any]:
    """(name, start µs, end µs) records of `iterations` iterations, in any order -> per-iteration
    totals and one row per name, the one adding the most first (module docstring)."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    spans: dict[str, list[float]] = {}
    adds: dict[str, float] = {}
    covered = float("-inf")  # the latest end so far: the device is busy up to here
    for name, start, end in sorted(events, key=lambda e: (e[1], e[2])):
        start, end = float(start), float(end)
        spans.setdefault(name, []).append(end - start)
        adds[name] = adds.get(name, 0.0) + max(0.0, end - max(start, covered))
        covered = max(covered, end)
    rows = [{"name": name[:NAME_CHARS], "calls_per_iteration": len(us) / iterations,
             "us_each": sum(us) / len(us), "us_per_iteration": sum(us) / iterations,
             "adds_us_per_iteration": adds[name] / iterations}
            for name, us in spans.items()]
    rows.sort(key=lambda r: (-r["adds_us_per_iteration"], -r["us_per_iteration"]))
    return {"kernels_per_iteration": sum(r["calls_per_iteration"] for r in rows),
            "gpu_us_per_iteration": sum(r["us_per_iteration"] for r in rows),
            "busy_us_per_iteration": sum(r["adds_us_per_iteration"] for r in rows), "kernels": rows}


def format_breakdown(shape: str, profile_row: dict[str, Any], top: int = 8) -> str:
    lines = [f"{shape}: {profile_row['kernels_per_iteration']:.0f} kernels, "
             f"{profile_row['gpu_us_per_iteration']:.1f} us of kernel time, "
             f"{profile_row['busy_us_per_iteration']:.1f} us busy per iteration (adds: past the kernels before)"]
    for r in profile_row["kernels"][:top]:
        lines.append(f"  {r['calls_per_iteration']:6.1f} x {r['us_each']:7.2f} us = {r['us_per_iteration']:8.1f} us, "
                     f"adds {r['adds_us_per_iteration']:8.1f} us  {r['name']}")
    return "\n".join(lines)
