"""Command-line pieces every `graphrelay bench` subcommand shares.

Usage errors (a bad option value, no GPU where one is needed) are reported in one line on
stderr with exit status 2 and no traceback; `parse` turns argparse's own exits into return
codes so `bench_main` stays a plain function returning an int.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

EXIT_USAGE = 2


class UsageError(Exception):
    """A problem with how the benchmark was invoked; the message says what to change."""


class OneLineParser(argparse.ArgumentParser):
    """A bad option is one line on stderr (a `UsageError`), not argparse's usage block."""

    def error(self, message: str):
        raise UsageError(message)


def add_output_options(parser: argparse.ArgumentParser, smoke_help: str) -> None:
    """--out and --smoke, as every benchmark takes them (see `out_dir`)."""
    parser.add_argument("--out", default=None,
                        help="folder for the JSON and PNG results (default: results/; with --smoke results/tmp/, "
                             "so a smoke run never overwrites real results)")
    parser.add_argument("--smoke", "--dry-run", dest="smoke", action="store_true", help=smoke_help)


def add_common_options(parser: argparse.ArgumentParser, *, default_iters: int, default_repeats: int) -> None:
    add_output_options(parser, "run every variant once with tiny sizes (works on CPU): checks the code paths, "
                               "its timings mean nothing")
    parser.add_argument("--iters", type=positive_int, default=default_iters,
                        help=f"iterations (eager) or graph replays (captured) per timed loop (default {default_iters})")
    parser.add_argument("--repeats", type=positive_int, default=default_repeats,
                        help=f"timed loops per measurement; the median is reported (default {default_repeats})")


def out_dir(args: argparse.Namespace) -> Path:
    if args.out is not None:
        return Path(args.out)
    return Path("results/tmp") if args.smoke else Path("results")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def int_list(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]: sorted, de-duplicated, every value >= 1."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} must be a comma-separated list of integers, e.g. 1,2,4,8")
    return sorted({positive_int(p) for p in parts})


def int_range(text: str) -> tuple[int, int]:
    """'32,512' -> (32, 512): LOW,HIGH with 1 <= LOW <= HIGH."""
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{text!r} must be LOW,HIGH, e.g. 32,512")
    low, high = (positive_int(p.strip()) for p in parts)
    if low > high:
        raise argparse.ArgumentTypeError(f"{text!r}: LOW must be <= HIGH")
    return low, high


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    """Parsed options, or the exit status argparse chose (0 after --help, 2 on a bad option)."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE


def pick_device(smoke: bool, command: str) -> torch.device:
    """CUDA when present; CPU only for a smoke run, whose numbers are not GPU numbers."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if smoke:
        return torch.device("cpu")
    raise UsageError(
        f"{command} measures GPU time and needs a CUDA device, but torch sees none "
        f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}). "
        f"Run it on a GPU machine, or pass --smoke to check the code paths on CPU."
    )


def report_usage_error(command: str, error: UsageError, stream=None) -> int:
    print(f"{command}: error: {error}", file=stream or sys.stderr)
    return EXIT_USAGE


def require_within(option: str, values: list[int], low: int, high: int, why: str = "") -> None:
    bad = [v for v in values if not low <= v <= high]
    if bad:
        raise UsageError(f"{option} value {bad[0]} is out of range {low}..{high}{why}")
