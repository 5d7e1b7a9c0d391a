"""`graphrelay bench relay`: what one relay iteration costs, against its floor and its peers.

One iteration = resolve + stash + publish for a batch of slots. For each field set (plain
decode; EAGLE) and batch size it times four variants side by side in one run, plus the floor
(tools/bench/floor.py), prints a table last, and writes `relay_bench.json` and
`relay_bench.png` under --out. Targets are reported with their margins, never asserted.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import torch

from graphrelay.config import RelayConfig
from graphrelay.fields import relay_fields
from graphrelay.relay import Relay
from graphrelay.tools.bench import floor, options, plots, results
from graphrelay.tools.bench.baseline import PerFieldRelay
from graphrelay.tools.bench.relay_workload import disagreements, fill_every_row, index_sets, padding_rows, random_inputs, relay_step
from graphrelay.tools.bench.timing import Ceilings, Clock, Sample, measure_ceilings, time_captured, time_eager

COMMAND = "graphrelay bench relay"
JSON_NAME = "relay_bench.json"
PLOT_NAME = "relay_bench.png"
EXIT_DISAGREE = 1

class Variant(NamedTuple):
    column: str  # table header
    label: str  # plot legend
    description: str  # JSON


VARIANTS = {
    "baseline_eager": Variant("pf eager", "per-field eager (SGLang style)",
                              "per-field torch relay (one indexing op per buffer, as SGLang's FutureMap), launched from Python"),
    "baseline_graph": Variant("pf graph", "per-field captured", "the same per-field ops captured in a CUDA graph"),
    "graphrelay_eager": Variant("gr eager", "graphrelay eager",
                                "graphrelay Relay: fused resolve + fused stash_and_publish, Triton launches from Python"),
    "graphrelay_graph": Variant("gr graph", "graphrelay captured", "the same two graphrelay launches captured in a CUDA graph"),
}

class Settings(msgspec.Struct, frozen=True):
    batch_sizes: list[int]
    iters: int  # eager iterations, or graph replays, per timed loop
    repeats: int  # timed loops per measurement (median reported)
    max_reqs: int
    topk: int
    hidden_size: int
    per_graph: int  # relay iterations captured in one graph (see timing.time_captured)
    index_sets: int  # index sets the iterations rotate through
    copy_bytes: int  # size of the copy that measures bandwidth
    smoke: bool


FULL = dict(max_reqs=1024, topk=8, hidden_size=4096, per_graph=16, index_sets=4, copy_bytes=512 << 20)
SMOKE = dict(max_reqs=64, topk=8, hidden_size=64, per_graph=2, index_sets=2, copy_bytes=1 << 20)
DEFAULT_BATCH_SIZES = [2**i for i in range(10)]  # 1..512
SMOKE_BATCH_SIZES = [1, 4]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=COMMAND,
        description="Time one relay iteration (resolve + stash + publish) for plain and EAGLE fields: "
                    "a per-field eager torch relay, it captured, graphrelay eager, graphrelay captured, "
                    "against the bytes-over-bandwidth floor.")
    parser.add_argument("--batch-sizes", type=options.int_list, default=None,
                        help="comma-separated batch sizes (default 1,2,4,...,512; with --smoke 1,4)")
    parser.add_argument("--max-reqs", type=options.positive_int, default=None,
                        help=f"relay slots (default {FULL['max_reqs']}; with --smoke {SMOKE['max_reqs']}); raise it "
                             "to make the relay's rows outgrow the L2 cache")
    options.add_common_options(parser, default_iters=200, default_repeats=5)
    return parser


def make_settings(args: argparse.Namespace) -> Settings:
    if args.smoke:
        sizes = args.batch_sizes or SMOKE_BATCH_SIZES
        preset = dict(SMOKE, batch_sizes=sizes, iters=1, repeats=1, smoke=True)
    else:
        sizes = args.batch_sizes or DEFAULT_BATCH_SIZES
        preset = dict(FULL, batch_sizes=sizes, iters=args.iters, repeats=args.repeats, smoke=False)
    if args.max_reqs is not None:
        preset["max_reqs"] = args.max_reqs
    settings = Settings(**preset)
    options.require_within("--batch-sizes", sizes, 1, settings.max_reqs, f" (a batch needs that many slots: --max-reqs is {settings.max_reqs})")
    return settings


def field_sets(settings: Settings) -> dict[str, RelayConfig]:
    max_batch = max(settings.batch_sizes)
    return {
        "plain": RelayConfig.plain(settings.max_reqs, max_batch),
        "eagle": RelayConfig.eagle(settings.max_reqs, max_batch, topk=settings.topk, hidden_size=settings.hidden_size),
    }


class Disagreement(Exception):
    """graphrelay and the baseline computed different values: timing them would compare nothing."""


def bench_field_set(name: str, config: RelayConfig, settings: Settings, clock: Clock, ceilings: Ceilings,
                    gen: torch.Generator) -> list[dict[str, Any]]:
    device = clock.device
    # validate=False: the serving hot path's setting (validation reads indices, a host sync).
    relay = Relay(config, device, validate=False)
    baseline = PerFieldRelay(config, device)
    fields = relay.fields
    fill_every_row([relay, baseline], fields, config.max_reqs, config.max_batch, device, gen)
    check_at = max(settings.batch_sizes)
    bad = disagreements(relay, baseline, index_sets(1, check_at, config.max_reqs, device, gen)[0],
                        random_inputs(fields, check_at, device, gen))
    if bad:
        raise Disagreement(f"{name} fields, batch {check_at}: graphrelay and the per-field baseline differ in {bad}")

    rows = []
    for bs in settings.batch_sizes:
        sets = index_sets(settings.index_sets, bs, config.max_reqs, device, gen)
        inputs = random_inputs(fields, bs, device, gen)
        steps = {"baseline": relay_step(baseline, sets, inputs), "graphrelay": relay_step(relay, sets, inputs, out=relay.alloc_resolved(bs))}
        timed: dict[str, Sample] = {}
        for impl, step in steps.items():
            timed[f"{impl}_eager"] = time_eager(clock, step, settings.iters, settings.repeats)
            timed[f"{impl}_graph"] = time_captured(clock, step, settings.per_graph, settings.iters, settings.repeats)
        nbytes = floor.iteration_bytes(fields, bs, sets[0].element_size())
        rows.append({
            "field_set": name,
            "batch_size": bs,
            "padding_rows": padding_rows(bs),
            "bytes": nbytes,
            "bytes_us": nbytes / ceilings.copy_bandwidth * 1e6,
            "floor_us": floor.floor_us(nbytes, ceilings),
            "us": {v: timed[v].median_us for v in VARIANTS},
            "spread_us": {v: [timed[v].min_us, timed[v].max_us] for v in VARIANTS},
            "speedup_vs_baseline_eager": timed["baseline_eager"].median_us / timed["graphrelay_graph"].median_us,
        })
        print(f"  {name:5s} bs {bs:4d}: " + "  ".join(f"{VARIANTS[v].column} {timed[v].median_us:8.2f}" for v in VARIANTS),
              file=sys.stderr, flush=True)
    return rows


def _eagle_row(rows: list[dict[str, Any]], bs: int) -> dict[str, Any]:
    """The EAGLE row at `bs`, or an empty dict when the run did not measure that batch size."""
    return next((r for r in rows if r["field_set"] == "eagle" and r["batch_size"] == bs), {})


def relay_targets(rows: list[dict[str, Any]]) -> list[results.Target]:
    """The issue's targets, from a prototype measured on an H200 (issue 7)."""
    at_256, at_1 = _eagle_row(rows, 256), _eagle_row(rows, 1)
    return [
        results.Target("graphrelay captured, EAGLE, batch 256", 3.5, "µs", True, at_256.get("us", {}).get("graphrelay_graph")),
        results.Target("graphrelay captured, EAGLE, batch 1", 2.5, "µs", True, at_1.get("us", {}).get("graphrelay_graph")),
        results.Target("speedup over the eager per-field baseline, EAGLE, batch 256", 30.0, "x", False,
                       at_256.get("speedup_vs_baseline_eager")),
    ]


def table(rows: list[dict[str, Any]], ceilings: Ceilings, env: dict[str, Any], settings: Settings) -> str:
    headers = ["fields", "bs", "floor", *(v.column for v in VARIANTS.values()), "speedup", "graph/floor"]
    body = [[r["field_set"], str(r["batch_size"]), f"{r['floor_us']:.2f}", *(f"{r['us'][v]:.2f}" for v in VARIANTS),
             f"{r['speedup_vs_baseline_eager']:.1f}x", f"{r['us']['graphrelay_graph'] / r['floor_us']:.2f}"]
            for r in rows]
    title = (f"relay iteration (resolve + stash + publish), µs per iteration, median of {settings.repeats} x {settings.iters} "
             f"on {env['device']}; copy {ceilings.copy_bandwidth / 1e9:.0f} GB/s, kernel node {ceilings.kernel_node_us:.2f} µs\n"
             "pf = per-field torch baseline, gr = graphrelay; speedup = pf eager / gr graph; floor = bytes / copy bandwidth + one kernel node")
    if settings.smoke:
        title = "SMOKE RUN: tiny sizes, timings are meaningless\n" + title
    return title + "\n" + results.format_table(headers, body)


def plot(path: Path, rows: list[dict[str, Any]], env: dict[str, Any]) -> Path:
    panels = []
    for name in dict.fromkeys(r["field_set"] for r in rows):
        mine = [r for r in rows if r["field_set"] == name]
        xs = [r["batch_size"] for r in mine]
        lines = [plots.Line(VARIANTS[v].label, xs, [r["us"][v] for r in mine]) for v in VARIANTS]
        lines.append(plots.Line("floor", xs, [r["floor_us"] for r in mine], dashed=True))
        panels.append(plots.Panel(f"{name} fields", "batch size", "µs per relay iteration", lines, loglog=True))
    return plots.save_panels(path, panels, f"relay iteration cost on {env['device']}")


def _describe(config: RelayConfig) -> dict[str, Any]:
    row = floor.row_bytes(relay_fields(config))
    # Compare relay_buffer_bytes with environment.l2_cache_bytes: rows that fit in L2 are
    # gathered from the cache, which a model forward between iterations would have evicted.
    return {"config": msgspec.to_builtins(config), "row_bytes": row, "relay_buffer_bytes": row * config.rows}


def run(settings: Settings, device: torch.device, command: list[str], out_dir: Path) -> dict[str, Any]:
    started = time.perf_counter()
    env = results.environment(device, command)
    clock = Clock(device)
    gen = torch.Generator().manual_seed(0)
    ceilings = measure_ceilings(clock, settings.copy_bytes, settings.per_graph, settings.iters, settings.repeats)
    configs = field_sets(settings)
    rows = [row for name, config in configs.items() for row in bench_field_set(name, config, settings, clock, ceilings, gen)]
    targets = relay_targets(rows)
    report = {
        "benchmark": "relay",
        "smoke": settings.smoke,
        "environment": env,
        "settings": msgspec.structs.asdict(settings),
        "ceilings": {"copy_bytes": ceilings.copy_bytes, "copy_bandwidth_bytes_per_s": ceilings.copy_bandwidth,
                     "kernel_node_us": ceilings.kernel_node_us},
        "field_sets": {name: _describe(config) for name, config in configs.items()},
        "variants": {key: v.description for key, v in VARIANTS.items()},
        "rows": rows,
        "targets": [t.as_dict() for t in targets],
        "plot": PLOT_NAME,
        "wall_s": None,
    }
    plot(out_dir / PLOT_NAME, rows, env)
    report["wall_s"] = time.perf_counter() - started
    results.write_json(out_dir / JSON_NAME, report)
    # The table last: the tail of a device call's output is what comes back.
    print(f"wrote {out_dir / JSON_NAME} and {out_dir / PLOT_NAME} ({report['wall_s']:.1f} s)")
    print("targets:\n" + "\n".join("  " + t.line() for t in targets))
    print(table(rows, ceilings, env, settings))
    return report


def main(argv: list[str]) -> int:
    args = options.parse(build_parser(), argv)
    if isinstance(args, int):
        return args
    try:
        settings = make_settings(args)
        device = options.pick_device(settings.smoke, COMMAND)
    except options.UsageError as error:
        return options.report_usage_error(COMMAND, error)
    try:
        run(settings, device, ["bench", "relay", *argv], options.out_dir(args))
    except Disagreement as error:
        print(f"{COMMAND}: {error}; not timing them", file=sys.stderr)
        return EXIT_DISAGREE
    return 0
