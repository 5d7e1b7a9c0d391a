"""`graphrelay bench sampler`: the fused sampler's GPU time per call, by batch and by what its
rows ask for (greedy, temperature, top-k, top-p, both), against the torch reference backend on
the same logits, and how often the two pick the same token.

Each cell is PER_GRAPH calls captured in one CUDA graph over the same `[rows, vocab]` bf16
logits (the engine samples its LM head's bf16 output as it is), replayed and timed with CUDA
events (`timing.time_captured`), the median of the repeats kept. The Triton sampler gets
counters allocated once, as the engine's step passes them, and ranks `--max-top-k` logits a
row as the engine does (default 64). Every row of a cell asks for the same thing; each row has
its own seed. Prints a table and writes sampler_bench.json to --out.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from graphrelay.capture.iteration.sampling import sample
from graphrelay.tools.bench import options, results, timing

COMMAND = "graphrelay bench sampler"
JSON_NAME = "sampler_bench.json"
# What a row asks for: (temperature, top_k, top_p); top_k 0 and top_p 1 are no cut.
KINDS = {
    "greedy": (0.0, 0, 1.0),
    "temperature 0.8": (0.8, 0, 1.0),
    "top-k 50": (0.8, 50, 1.0),
    "top-p 0.9": (0.8, 0, 0.9),
    "top-k 50 + top-p 0.9": (0.8, 50, 0.9),
}
FULL = dict(rows=[1, 64, 128, 256], vocab=49152, per_graph=20, replays=5, repeats=7)
SMOKE = dict(rows=[1, 2], vocab=300, per_graph=1, replays=1, repeats=1)
MAX_TOP_K = 64  # the engine's default (EngineConfig.max_top_k)
BACKENDS = ("triton", "torch")


def build_parser() -> argparse.ArgumentParser:
    parser = options.OneLineParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    options.add_output_options(parser, f"rows {','.join(map(str, SMOKE['rows']))} over a {SMOKE['vocab']}-token "
                                       "vocabulary, one call each (works on CPU): checks the code paths")
    parser.add_argument("--rows", type=options.int_list, default=None,
                        help=f"batch sizes (default {','.join(map(str, FULL['rows']))})")
    parser.add_argument("--vocab", type=options.positive_int, default=None,
                        help=f"vocabulary size (default {FULL['vocab']}, SmolLM2's)")
    parser.add_argument("--max-top-k", type=options.positive_int, default=MAX_TOP_K,
                        help=f"logits ranked a row, as EngineConfig.max_top_k (default {MAX_TOP_K}; the fused "
                             "sampler ranks at most 256)")
    return parser


def row_params(rows: int, kind: str, device: torch.device) -> dict[str, torch.Tensor]:
    """`sample`'s per-row arguments for `rows` rows that all ask for `kind`, each row its own
    seed and step."""
    temperature, top_k, top_p = KINDS[kind]
    return {"temperature": torch.full((rows,), temperature, device=device),
            "top_k": torch.full((rows,), top_k, dtype=torch.int32, device=device),
            "top_p": torch.full((rows,), top_p, device=device),
            "seeds": torch.arange(rows, device=device) * 7919 + 1,
            "steps": torch.arange(rows, device=device) + 128}


def main(argv: list[str]) -> int:
    try:
        args = options.parse(build_parser(), argv)
        if isinstance(args, int):
            return args
        sizes, rows, vocab, device = _settings(args)
    except options.UsageError as error:
        return options.report_usage_error(COMMAND, error)
    return run(device, rows, vocab, args.max_top_k, sizes, ["bench", "sampler", *argv], options.out_dir(args),
               smoke=args.smoke)


def _settings(args: argparse.Namespace) -> tuple[dict, list[int], int, torch.device]:
    """The run's timing sizes, batch sizes, vocabulary and device, checked before any work."""
    sizes = SMOKE if args.smoke else FULL
    rows, vocab = args.rows or sizes["rows"], args.vocab or sizes["vocab"]
    options.require_within("--rows", rows, 1, 4096)
    options.require_within("--vocab", [vocab], 2, 1 << 20)
    options.require_within("--max-top-k", [args.max_top_k], 1, 256, " (the fused sampler ranks at most 256)")
    device = options.pick_device(args.smoke, COMMAND)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise options.UsageError("on CPU the fused sampler runs in Triton's interpreter, chosen before Triton "
                                 "loads: run it as TRITON_INTERPRET=1 graphrelay bench sampler --smoke")
    return sizes, rows, vocab, device


def run(device: torch.device, rows: list[int], vocab: int, max_top_k: int, sizes: dict, command: list[str], out,
        *, smoke: bool) -> int:
    clock = timing.Clock(device)
    table = []
    for bs in rows:
        logits = (3 * torch.randn(bs, vocab, generator=torch.Generator().manual_seed(bs))).to(torch.bfloat16).to(device)
        counters = torch.zeros(bs, dtype=torch.int32, device=device)
        for kind in KINDS:
            params = row_params(bs, kind, device)
            outs = {backend: torch.empty(bs, dtype=torch.int64, device=device) for backend in BACKENDS}

            def call(backend: str) -> None:
                sample(logits, params["temperature"], params["top_k"], params["seeds"], params["steps"],
                       out=outs[backend], max_top_k=max_top_k, top_p=params["top_p"], backend=backend,
                       counters=counters if backend == "triton" else None)

            times = {backend: timing.time_captured(clock, lambda _k, b=backend: call(b), sizes["per_graph"],
                                                   sizes["replays"], sizes["repeats"]).median_us
                     for backend in BACKENDS}
            same = int((outs["triton"] == outs["torch"]).sum())
            table.append({"rows": bs, "kind": kind, "triton_us": times["triton"], "torch_us": times["torch"],
                          "same_tokens": same})

    if smoke:
        print("SMOKE RUN: tiny shapes; the timings mean nothing")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{COMMAND}: {vocab}-token vocabulary, bf16 logits, max_top_k {max_top_k} ({name})")
    print(results.format_table(
        ["rows", "rows ask for", "fused us", "torch us", "speedup", "same tokens"],
        [[str(e["rows"]), e["kind"], f"{e['triton_us']:.2f}", f"{e['torch_us']:.2f}",
          f"{e['torch_us'] / e['triton_us']:.2f}x", f"{e['same_tokens']}/{e['rows']}"] for e in table]))
    path = results.write_json(out / JSON_NAME, {
        "benchmark": "sampler", "smoke": smoke, "environment": results.environment(device, command),
        "vocab": vocab, "max_top_k": max_top_k, "kinds": {k: dict(zip(("temperature", "top_k", "top_p"), v))
                                                          for k, v in KINDS.items()},
        "calls_per_graph": sizes["per_graph"], "rows": table,
    })
    print(f"\nwrote {path}", file=sys.stderr)
    return 0
