"""`graphrelay bench SUBCOMMAND`: benchmarks, each in its own module with `main(argv) -> int`.

A benchmark plugs in with one entry in SUBCOMMANDS; its module is imported only when asked
for. Shared pieces: `options` (CLI and device), `timing` (CUDA-event loops, graph replays,
ceilings), `results` (environment, targets, JSON), `plots` (PNG panels).
"""

from __future__ import annotations

import importlib
import sys

# name -> (module with `main(argv) -> int`, one-line summary)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "relay": ("graphrelay.tools.bench.relay", "one relay iteration's cost for batch sizes 1..512, against its floor and a per-field baseline"),
    "loop": ("graphrelay.tools.bench.loop", "the serving loop in eager, no-overlap and overlap modes: tokens/s, iteration time, GPU idle"),
    "e2e": ("graphrelay.tools.bench.e2e", "graphrelay against transformers generate (static and dynamic cache), end to end, same model and workload"),
    "iteration": ("graphrelay.tools.bench.iteration", "one unified iteration by shape (prompts, decodes, mixed) and the TTFT of one prompt on an idle engine"),
    "serve": ("graphrelay.tools.bench.serve", "online load: Poisson arrivals over a sweep of rates, in process or against an OpenAI-compatible --url: TTFT, TPOT, ITL, throughput"),
    "soak": ("graphrelay.tools.bench.soak", "concurrent streaming clients against a --url server, some leaving mid-stream, over rounds: exact text, no leaked slots, flat memory"),
    "kernels": ("graphrelay.tools.bench.kernels", "each layer projection at 1..256 rows: the fused Triton kernels (with and without PDL) against cuBLAS"),
    "sampler": ("graphrelay.tools.bench.sampler", "the fused sampler per call by batch and by what rows ask for (greedy, temperature, top-k, top-p), against the torch reference"),
    "controls": ("graphrelay.tools.bench.controls", "the sampling controls' cost in the captured decode step at batch 64, per control, against none"),
    "spec": ("graphrelay.tools.bench.spec", "plain against n-gram speculative decoding on SmolLM2-135M: tokens/s, accepted length, identical outputs"),
    "json": ("graphrelay.tools.bench.json_bench", "JSON-schema constrained decoding on SmolLM2-135M under overlap, n-gram speculation off and on: valid outputs, host syncs, tokens/s"),
}


def usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = [f"  {name.ljust(width)}  {summary}" for name, (_, summary) in SUBCOMMANDS.items()]
    return ("usage: graphrelay bench {" + ",".join(SUBCOMMANDS) + "} [ARGS]\n\n" + "\n".join(lines)
            + "\n\n`graphrelay bench SUBCOMMAND --help` for each one's options.")


def bench_main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"graphrelay bench: unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return module.main(rest)
