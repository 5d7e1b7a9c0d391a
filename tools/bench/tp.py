"""`graphrelay bench loop --tp 1,2`: the overlap serving loop at each tensor-parallel size,
side by side, on the same model and seeded workload.

Each size serves the workload once untimed (kernels compile, caches warm) and once timed, with
one CUDA graph per bucket on every rank (NCCL all-reduces inside). Size 1 runs in this process;
larger sizes spawn one process per GPU (`capture.tp_launch`). Reported per size: tokens/s, the
GPU decode step and the host iteration time (rank 0's clock), host syncs on every rank, and
whether every rank's relay ended identical. Written to `tp_bench.json` and `tp_bench.png`.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import msgspec
import torch

from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.serving.loop import ServingLoop
from graphrelay.capture.model.model import ModelConfig
from graphrelay.capture.parallel.tp_launch import run_ranks
from graphrelay.capture.parallel.tp_serve import serve_rank
from graphrelay.capture.serving.workloads import SyntheticWorkload
from graphrelay.tools.bench import plots, results

JSON_NAME = "tp_bench.json"
PLOT_NAME = "tp_bench.png"
DEFAULT_MODEL = "medium"
SIZES = dict(max_reqs=64, max_batch=32, requests=96, prompt_len=(64, 256), output_len=(64, 160))
SMOKE_SIZES = dict(max_reqs=8, max_batch=4, requests=6, prompt_len=(2, 6), output_len=(2, 6))


def run(models: list[str], tp_sizes: list[int], device: torch.device, seed: int, smoke: bool, out, command: list[str]) -> int:
    start = time.perf_counter()
    sizes = SMOKE_SIZES if smoke else SIZES
    gpus = torch.cuda.device_count() if device.type == "cuda" else None
    rows = []
    for name in models:
        model = ModelConfig.preset(name)
        for world in tp_sizes:
            print(f"graphrelay bench loop: {name}, tp {world}", file=sys.stderr, flush=True)
            rows.append(measure(name, model, world, sizes, device, seed, gpus))
    env = results.environment(device, command)
    plot = plots.save_panels(out / PLOT_NAME, plot_panels(rows), f"tensor parallel serving loop on {env['device']}")
    results.write_json(out / JSON_NAME, {
        "benchmark": "tp", "smoke": smoke, "environment": env, "gpus": gpus, "plan": sizes, "rows": rows,
        "plot": plot.name, "wall_s": time.perf_counter() - start,
    })
    print(f"wrote {out / JSON_NAME} and {plot}")
    print(format_rows(rows))
    return 0 if all(r["note"] == "" for r in rows) else 1


def measure(name: str, model: ModelConfig, world: int, sizes: dict[str, Any], device: torch.device, seed: int,
            gpus) -> dict[str, Any]:
    row = {"model": name, "tp": world, "note": ""}
    try:
        model.shard(world)
    except ValueError as exc:
        return {**row, "note": f"skipped: {exc}"}
    if gpus is not None and gpus < world:
        return {**row, "note": f"skipped: needs {world} GPUs, {gpus} present"}
    workload = SyntheticWorkload(num_requests=sizes["requests"], prompt_len=sizes["prompt_len"],
                                 output_len=sizes["output_len"], vocab_size=model.vocab_size, seed=seed).requests()
    warm = workload[: min(len(workload), 2 * sizes["max_batch"])]
    config = EngineConfig(model, max_reqs=sizes["max_reqs"], max_batch=sizes["max_batch"], device=str(device),
                          use_graphs=device.type == "cuda", max_top_k=64)
    if world == 1:
        engine = Engine(config)
        capture = engine.capture()
        ServingLoop(engine, "overlap").run(warm)
        stats = ServingLoop(engine, "overlap").run(workload).stats
        syncs, same = [stats.host_syncs], True
    else:
        out = run_ranks(world, serve_rank, config, workload, "overlap", None, None, False, warm, device_type=device.type)
        stats, capture = out.result.stats, out.capture
        syncs = [r.host_syncs for r in out.ranks]
        same = all(r.relay == out.ranks[0].relay for r in out.ranks)
    return {**row, **msgspec.structs.asdict(stats), "host_syncs_per_rank": syncs, "relays_identical": same,
            "capture_s": capture.seconds, "graph_nodes": capture.nodes.get(max(capture.buckets)) if capture.nodes else None}


def format_rows(rows: list[dict[str, Any]]) -> str:
    def num(row, key, fmt):
        value = row.get(key)
        return "n/a" if value is None else format(value, fmt)

    headers = ["model / tp", "tok/s", "GPU step us (median)", "iter ms (median)", "graph nodes", "host syncs per rank",
               "relays identical", "note"]
    body = [[f"{r['model']} tp{r['tp']}", num(r, "tokens_per_s", ",.0f"), num(r, "gpu_step_us_median", ",.0f"),
             num(r, "iter_ms_median", ".3f"), num(r, "graph_nodes", "d"), str(r.get("host_syncs_per_rank", "n/a")),
             str(r.get("relays_identical", "n/a")), r["note"]] for r in rows]
    return "overlap serving loop by tensor-parallel size, same workload\n" + results.format_table(headers, body)


def plot_panels(rows: list[dict[str, Any]]) -> list[plots.BarPanel]:
    """Per model: tokens/s and the decode step, one bar group per tensor-parallel size."""
    panels = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        labels = [f"tp {r['tp']}" for r in mine]
        panels.append(plots.BarPanel(f"{model}: tokens/s", "tensor-parallel size", "tokens/s", labels,
                                     [plots.Bars("tokens/s", [r.get("tokens_per_s") for r in mine])]))
        panels.append(plots.BarPanel(f"{model}: decode step", "tensor-parallel size", "µs", labels,
                                     [plots.Bars("GPU step (median)", [r.get("gpu_step_us_median") for r in mine])]))
    return panels
