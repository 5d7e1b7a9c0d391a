"""`graphrelay serve`: run the serving loop on a workload and print what it measured.

With no arguments it serves a short synthetic workload on the tiny model, with CUDA graphs
on a GPU and eagerly on a CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec
import torch

from capture.engine import Engine
from capture.loop import MODES, LoopResult, ServingLoop
from capture.model import MODEL_PRESETS, ModelConfig
from capture.workloads import SyntheticWorkload, WorkloadError, load_jsonl


def _int_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH (two ints), got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"need 1 <= LOW <= HIGH, got {text!r}")
    return low, high


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"bucket sizes must be positive ints, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="graphrelay serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=MODES, default="overlap", help="scheduling mode (default: overlap)")
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default="tiny", help="model preset (default: tiny)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--requests", type=Path, help="JSONL request file (one request per line) instead of a synthetic workload")
    p.add_argument("--num-requests", type=int, default=48, help="synthetic: number of requests (default 48)")
    p.add_argument("--prompt-len", type=_int_range, default=(4, 32), help="synthetic: prompt length range LOW,HIGH")
    p.add_argument("--output-len", type=_int_range, default=(8, 64), help="synthetic: output length range LOW,HIGH")
    p.add_argument("--rate", type=float, default=0.0, help="synthetic: arrivals per second (0 = all at once)")
    p.add_argument("--temperature", type=float, default=0.0, help="synthetic: sampling temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=0, help="synthetic: top-k cut (0 = none)")
    p.add_argument("--stop-token", type=int, default=None, help="synthetic: stop token id")
    p.add_argument("--seed", type=int, default=0, help="synthetic: workload seed")
    p.add_argument("--max-reqs", type=int, default=64, help="request slots in the relay and KV cache")
    p.add_argument("--max-batch", type=int, default=16, help="largest decode batch")
    p.add_argument("--buckets", type=_int_list, default=None, help="batch-size buckets to capture (default: dense small, coarse large)")
    p.add_argument("--max-top-k", type=int, default=64, help="static cap on top-k sampling width")
    p.add_argument("--json", type=Path, help="also write the summary (and outputs) as JSON to this path")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def serve_main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _serve(args)
    except (WorkloadError, ValueError, RuntimeError) as exc:
        print(f"graphrelay serve: error: {exc}", file=sys.stderr)
        return 2


def _serve(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no GPU is available; use --device cpu")
    model = ModelConfig.preset(args.model)
    if args.requests is not None:
        requests = load_jsonl(args.requests)
    else:
        requests = SyntheticWorkload(
            num_requests=args.num_requests, prompt_len=args.prompt_len, output_len=args.output_len,
            vocab_size=model.vocab_size, stop_token=args.stop_token, rate=args.rate,
            temperature=args.temperature, top_k=args.top_k, seed=args.seed,
        ).requests()
    use_graphs = device.type == "cuda" and args.mode != "eager"
    say = (lambda *_: None) if args.quiet else (lambda text: print(text, file=sys.stderr, flush=True))
    say(f"graphrelay serve: {len(requests)} requests, model {args.model}, mode {args.mode}, device {device}"
        f"{'' if use_graphs else ' (no CUDA graphs)'}")
    engine = Engine(
        model, max_reqs=args.max_reqs, max_batch=args.max_batch, device=device, use_graphs=use_graphs,
        buckets=args.buckets, max_top_k=args.max_top_k, progress=not args.quiet,
    )
    loop = ServingLoop(engine, args.mode)
    loop.check_requests(requests)
    capture = engine.capture()
    progress = None if args.quiet else (
        lambda s: say(f"  iter {s['iterations']:6d} | running {s['running']:3d} | done {s['done']:4d} | "
                      f"waiting {s['pending']:4d} | {s['elapsed_s']:6.1f} s")
    )
    result = loop.run(requests, progress=progress)
    print(format_summary(result, capture.seconds, capture.graph_memory_bytes))
    if args.json is not None:
        payload = {"stats": result.stats, "capture": capture, "outputs": list(result.outputs.values())}
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(payload)))
    return 0


def format_summary(result: LoopResult, capture_s: float, graph_bytes: int) -> str:
    s = result.stats
    finished = {}
    for out in result.outputs.values():
        finished[out.finish_reason] = finished.get(out.finish_reason, 0) + 1
    rows = [
        ("mode", f"{s.mode} on {s.device} ({'CUDA graphs' if s.graphs else 'eager'})"),
        ("requests", f"{s.requests} ({', '.join(f'{k} {v}' for k, v in sorted(finished.items()))})"),
        ("tokens", f"{s.tokens} in {s.wall_s:.2f} s = {s.tokens_per_s:,.0f} tokens/s"),
        # The mean carries the turns that prefill many requests at once; the median is the
        # steady state.
        ("iterations", f"{s.iterations}: median {s.iter_ms_median:.3f} ms, p99 {s.iter_ms_p99:.3f} ms, "
                       f"mean {s.iter_ms_mean:.3f} ms (prefill turns included)"),
        ("CPU scheduling", f"mean {s.cpu_sched_us_per_iter:.1f} us, median {s.cpu_sched_us_median:.1f} us per iteration"),
        ("GPU step", "n/a (CPU)" if s.gpu_step_us_per_iter is None
         else f"mean {s.gpu_step_us_per_iter:.1f} us, median {s.gpu_step_us_median:.1f} us per iteration "
              f"(with prefills: {s.gpu_busy_us_per_iter:.1f} us)"),
        ("GPU idle", "n/a (CPU)" if s.gpu_idle_fraction is None else f"{100 * s.gpu_idle_fraction:.1f}% of the time between iterations"),
        ("host syncs", f"{s.host_syncs_per_iter:.3f} per iteration"),
        ("blocking waits", f"{s.event_waits_per_iter:.3f} per iteration (for an older iteration's results)"),
    ]
    if s.graphs:
        rows.append(("capture", f"{capture_s:.1f} s, {graph_bytes / 2**20:.1f} MiB of graph memory"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
