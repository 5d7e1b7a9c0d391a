"""`graphrelay bench kernels`: each layer projection's GPU time, fused Triton against cuBLAS.

For each row count, the four projections of a layer (norm + QKV, O + residual, norm +
gate/up + SiLU*up, down + residual) are timed as `capture.model.linear_plan` times them at
an engine's start-up (16 calls on successive layers' weights in one CUDA graph, L2 evicted
before each of 5 replays, the median kept): the torch path (cuBLAS between layer_kernels'
norm / SiLU nodes) and the fused Triton kernel in its fastest candidate tiling, with
programmatic dependent launch where the GPU has it, and without. Random weights of the
model preset's shape (SmolLM2-135M by default), bf16. Prints a table and the per-layer sums of each path and
of the plan that keeps the faster, and writes kernels_bench.json to --out.
"""

from __future__ import annotations

import argparse
import sys

import msgspec
import torch

from graphrelay.capture.kernels.pdl import pdl_supported
from graphrelay.capture.model.linear_plan import PROJECTIONS, time_projections
from graphrelay.capture.model.model import MODEL_PRESETS, LlamaModel, ModelConfig
from graphrelay.tools.bench import options, results

COMMAND = "graphrelay bench kernels"
JSON_NAME = "kernels_bench.json"
FULL = dict(model="smollm2-135m", rows=[1, 2, 4, 8, 16, 32, 64, 128, 256])
SMOKE = dict(model="tiny", rows=[1, 2])


def build_parser() -> argparse.ArgumentParser:
    parser = options.OneLineParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    options.add_output_options(parser, "tiny model, rows 1,2: checks the code paths (still on a GPU)")
    parser.add_argument("--rows", type=options.int_list, default=None,
                        help=f"row counts to time (default {','.join(map(str, FULL['rows']))})")
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), default=None,
                        help=f"model preset whose shapes are timed (default {FULL['model']})")
    return parser


def main(argv: list[str]) -> int:
    try:
        args = options.parse(build_parser(), argv)
        if isinstance(args, int):
            return args
        defaults = SMOKE if args.smoke else FULL
        rows = args.rows or defaults["rows"]
        options.require_within("--rows", rows, 1, 65536)
        if not torch.cuda.is_available():
            raise options.UsageError(
                f"{COMMAND} times GPU kernels and needs a CUDA device, even with --smoke; torch sees none "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})")
    except options.UsageError as error:
        return options.report_usage_error(COMMAND, error)
    config = msgspec.structs.replace(ModelConfig.preset(args.model or defaults["model"]), dtype="bfloat16")
    return run(config, rows, ["bench", "kernels", *argv], options.out_dir(args), smoke=args.smoke)


def run(config: ModelConfig, rows: list[int], command: list[str], out, *, smoke: bool) -> int:
    device = torch.device("cuda", torch.cuda.current_device())
    model = LlamaModel(config, 1, device)
    pdl = pdl_supported(device)
    with_pdl = time_projections(model, rows, pdl=pdl)
    without_pdl = time_projections(model, rows, pdl=False) if pdl else with_pdl
    table = []
    for t, plain in zip(with_pdl, without_pdl):
        table.append({"rows": t.rows, "projection": t.projection, "torch_us": t.torch_us, "triton_us": t.triton_us,
                      "triton_no_pdl_us": plain.triton_us, "chosen": t.faster,
                      "tiles": None if t.tiles is None else t.tiles._asdict()})
    per_layer = []
    for r in rows:
        entries = [e for e in table if e["rows"] == r]
        per_layer.append({"rows": r, **{key: sum(e[key] for e in entries)
                                        for key in ("torch_us", "triton_us", "triton_no_pdl_us")},
                          "plan_us": sum(min(e["torch_us"], e["triton_us"]) for e in entries)})

    if smoke:
        print("SMOKE RUN: tiny shapes; the timings mean nothing")
    print(f"{COMMAND}: {config.hidden_size} hidden, {config.num_heads}x{config.head_dim} heads, "
          f"{config.num_kv_heads} kv heads, {config.intermediate_size} intermediate, bf16, PDL "
          f"{'on' if pdl else 'unavailable'} ({torch.cuda.get_device_name(device)})")
    print(results.format_table(
        ["rows", "projection", "cuBLAS us", "Triton us", "no PDL us", "speedup", "chosen", "Triton tiles"],
        [[str(e["rows"]), e["projection"], f"{e['torch_us']:.2f}", f"{e['triton_us']:.2f}",
          f"{e['triton_no_pdl_us']:.2f}", f"{e['torch_us'] / e['triton_us']:.2f}x", e["chosen"],
          _tiles_text(e["tiles"])] for e in table]))
    print("\nper layer (sum of the four projections):")
    print(results.format_table(
        ["rows", "cuBLAS us", "Triton us", "no PDL us", "plan us"],
        [[str(p["rows"])] + [f"{p[k]:.2f}" for k in ("torch_us", "triton_us", "triton_no_pdl_us", "plan_us")]
         for p in per_layer]))
    path = results.write_json(out / JSON_NAME, {
        "benchmark": "kernels", "smoke": smoke, "environment": results.environment(device, command),
        "shape": {"hidden": config.hidden_size, "heads": config.num_heads, "kv_heads": config.num_kv_heads,
                  "head_dim": config.head_dim, "intermediate": config.intermediate_size, "dtype": "bfloat16"},
        "pdl": pdl, "projections": list(PROJECTIONS), "rows": table, "per_layer": per_layer,
    })
    print(f"\nwrote {path}", file=sys.stderr)
    return 0


def _tiles_text(tiles: dict | None) -> str:
    if tiles is None:
        return "default"
    kind = "fma" if tiles["fma"] else "dot swap" if tiles.get("swap") else "dot"
    early = " early" if tiles.get("early") and not tiles["fma"] else ""
    split = f" split {tiles['split_k']}" if tiles.get("split_k", 1) > 1 else ""
    return f"{kind} {tiles['block_m']}x{tiles['block_n']}x{tiles['block_k']} w{tiles['warps']}{early}{split}"
