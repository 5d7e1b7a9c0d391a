"""`graphrelay bench iteration`: what one unified iteration costs, by shape, on the engine a user
gets by default (token budget, buckets), and the time to first token of one prompt on an idle
engine.

Shapes: prompts alone (1 x 128, 1 x 2048, 64 x 128 tokens: the last is cut into iterations of
the token budget, and its figure is their total), decode spans alone (1, 64, 256 requests over
~16-key contexts: the step's fixed cost), a mixed iteration (256 decodes beside a 512-token
prompt chunk), and decode spans over 512-key contexts (64 and 256 requests: where a serving
run's decode rows live, and attention's share grows with the context). Each is launched through
`Engine.launch` (staging, one copy, the graph replay of its bucket), `--repeats` times back
to back, and timed with CUDA events on the engine's stream: GPU time per shape, with the host
time of the launch calls beside it: their own work, and apart from it the time they blocked on a
staging buffer still being copied (launches queued back to back run ahead of the GPU by two, then
each waits for it: that wait is the GPU's pace, not the host's). TTFT: host time from `launch` of
a 128-token prompt to its first token read from the host mirror, the engine otherwise idle.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch

from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.iteration.spans import Span, decode_span, prefill_span
from graphrelay.capture.model.kv_cache import KV_CACHE_DTYPES
from graphrelay.capture.model.model import ModelConfig
from graphrelay.capture.serving.heap import frozen_startup_heap
from graphrelay.runtime import Event
from graphrelay.tools.bench import kernel_profile, options, results

COMMAND = "graphrelay bench iteration"
GREEDY = SamplingParams()
PROMPTS = {"prefill 1x128": (1, 128), "prefill 1x2048": (1, 2048), "prefill 64x128": (64, 128)}
DECODES = (1, 64, 256)
LONG_DECODES = (64, 256)
SHORT_CONTEXT = 16  # prompt tokens per row before the decode shapes: the step's fixed cost
LONG_CONTEXT = 512  # keys per row in the long-context decode shapes
TARGETS_MS = {"prefill 1x128": 1.5, "prefill 1x2048": 4.0, "prefill 64x128": 8.0}
TTFT_TARGET_MS = 3.0


def main(argv: list[str]) -> int:
    parser = options.OneLineParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    options.add_output_options(parser, "tiny model and shapes (works on CPU): checks the code paths only")
    parser.add_argument("--model", default="smollm2-135m", help="preset, random weights (default smollm2-135m)")
    parser.add_argument("--repeats", type=options.positive_int, default=20, help="launches per shape (median)")
    parser.add_argument("--kv-cache-dtype", choices=sorted(KV_CACHE_DTYPES), default="auto",
                        help="the KV cache's dtype: auto (the model's, the default) or fp8 (a tuned setting)")
    parser.add_argument("--profile", action="store_true",
                        help="also break each decode shape's iteration down by kernel (torch profiler)")
    try:
        args = parser.parse_args(argv)
        device = _device(args.smoke)
        model = ModelConfig.preset("tiny" if args.smoke else args.model)
    except options.UsageError as exc:
        print(f"{COMMAND}: error: {exc}", file=sys.stderr)
        return options.EXIT_USAGE
    scale = 16 if args.smoke else 1  # smoke: every shape 16x smaller
    engine = Engine(EngineConfig(model, max_reqs=256 // scale, max_batch=256 // scale, device=str(device),
                                 use_graphs=device.type == "cuda", kv_cache_dtype=args.kv_cache_dtype))
    capture = engine.capture()
    # The heap frozen, as a serving process runs (capture.serving.heap): a full collection of what
    # building the engine left would stall the back-to-back launches and show as GPU time.
    with frozen_startup_heap():
        rows = measure(engine, scale, 2 if args.smoke else args.repeats)
        profiles = profile_decodes(engine, scale, 2 if args.smoke else 10) if args.profile else {}
        ttft = time_to_first_token(engine, 128 // scale, 2 if args.smoke else args.repeats)
    targets = [results.Target(f"{name} GPU time", limit, "ms", True, _row(rows, name)["gpu_ms"])
               for name, limit in TARGETS_MS.items() if not args.smoke]
    targets.append(results.Target("TTFT of one 128-token prompt, idle engine", TTFT_TARGET_MS, "ms", True, ttft))
    payload = {"environment": results.environment(device, [COMMAND, *argv]), "model": "tiny" if args.smoke else args.model,
               "kv_cache_dtype": args.kv_cache_dtype, "max_tokens": engine.max_tokens, "buckets": capture.buckets,
               "graph_nodes": capture.nodes, "rows": rows, "ttft_ms": ttft,
               "kernel_profile": profiles,
               "targets": [t.as_dict() for t in targets]}
    path = results.write_json(options.out_dir(args) / "iteration_bench.json", payload)
    print(format_rows(rows, ttft))
    for shape, profile_row in profiles.items():
        print(kernel_profile.format_breakdown(shape, profile_row))
    for target in targets:
        print(target.line())
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _device(smoke: bool) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if smoke:
        return torch.device("cpu")
    raise options.UsageError("needs a CUDA device (or --smoke on CPU)")


def _row(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(r for r in rows if r["shape"] == name)


def measure(engine: Engine, scale: int, repeats: int) -> list[dict[str, Any]]:
    """GPU and host time of each shape's iterations, the median over `repeats`."""
    rows = []
    with engine.activate():
        for name, (count, length) in PROMPTS.items():
            spans = [prefill_span(slot, GREEDY, [1 + slot] * (length // scale), 0, True)
                     for slot in range(1, max(1, count // scale) + 1)]
            rows.append(_time(engine, name, _budgeted(engine, spans), repeats))
        running = list(range(1, engine.max_batch + 1))
        _prefill(engine, running)
        for n in DECODES:
            rows.append(_time(engine, decode_shape(n), [_decodes(running, n, scale)], repeats))
        mixed = [decode_span(slot, GREEDY) for slot in running[1:]] + \
                [prefill_span(1, GREEDY, [7] * (512 // scale), 0, True)]
        rows.append(_time(engine, f"mixed {len(running) - 1} decodes + 512 prompt", [mixed], repeats))
        _prefill(engine, running, LONG_CONTEXT // scale)
        for n in LONG_DECODES:
            rows.append(_time(engine, long_decode_shape(n), [_decodes(running, n, scale)], repeats))
    return rows


def decode_shape(rows: int) -> str:
    return f"decode {rows}"


def long_decode_shape(rows: int) -> str:
    return f"decode {rows} @ {LONG_CONTEXT} keys"


def _decodes(running: list[int], rows: int, scale: int) -> list[Span]:
    """Decode spans of the first `rows` running slots (scaled down for smoke runs)."""
    return [decode_span(slot, GREEDY) for slot in running[: max(1, rows // scale)]]


def profile_decodes(engine: Engine, scale: int, iterations: int) -> dict[str, dict[str, Any]]:
    """`kernel_profile.breakdown` of each decode shape's iteration, over the contexts `measure`
    timed it at (every slot's prompt is laid down afresh for each context)."""
    profiles = {}
    running = list(range(1, engine.max_batch + 1))
    contexts = ((SHORT_CONTEXT, DECODES, decode_shape), (LONG_CONTEXT // scale, LONG_DECODES, long_decode_shape))
    with engine.activate():
        for length, counts, shape in contexts:
            _prefill(engine, running, length)
            for n in counts:
                decodes = _decodes(running, n, scale)
                engine.read(engine.launch(decodes), block=True)  # warm
                profiles[shape(n)] = kernel_profile.profile_kernels(
                    lambda: engine.read(engine.launch(decodes), block=True), iterations, engine.device)
    return profiles


def _budgeted(engine: Engine, spans: list[Span]) -> list[list[Span]]:
    """Cut prompts into iterations of the token budget, as the scheduler does."""
    iterations, current, budget = [], [], engine.max_tokens
    for span in spans:
        tokens, start = list(span.tokens), 0
        while tokens:
            if budget == 0:
                iterations.append(current)
                current, budget = [], engine.max_tokens
            take = tokens[:budget]
            tokens = tokens[budget:]
            current.append(prefill_span(span.slot, span.params, take, start, not tokens))
            start += len(take)
            budget -= len(take)
    iterations.append(current)
    return iterations


def _prefill(engine: Engine, slots: list[int], length: int = SHORT_CONTEXT) -> None:
    """Give every slot a fresh `length`-token prompt, so decode spans have something to extend."""
    for iteration in _budgeted(engine, [prefill_span(s, GREEDY, [3] * length, 0, True) for s in slots]):
        engine.read(engine.launch(iteration), block=True)


def _time(engine: Engine, name: str, iterations: list[list[Span]], repeats: int) -> dict[str, Any]:
    """GPU time per repeat of `iterations`, launched back to back as a busy loop launches them
    (the host stages the next while the GPU runs this one, so launch overhead is hidden unless
    the host is slower), and the host time of the launch calls: their work, and their waits for
    a staging buffer (`IterationInputs.staging_wait_s`) apart."""
    on_gpu = engine.on_gpu
    last = None
    for spans in iterations:  # warm-up
        last = engine.launch(spans)
    engine.read(last, block=True)
    start, end = (Event(timing=True, device=engine.device) for _ in range(2)) if on_gpu else (None, None)
    if on_gpu:
        start.record(engine.stream)
    t0, launching, waited_before = time.perf_counter(), 0.0, engine.inputs.staging_wait_s
    for _ in range(repeats):
        for spans in iterations:
            t = time.perf_counter()
            last = engine.launch(spans)
            launching += time.perf_counter() - t
    if on_gpu:
        end.record(engine.stream)
    engine.read(last, block=True)
    total_ms = start.elapsed_ms(end) if on_gpu else (time.perf_counter() - t0) * 1e3
    tokens = sum(engine.span_tokens(s) for spans in iterations for s in spans)
    waited = engine.inputs.staging_wait_s - waited_before
    return {"shape": name, "iterations": len(iterations), "tokens": tokens, "gpu_ms": total_ms / repeats,
            "host_launch_ms": (launching - waited) * 1e3 / repeats, "host_wait_ms": waited * 1e3 / repeats}


def time_to_first_token(engine: Engine, length: int, repeats: int) -> float:
    """Median host time from launching one prompt to reading its first token."""
    times = []
    with engine.activate():
        for _ in range(repeats + 1):
            engine.stream.synchronize()
            t0 = time.perf_counter()
            iteration = engine.launch([prefill_span(1, GREEDY, [5] * length, 0, True)])
            engine.read(iteration, block=True)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


def format_rows(rows: list[dict[str, Any]], ttft: float) -> str:
    headers = ["shape", "iterations", "tokens", "GPU ms", "host launch ms", "host waits ms"]
    body = [[r["shape"], str(r["iterations"]), str(r["tokens"]), f"{r['gpu_ms']:.3f}", f"{r['host_launch_ms']:.3f}",
             f"{r['host_wait_ms']:.3f}"] for r in rows]
    return (f"{COMMAND}: one iteration by shape (default token budget)\n" + results.format_table(headers, body)
            + f"\nTTFT, one 128-token prompt, idle engine: {ttft:.2f} ms")
