"""`bench serve`'s report: targets, the table, the JSON file and the PNG, from the sweep's points.

A point is one rate of the sweep: `serve_metrics.summarize`'s figures plus its `rate` (inf =
all at once; written "inf" in JSON, which has no infinity) and, in process, the loop's own
`LoopStats` under `loop`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import msgspec
import torch

from graphrelay.tools.bench import plots, results
from graphrelay.tools.bench.serve_metrics import highest_rate_within

if TYPE_CHECKING:
    from graphrelay.tools.bench.serve import Plan

COMMAND = "graphrelay bench serve"

# Issue 18's targets for the default workload, in process.
TARGET_RATE = 100.0
TTFT_P50_LIMIT_MS, TTFT_P99_LIMIT_MS = 20.0, 100.0
SLO_RATE_TARGET = 600.0
# Issue 20's, over HTTP against the in-process figures.
HTTP_ADDED_TTFT_MS, HTTP_THROUGHPUT_RATIO = 2.0, 0.9
# Issue 23's: TP=2's highest rate within the SLO over TP=1's.
TP2_RATE_RATIO = 1.5
TP_JSON_NAME = "serve_tp_bench.json"


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def write_report(plan: Plan, command: list[str], out: Path, names: tuple[str, str], device: torch.device,
                 served: dict[str, Any], points: list[dict[str, Any]], targets: list[results.Target], start: float) -> None:
    """JSON file and PNG (`names`) into `out`, and the table on stdout. `device`: where the
    figures were measured (the client's, over HTTP; `served` says what answered)."""
    json_name, plot_name = names
    env = results.environment(device, command)
    best = highest_rate_within(points, plan.slo_ttft_ms)
    plot = save_plot(out / plot_name, points, plan.slo_ttft_ms, f"{served['mode']} on {env['device'] if plan.url is None else plan.url}")
    results.write_json(out / json_name, {
        "benchmark": "serve", "smoke": plan.smoke, "environment": env, "served": served,
        "plan": {**msgspec.to_builtins(plan), "rates": [rate_label(r) for r in plan.rates]},
        "points": [{**p, "rate": rate_label(p["rate"])} for p in points],  # JSON has no inf
        "highest_rate_within_slo": best, "slo_ttft_ms": plan.slo_ttft_ms,
        "targets": [t.as_dict() for t in targets], "plot": plot.name, "wall_s": time.perf_counter() - start,
    })
    print(f"wrote {out / json_name} and {plot}")
    print(format_points(points))
    print(f"highest rate with TTFT p99 <= {plan.slo_ttft_ms:g} ms: "
          + ("none of those run" if best is None else f"{best:g} requests/s"))
    for target in targets:
        print(target.line())


def write_tp_summary(plan: Plan, command: list[str], out: Path, device: torch.device, rows: list[dict[str, Any]],
                     start: float) -> None:
    """`--tp`: each size's highest rate within the SLO side by side (`rows`, one per size,
    its full report named under "report"), and issue 23's target, reported, not asserted."""
    best = {r["tp"]: r["highest_rate_within_slo"] for r in rows}
    ratio = best[2] / best[1] if best.get(1) and best.get(2) is not None else None
    targets = [results.Target(f"TP=2's highest rate with TTFT p99 <= {plan.slo_ttft_ms:g} ms over TP=1's",
                              TP2_RATE_RATIO, "x", False, ratio)]
    results.write_json(out / TP_JSON_NAME, {
        "benchmark": "serve-tp", "smoke": plan.smoke, "environment": results.environment(device, command),
        "plan": {**msgspec.to_builtins(plan), "rates": [rate_label(r) for r in plan.rates]}, "slo_ttft_ms": plan.slo_ttft_ms,
        "sizes": rows, "targets": [t.as_dict() for t in targets], "wall_s": time.perf_counter() - start,
    })
    print(f"wrote {out / TP_JSON_NAME}")
    headers = ["tp", f"highest rate, TTFT p99 <= {plan.slo_ttft_ms:g} ms", "out tok/s all at once", "host syncs per rank",
               "relays identical"]
    body = [[str(r["tp"]), "none" if r["highest_rate_within_slo"] is None else f"{r['highest_rate_within_slo']:g} req/s",
             "n/a" if r["output_tokens_per_s_all_at_once"] is None else f"{r['output_tokens_per_s_all_at_once']:,.0f}",
             str(r["host_syncs_per_rank"]), "yes" if r["relays_identical"] else "NO"] for r in rows]
    print("online load by tensor-parallel size, same workload\n" + results.format_table(headers, body))
    for target in targets:
        print(target.line())


def serve_targets(points: list[dict[str, Any]], plan: Plan) -> list[results.Target]:
    """Issue 18's, in process."""
    at = _at_rate(points, TARGET_RATE)
    ttft = (lambda q: None) if at is None else (lambda q: at["ttft_ms"][q])
    best = highest_rate_within(points, plan.slo_ttft_ms)
    return [
        results.Target(f"TTFT p50 at {TARGET_RATE:g} requests/s", TTFT_P50_LIMIT_MS, "ms", True, ttft("p50")),
        results.Target(f"TTFT p99 at {TARGET_RATE:g} requests/s", TTFT_P99_LIMIT_MS, "ms", True, ttft("p99")),
        results.Target(f"highest rate with TTFT p99 <= {plan.slo_ttft_ms:g} ms", SLO_RATE_TARGET, "requests/s", False, best),
    ]


def http_targets(points: list[dict[str, Any]], plan: Plan, in_process_json) -> list[results.Target]:
    """Issue 20's: the HTTP path against the in-process loop on the same workload, read from
    the in-process results in the same --out folder; not measured without them."""
    reference = in_process_points(in_process_json, plan)
    if not reference:
        say(f"no in-process results for this workload in {in_process_json}: run `{COMMAND}` with the same "
            f"workload flags and --out first to compare the HTTP path with the loop")

    def both(rate: float):
        mine, theirs = _at_rate(points, rate), _at_rate(reference, rate)
        usable = mine is not None and theirs is not None and not mine["failed"] and theirs["output_tokens_per_s"] > 0
        return (mine, theirs) if usable else None

    at_target, at_once = both(TARGET_RATE), both(math.inf)
    added = None if at_target is None else at_target[0]["ttft_ms"]["p50"] - at_target[1]["ttft_ms"]["p50"]
    ratio = None if at_once is None else at_once[0]["output_tokens_per_s"] / at_once[1]["output_tokens_per_s"]
    return [
        results.Target(f"TTFT p50 added by HTTP at {TARGET_RATE:g} requests/s", HTTP_ADDED_TTFT_MS, "ms", True, added),
        results.Target("output tokens/s, HTTP over in process, all at once", HTTP_THROUGHPUT_RATIO, "x", False, ratio),
    ]


WORKLOAD_KEYS = ("model", "weights", "gguf", "requests", "lengths", "seed")


def in_process_points(path, plan: Plan) -> list[dict[str, Any]]:
    """The points of an in-process results file that served this plan's workload, rates as
    numbers again; [] when there is none or it served another workload."""
    try:
        earlier = json.loads(path.read_text())
        workload = msgspec.json.decode(msgspec.json.encode({k: getattr(plan, k) for k in WORKLOAD_KEYS}))  # as JSON has it
        same = all(earlier["plan"][k] == workload[k] for k in WORKLOAD_KEYS)
        return [{**p, "rate": float(p["rate"])} for p in earlier["points"]] if same else []
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _at_rate(points: list[dict[str, Any]], rate: float) -> Optional[dict[str, Any]]:
    return next((p for p in points if p["rate"] == rate), None)


def say(text: str) -> None:
    print(f"{COMMAND}: {text}", file=sys.stderr, flush=True)


def point_line(p: dict[str, Any]) -> str:
    return (f"rate {rate_label(p['rate'])}: {p['completed']}/{p['requests']} requests, {p['output_tokens_per_s']:,.0f} "
            f"tokens/s, TTFT p50 {_ms(p['ttft_ms']['p50'])} p99 {_ms(p['ttft_ms']['p99'])} ms")


def _ms(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def format_points(points: list[dict[str, Any]]) -> str:
    headers = ["rate", "req/s", "out tok/s", "TTFT p50", "p90", "p99", "TPOT p50", "p99", "ITL p50", "p99",
               "iter ms p50", "GPU us p50", "host launch us", "GPU idle", "launch-bound", "failed"]
    body = []
    for p in points:
        loop = p.get("loop") or {}  # the loop's own figures: in process only
        bound, idle = loop.get("launch_bound_fraction"), loop.get("gpu_idle_fraction")
        body.append([rate_label(p["rate"]), f"{p['requests_per_s']:.1f}", f"{p['output_tokens_per_s']:,.0f}",
                     *(_ms(p["ttft_ms"][q]) for q in ("p50", "p90", "p99")), *(_ms(p["tpot_ms"][q]) for q in ("p50", "p99")),
                     *(_ms(p["itl_ms"][q]) for q in ("p50", "p99")), _ms(loop.get("iter_ms_median")),
                     _us(loop.get("gpu_step_us_median")), _us(loop.get("host_launch_us_median")),
                     "n/a" if idle is None else f"{idle:.0%}", "n/a" if bound is None else f"{bound:.0%}",
                     str(p["failed"])])
    return "latencies in ms; iteration figures in process only\n" + results.format_table(headers, body)


def _us(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def plot_panels(points: list[dict[str, Any]], slo_ms: float) -> list[plots.Panel]:
    """TTFT, decode pace and throughput against the offered rate, one point per rate."""
    labels = [rate_label(p["rate"]) for p in points]
    xs = list(range(len(points)))

    def line(label: str, metric: str, quantile: str) -> plots.Line:
        return plots.Line(label, xs, [p[metric][quantile] for p in points])

    rate_axis = "offered rate (requests/s; inf = all at once)"
    return [
        plots.Panel("time to first token", rate_axis, "ms", [
            line("TTFT p50", "ttft_ms", "p50"), line("TTFT p99", "ttft_ms", "p99"),
            plots.Line(f"SLO {slo_ms:g} ms", xs, [slo_ms] * len(xs), dashed=True)], logy=True, xticklabels=labels),
        plots.Panel("decode pace", rate_axis, "ms", [
            line("TPOT p50", "tpot_ms", "p50"), line("ITL p50", "itl_ms", "p50"), line("ITL p99", "itl_ms", "p99")],
            logy=True, xticklabels=labels),
        plots.Panel("throughput", rate_axis, "output tokens/s", [
            plots.Line("output tokens/s", xs, [p["output_tokens_per_s"] for p in points])], xticklabels=labels),
    ]


def save_plot(path, points: list[dict[str, Any]], slo_ms: float, where: str):
    return plots.save_panels(path, plot_panels(points, slo_ms), f"bench serve, {where}")
