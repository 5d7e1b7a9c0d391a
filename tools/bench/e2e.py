"""`graphrelay bench e2e`: graphrelay against transformers' generate, end to end, same model and workload.

For each prompt length P and batch size B, every system serves B seeded random prompts of P
tokens for N greedy tokens on the SmolLM2-135M shape with random bf16 weights (see
`e2e_systems` for how each is timed). A row reports the decode step (GPU time of one decode
iteration) beside its floor (weights + KV cache read once from HBM), decode tokens/s, end-to-end
tokens/s (prefill included) and the time to first token. Rows are printed and written to
`e2e_bench.json` as they complete, so a run cut short still leaves its results; `--systems`,
`--batches` and `--prompt-lens` split a run over several calls and `--merge` joins them in one
file; `--time-budget` skips the cells left once it is spent. Targets are reported, never asserted;
the exit status is 1 when a cell failed (its row's note says why, the others still ran).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import msgspec
import torch

from graphrelay.capture.model.model import ModelConfig
from graphrelay.tools.bench import e2e_systems, options, plots, results

COMMAND = "graphrelay bench e2e"
JSON_NAME = "e2e_bench.json"
PLOT_NAME = "e2e_bench.png"
SYSTEMS = ("graphrelay", "hf-static", "hf-dynamic")
ROW_KEYS = ("system", "batch", "prompt_len", "output_len", "decode_step_us", "iter_us_median", "decode_tokens_per_s",
            "tokens_per_s", "ttft_ms", "capture_s", "graph_nodes", "floor_us", "note")
FULL = dict(model="smollm2-135m", batches=[1, 8, 64, 256], prompt_lens=[128, 512], output_len=128)
SMOKE = dict(model="tiny", batches=[1, 2], prompt_lens=[8], output_len=4)

# Targets, all at prompt length 128: graphrelay's decode step (ms) per batch size, its step
# speedup over hf-static at the same batch sizes, and its end-to-end tokens/s over hf-static.
TARGET_PROMPT = 128
STEP_LIMIT_MS = {1: 1.0, 64: 1.5, 256: 2.5}
STEP_SPEEDUP = 2.5
E2E_SPEEDUP = {64: 2.0, 256: 2.0}


class Plan(msgspec.Struct, frozen=True):
    model: str
    systems: tuple[str, ...]
    batches: tuple[int, ...]
    prompt_lens: tuple[int, ...]
    output_len: int
    repeats: int
    seed: int
    time_budget: Optional[float]
    merge: bool
    smoke: bool


def build_parser() -> argparse.ArgumentParser:
    parser = options.OneLineParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {','.join(SYSTEMS)} (default all)")
    parser.add_argument("--batches", type=options.int_list, default=None, help="batch sizes (default 1,8,64,256)")
    parser.add_argument("--prompt-lens", type=options.int_list, default=None, help="prompt lengths in tokens (default 128,512)")
    parser.add_argument("--output-len", type=options.positive_int, default=None, help="tokens generated per request (default 128)")
    parser.add_argument("--repeats", type=options.positive_int, default=1, help="timed rounds of HF generate calls (1, 2 and N tokens) per cell; medians are kept (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="skip the (system, shape) cells not started within this many seconds, recording them as skipped")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of an existing e2e_bench.json in --out, replacing those this run measures")
    options.add_output_options(parser, "tiny model, batches 1,2, prompt 8, output 4 (works on CPU, eager): checks the code paths")
    return parser


def make_plan(args: argparse.Namespace) -> Plan:
    defaults = SMOKE if args.smoke else FULL
    systems = tuple(s.strip() for s in args.systems.split(","))
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise options.UsageError(f"--systems: unknown system {unknown[0] if unknown else ''!r}; choose from {','.join(SYSTEMS)}")
    output_len = args.output_len or defaults["output_len"]
    if output_len < 3:
        raise options.UsageError("--output-len must be >= 3: the HF decode step is timed from tokens 3..N")
    if args.time_budget is not None and not args.time_budget > 0:
        raise options.UsageError(f"--time-budget must be > 0 seconds, got {args.time_budget}")
    batches, prompt_lens = args.batches or defaults["batches"], args.prompt_lens or defaults["prompt_lens"]
    options.require_within("--batches", batches, 1, 1024)
    options.require_within("--prompt-lens", prompt_lens, 1, 32768)
    return Plan(model=defaults["model"], systems=tuple(s for s in SYSTEMS if s in systems), batches=tuple(batches),
                prompt_lens=tuple(prompt_lens), output_len=output_len, repeats=args.repeats, seed=args.seed,
                time_budget=args.time_budget, merge=args.merge, smoke=args.smoke)


def main(argv: list[str]) -> int:
    try:
        args = options.parse(build_parser(), argv)
        if isinstance(args, int):
            return args
        plan = make_plan(args)
        out = options.out_dir(args)
        earlier = load_earlier(out / JSON_NAME, plan) if plan.merge else None
        device = options.pick_device(plan.smoke, COMMAND)
    except options.UsageError as error:
        return options.report_usage_error(COMMAND, error)
    return run(plan, device, ["bench", "e2e", *argv], out, earlier)


def load_earlier(path: Path, plan: Plan) -> Optional[dict[str, Any]]:
    """The results file to merge into (None if there is none yet); it must hold the same
    model and output length, or its rows would not compare with this run's."""
    if not path.exists():
        return None
    try:
        earlier = json.loads(path.read_text())
        found = (earlier["model"], earlier["output_len"])
        if not isinstance(earlier["rows"], list):
            raise TypeError("rows is not a list")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise options.UsageError(f"--merge: cannot read {path} as an e2e results file ({exc!r}); move it or drop --merge") from None
    if found != (plan.model, plan.output_len):
        raise options.UsageError(f"--merge: {path} holds model {found[0]}, output length {found[1]}; this run is "
                                 f"{plan.model}, {plan.output_len}: use another --out or drop --merge")
    return earlier


def cells(plan: Plan) -> list[tuple[str, int, int]]:
    """(system, batch, prompt_len), the systems side by side for each shape, shortest prompt
    and smallest batch first: a run cut short by its budget still compares whole shapes."""
    return [(s, b, p) for p in plan.prompt_lens for b in plan.batches for s in plan.systems]


def make_row(system: str, batch: int, prompt_len: int, output_len: int, **values: Any) -> dict[str, Any]:
    row = dict.fromkeys(ROW_KEYS)
    row.update(system=system, batch=batch, prompt_len=prompt_len, output_len=output_len, note="")
    unknown = set(values) - set(ROW_KEYS)
    if unknown:
        raise KeyError(f"not row keys: {sorted(unknown)}")
    row.update(values)
    return row


def measure(system: str, model: ModelConfig, batch: int, prompt_len: int, plan: Plan, device: torch.device) -> dict[str, Any]:
    prompts = e2e_systems.prompts(model.vocab_size, batch, prompt_len, plan.seed)
    if system == "graphrelay":
        return e2e_systems.run_graphrelay(model, prompts, plan.output_len, device)
    return e2e_systems.run_hf(model, prompts, plan.output_len, device, static=system == "hf-static", repeats=plan.repeats)


def merge_rows(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows keyed by (system, batch, prompt_len): a new row replaces the old one, except that
    a skipped or failed row never replaces a measured one. Sorted as `cells` runs them.
    Old rows written before a key existed get it as None."""
    merged = {(r["system"], r["batch"], r["prompt_len"]): {**dict.fromkeys(ROW_KEYS), **r} for r in old}
    for row in new:
        key = (row["system"], row["batch"], row["prompt_len"])
        if key in merged and row["tokens_per_s"] is None and merged[key]["tokens_per_s"] is not None:
            continue
        merged[key] = row
    rank = {s: i for i, s in enumerate(SYSTEMS)}
    return sorted(merged.values(), key=lambda r: (r["prompt_len"], r["batch"], rank.get(r["system"], len(rank))))


def run(plan: Plan, device: torch.device, command: list[str], out: Path, earlier: Optional[dict[str, Any]]) -> int:
    start = time.perf_counter()
    env = results.environment(device, command)
    model = ModelConfig.preset(plan.model)
    rows = list(earlier["rows"]) if earlier else []
    report = {
        "benchmark": "e2e", "smoke": plan.smoke, "model": plan.model, "model_config": msgspec.to_builtins(model),
        "output_len": plan.output_len, "hbm_bytes_per_s": e2e_systems.HBM_BYTES_PER_S,
        "weight_bytes": e2e_systems.weight_bytes(model), "environment": env,
        # Where merged rows came from: every earlier run's environment, oldest first.
        "earlier_environments": ([*earlier.get("earlier_environments", []), earlier["environment"]] if earlier else []),
        "plan": msgspec.structs.asdict(plan), "rows": rows, "targets": [], "plot": PLOT_NAME,
    }
    failed = 0
    for system, batch, prompt_len in cells(plan):
        spent = time.perf_counter() - start
        if plan.time_budget is not None and spent > plan.time_budget:
            values = {"note": f"skipped: time budget {plan.time_budget:g} s spent ({spent:.0f} s)"}
        else:
            print(f"{COMMAND}: {system}, batch {batch}, prompt {prompt_len} ...", file=sys.stderr, flush=True)
            try:
                values = measure(system, model, batch, prompt_len, plan, device)
            except Exception as exc:  # one system failing (OOM, a compile error) must not lose the others' rows
                traceback.print_exc()
                failed += 1
                values = {"note": f"failed: {type(exc).__name__}: {exc}"[:300]}
            finally:
                e2e_systems.release(device)
        # The floor belongs to the shape: skipped and failed rows carry it too, for the table and plot.
        row = make_row(system, batch, prompt_len, plan.output_len,
                       floor_us=e2e_systems.floor_us(model, batch, prompt_len, plan.output_len), **values)
        rows = merge_rows(rows, [row])
        print(describe(row), flush=True)
        report.update(rows=rows, targets=[t.as_dict() for t in e2e_targets(rows)])
        results.write_json(out / JSON_NAME, report)
    targets = e2e_targets(rows)
    plots.save_panels(out / PLOT_NAME, plot_panels(rows), f"end to end, {plan.model} shape, {plan.output_len} "
                      f"output tokens, on {env['device']}", columns=2)
    report.update(wall_s=time.perf_counter() - start)
    results.write_json(out / JSON_NAME, report)
    # The tables last: the tail of a device call's output is what comes back.
    print(f"wrote {out / JSON_NAME} and {out / PLOT_NAME} ({report['wall_s']:.0f} s)")
    print("targets:\n" + "\n".join("  " + t.line() for t in targets))
    print(tables(rows, plan))
    return 1 if failed else 0


def describe(row: dict[str, Any]) -> str:
    head = f"{row['system']:<10}  batch {row['batch']:>4}  prompt {row['prompt_len']:>5}:"
    if row["tokens_per_s"] is None:
        return f"{head} {row['note']}"
    step = "n/a" if row["decode_step_us"] is None else f"{row['decode_step_us']:,.0f} µs"
    return (f"{head} step {step} (floor {row['floor_us']:.3g} µs), {_num(row['decode_tokens_per_s'], ',.0f')} tok/s decode, "
            f"{row['tokens_per_s']:,.0f} tok/s end to end, TTFT {row['ttft_ms']:,.1f} ms; {row['note']}")


# ---- targets, tables, plot ----------------------------------------------------------------


def _value(rows: list[dict[str, Any]], system: str, batch: int, key: str) -> Optional[float]:
    row = next((r for r in rows if (r["system"], r["batch"], r["prompt_len"]) == (system, batch, TARGET_PROMPT)), None)
    return None if row is None else row[key]


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return None if num is None or den is None else num / den


def e2e_targets(rows: list[dict[str, Any]]) -> list[results.Target]:
    """Every target, measured from whatever rows exist (None: not measured in this file)."""
    targets = []
    for batch, limit in STEP_LIMIT_MS.items():
        step = _value(rows, "graphrelay", batch, "decode_step_us")
        targets.append(results.Target(f"graphrelay decode step, batch {batch}, prompt {TARGET_PROMPT}", limit, "ms", True,
                                      None if step is None else step / 1e3))
    for batch in STEP_LIMIT_MS:
        speedup = _ratio(_value(rows, "hf-static", batch, "decode_step_us"), _value(rows, "graphrelay", batch, "decode_step_us"))
        targets.append(results.Target(f"decode step speedup over hf-static, batch {batch}, prompt {TARGET_PROMPT}",
                                      STEP_SPEEDUP, "x", False, speedup))
    for batch, limit in E2E_SPEEDUP.items():
        speedup = _ratio(_value(rows, "graphrelay", batch, "tokens_per_s"), _value(rows, "hf-static", batch, "tokens_per_s"))
        targets.append(results.Target(f"end-to-end tokens/s over hf-static, batch {batch}, prompt {TARGET_PROMPT}",
                                      limit, "x", False, speedup))
    return targets


def _num(value: Optional[float], fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def tables(rows: list[dict[str, Any]], plan: Plan) -> str:
    shapes = list(dict.fromkeys((r["batch"], r["prompt_len"]) for r in rows))
    cell = {(r["system"], r["batch"], r["prompt_len"]): r for r in rows}

    def get(system: str, shape: tuple[int, int], key: str, fmt: str) -> str:
        row = cell.get((system, *shape))
        if row is None:
            return "-"  # not run
        if row[key] is None and row["tokens_per_s"] is None:
            return row["note"].split(":")[0]  # skipped / failed
        return _num(row[key], fmt)

    def ratio(shape: tuple[int, int], key: str, num: str, den: str) -> str:
        num_row, den_row = cell.get((num, *shape)), cell.get((den, *shape))
        value = None if num_row is None or den_row is None else _ratio(num_row[key], den_row[key])
        return "n/a" if value is None else f"{value:.2f}x"

    step_rows = [[f"{b} / {p}", _num(next(r["floor_us"] for r in rows if (r["batch"], r["prompt_len"]) == (b, p)), ",.1f"),
                  get("graphrelay", (b, p), "decode_step_us", ",.0f"), get("graphrelay", (b, p), "iter_us_median", ",.0f"),
                  get("graphrelay", (b, p), "graph_nodes", "d"),
                  get("hf-static", (b, p), "decode_step_us", ",.0f"), get("hf-dynamic", (b, p), "decode_step_us", ",.0f"),
                  ratio((b, p), "decode_step_us", "hf-static", "graphrelay")] for b, p in shapes]
    e2e_rows = [[f"{b} / {p}", *(get(s, (b, p), "tokens_per_s", ",.0f") for s in SYSTEMS),
                 ratio((b, p), "tokens_per_s", "graphrelay", "hf-static"), *(get(s, (b, p), "ttft_ms", ",.1f") for s in SYSTEMS)]
                for b, p in shapes]
    title = (f"{plan.model} shape, random weights, {plan.output_len} output tokens, greedy; "
             "decode step = GPU time of one decode iteration (graphrelay: graph replay; HF: (T_N - T_2) / (N - 2))")
    if plan.smoke:
        title = "SMOKE RUN: tiny sizes, timings are meaningless\n" + title
    step_table = results.format_table(
        ["batch / prompt", "floor µs", "graphrelay µs", "gr iter µs", "gr graph nodes", "hf-static µs", "hf-dynamic µs", "static/gr"], step_rows)
    e2e_table = results.format_table(
        ["batch / prompt", "graphrelay tok/s", "hf-static tok/s", "hf-dynamic tok/s", "gr/static",
         "gr TTFT ms", "static TTFT ms", "dynamic TTFT ms"], e2e_rows)
    return f"{title}\n\ndecode step\n{step_table}\n\nend to end (prefill included)\n{e2e_table}"


def plot_panels(rows: list[dict[str, Any]]) -> list[plots.BarPanel]:
    """Per prompt length, two panels of bars grouped by batch size, one bar per system: the
    decode step against its floor, and end-to-end tokens/s. Every panel lists the same systems
    (None where a cell was not measured) so each system keeps its colour."""
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    panels = []
    for prompt_len in sorted({r["prompt_len"] for r in rows}):
        mine = {(r["system"], r["batch"]): r for r in rows if r["prompt_len"] == prompt_len}
        batches = sorted({b for _, b in mine})

        def series(key: str, scale: float) -> list[plots.Bars]:
            return [plots.Bars(s, [None if (r := mine.get((s, b))) is None or r[key] is None else r[key] * scale
                                   for b in batches]) for s in systems]

        floors = [next(r["floor_us"] / 1e3 for (_, b2), r in mine.items() if b2 == b) for b in batches]
        labels = [str(b) for b in batches]
        panels.append(plots.BarPanel(f"decode step, prompt {prompt_len}", "batch size", "ms per decode step (log)", labels,
                                     [*series("decode_step_us", 1e-3), plots.Bars("floor (HBM)", floors, reference=True)],
                                     logy=True))
        panels.append(plots.BarPanel(f"end-to-end tokens/s, prompt {prompt_len}", "batch size", "tokens/s (log)", labels,
                                     series("tokens_per_s", 1.0), logy=True))
    return panels
