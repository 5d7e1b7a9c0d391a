"""`graphrelay bench loop`: the serving loop end to end, in every mode, side by side.

For each model preset it builds one engine, serves the same seeded closed-loop workload in
`eager` (no graphs, overlap schedule), `no-overlap` (graphs, the CPU waits for every
iteration) and `overlap` (graphs, the CPU schedules N+1 while the GPU runs N), and reports
tokens/s, iteration time (mean, p99), CPU scheduling time and GPU step time per iteration,
the GPU's idle fraction and host syncs per iteration. The overlap loop's ceiling is
max(CPU, GPU) per iteration; the target is to land within 5% of it with zero host syncs.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import msgspec

from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.serving.loop import ServingLoop
from graphrelay.capture.model.model import MODEL_PRESETS, ModelConfig
from graphrelay.capture.serving.workloads import SyntheticWorkload
from graphrelay.tools.bench import options, plots, results
from graphrelay.tools.bench import tp as tp_bench

COMMAND = "graphrelay bench loop"
JSON_NAME = "loop_bench.json"
PLOT_NAME = "loop_bench.png"
MODES = ("eager", "no-overlap", "overlap")  # eager first: it runs before the graphs are captured

# Per preset: engine sizes and workload. Output lengths keep the batch full for most of the run.
FULL = {
    "tiny": dict(max_reqs=64, max_batch=32, requests=128, prompt_len=(8, 64), output_len=(64, 160)),
    "small": dict(max_reqs=64, max_batch=32, requests=96, prompt_len=(64, 256), output_len=(64, 160)),
}
SMOKE = {"tiny": dict(max_reqs=8, max_batch=4, requests=6, prompt_len=(2, 6), output_len=(2, 6))}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=None, help=f"comma-separated presets (default {','.join(FULL)}; "
                        f"choices {','.join(sorted(MODEL_PRESETS))})")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--tp", type=options.int_list, default=None, metavar="SIZES",
                        help=f"tensor-parallel sizes, e.g. 1,2: the overlap loop at each size side by side "
                             f"(default model {tp_bench.DEFAULT_MODEL}; one process per GPU) into {tp_bench.JSON_NAME}")
    options.add_output_options(parser, "a tiny run of every mode (works on CPU, without graphs): checks the code paths")
    return parser


def main(argv: list[str]) -> int:
    args = options.parse(build_parser(), argv)
    if isinstance(args, int):
        return args
    try:
        device = options.pick_device(args.smoke, COMMAND)
        plan = SMOKE if args.smoke else FULL
        models = args.models.split(",") if args.models else list(plan)
        if args.tp and not args.models:
            models = ["tiny"] if args.smoke else [tp_bench.DEFAULT_MODEL]
        unknown = [m for m in models if m not in MODEL_PRESETS]
        if unknown:
            raise options.UsageError(f"unknown model preset {unknown[0]!r}; choose from {sorted(MODEL_PRESETS)}")
    except options.UsageError as exc:
        return options.report_usage_error(COMMAND, exc)

    if args.tp:
        return tp_bench.run(models, args.tp, device, args.seed, args.smoke, options.out_dir(args), ["bench", "loop", *argv])
    start = time.perf_counter()
    rows = []
    for name in models:
        sizes = plan.get(name, plan[next(iter(plan))])
        rows.extend(run_model(name, sizes, device, args.seed))
    out = options.out_dir(args)
    env = results.environment(device, ["bench", "loop", *argv])
    targets = loop_targets(rows)
    plot = save_plot(out / PLOT_NAME, rows, env)
    results.write_json(out / JSON_NAME, {
        "benchmark": "loop", "smoke": args.smoke, "environment": env, "plan": {m: plan.get(m) for m in models},
        "rows": rows, "targets": [t.as_dict() for t in targets], "plot": plot.name, "wall_s": time.perf_counter() - start,
    })
    print(f"wrote {out / JSON_NAME} and {plot}")
    for target in targets:
        print(target.line())
    print(format_rows(rows))
    return 0


def run_model(name: str, sizes: dict[str, Any], device, seed: int) -> list[dict[str, Any]]:
    """Serve one workload in every mode on one engine; eager runs before capture."""
    model = ModelConfig.preset(name)
    workload = SyntheticWorkload(
        num_requests=sizes["requests"], prompt_len=sizes["prompt_len"], output_len=sizes["output_len"],
        vocab_size=model.vocab_size, seed=seed,
    ).requests()
    print(f"{COMMAND}: {name}: building the engine", file=sys.stderr, flush=True)
    engine = Engine(EngineConfig(model, max_reqs=sizes["max_reqs"], max_batch=sizes["max_batch"], device=str(device), max_top_k=64))
    rows, capture = [], None
    for mode in MODES:
        if mode != "eager" and capture is None:
            capture = engine.capture()
        print(f"{COMMAND}: {name}: {mode}", file=sys.stderr, flush=True)
        ServingLoop(engine, mode).run(workload[: min(len(workload), 2 * sizes["max_batch"])])  # warm caches
        stats = ServingLoop(engine, mode).run(workload).stats
        row = {"model": name, **msgspec.structs.asdict(stats)}
        row["mode"] = mode  # the schedule; stats.graphs says whether graphs ran
        row["ceiling_us"] = _ceiling_us(stats)
        rows.append(row)
    if capture is not None:
        rows[-1]["capture_s"] = capture.seconds
        rows[-1]["graph_memory_bytes"] = capture.graph_memory_bytes
    return rows


def _ceiling_us(stats) -> float | None:
    """The overlap loop cannot iterate faster than the slower of its CPU side and its GPU side
    (the decode step plus the turn's prefills, which share the stream)."""
    if stats.gpu_busy_us_per_iter is None:
        return None
    return max(stats.cpu_sched_us_per_iter, stats.gpu_busy_us_per_iter)


def loop_targets(rows: list[dict[str, Any]]) -> list[results.Target]:
    targets = []
    for row in rows:
        if row["mode"] != "overlap":
            continue
        ratio = None if row["ceiling_us"] is None else row["iter_ms_mean"] * 1e3 / row["ceiling_us"]
        targets.append(results.Target(f"{row['model']}: overlap iteration / max(CPU, GPU)", 1.05, "x", True, ratio))
        targets.append(results.Target(f"{row['model']}: host syncs per iteration (overlap)", 0.0, "", True, row["host_syncs_per_iter"]))
    return targets


def format_rows(rows: list[dict[str, Any]]) -> str:
    def num(value, fmt):
        return "n/a" if value is None else format(value, fmt)

    headers = ["model / mode", "tok/s", "iter ms", "p99 ms", "CPU us", "GPU step us", "GPU busy us", "ceiling us",
               "GPU idle", "syncs/it"]
    body = [
        [f"{r['model']} {r['mode']}", num(r["tokens_per_s"], ",.0f"), num(r["iter_ms_mean"], ".3f"),
         num(r["iter_ms_p99"], ".3f"), num(r["cpu_sched_us_per_iter"], ".0f"), num(r["gpu_step_us_per_iter"], ".0f"),
         num(r["gpu_busy_us_per_iter"], ".0f"), num(r["ceiling_us"], ".0f"), "n/a" if r["gpu_idle_fraction"] is None else f"{100 * r['gpu_idle_fraction']:.1f}%",
         num(r["host_syncs_per_iter"], ".2f")]
        for r in rows
    ]
    return "serving loop, same workload per model\n" + results.format_table(headers, body)


# (label, row -> µs per iteration or None): what one decode iteration costs, by where it goes.
PLOT_METRICS = (
    ("iteration (host, mean)", lambda r: r["iter_ms_mean"] * 1e3),
    ("CPU scheduling", lambda r: r["cpu_sched_us_per_iter"]),
    ("GPU step (decode)", lambda r: r["gpu_step_us_per_iter"]),
    ("GPU busy (decode + prefills)", lambda r: r["gpu_busy_us_per_iter"]),
)


def plot_panels(rows: list[dict[str, Any]]) -> list[plots.BarPanel]:
    """One panel per model: a group of bars per mode, one bar per metric. GPU metrics are
    left out where no mode measured them (CPU runs)."""
    panels = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        series = [plots.Bars(label, [value(r) for r in mine]) for label, value in PLOT_METRICS]
        panels.append(plots.BarPanel(f"{model}: µs per iteration, by mode", "mode", "µs per iteration",
                                     [r["mode"] for r in mine],
                                     [s for s in series if any(v is not None for v in s.values)]))
    return panels


def save_plot(path, rows: list[dict[str, Any]], env: dict[str, Any]):
    return plots.save_panels(path, plot_panels(rows), f"serving loop on {env['device']}")
