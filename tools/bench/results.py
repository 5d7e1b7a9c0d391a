"""Benchmark results: where they ran, the targets they are held to, and the JSON file.

Every results file carries an `environment` block (device, versions, date, the command line
and the git commit) so a number can be traced to the run that produced it, and a list of
targets, each reported as met or missed with its margin. Targets are reported, never asserted:
a benchmark that misses one still writes its results.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import platform
import shlex
import subprocess
from pathlib import Path
from typing import Any, Optional

import msgspec
import torch

SCHEMA_VERSION = 1


class Target(msgspec.Struct, frozen=True):
    """One target: `measured` must be <= `limit` (at_most) or >= it. `measured` is None when
    the run did not measure it (e.g. its batch size was not asked for)."""

    name: str
    limit: float
    unit: str
    at_most: bool
    measured: Optional[float]

    @property
    def met(self) -> Optional[bool]:
        if self.measured is None:
            return None
        return self.measured <= self.limit if self.at_most else self.measured >= self.limit

    @property
    def margin(self) -> Optional[float]:
        """Headroom in `unit`: positive when met, negative (by how much) when missed."""
        if self.measured is None:
            return None
        return self.limit - self.measured if self.at_most else self.measured - self.limit

    def as_dict(self) -> dict[str, Any]:
        return {**msgspec.structs.asdict(self), "met": self.met, "margin": self.margin}

    def line(self) -> str:
        bound = "<=" if self.at_most else ">="
        if self.measured is None:
            return f"[not measured] {self.name} {bound} {self.limit:g} {self.unit}"
        verdict = "met" if self.met else "MISSED"
        side = "of headroom" if self.met else "short"
        return (f"[{verdict}] {self.name} {bound} {self.limit:g} {self.unit}: "
                f"{self.measured:.3g} {self.unit} ({abs(self.margin):.3g} {self.unit} {side})")


def _package_version(*names: str) -> Optional[str]:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _git(*args: str) -> Optional[str]:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _git_commit() -> Optional[str]:
    """HEAD, marked +dirty when tracked files differ from it (the numbers may not be HEAD's)."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return None
    return commit + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def environment(device: torch.device, command: list[str]) -> dict[str, Any]:
    """Where and how a benchmark ran. `command` is the argv after `graphrelay`."""
    on_gpu = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if on_gpu else f"cpu ({platform.processor() or platform.machine()})",
        "device_type": device.type,
        "l2_cache_bytes": getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None) if on_gpu else None,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _package_version("triton"),
        "cuda_bindings": _package_version("cuda-bindings", "cuda-python"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["graphrelay", *command]),
        "git_commit": _git_commit(),
    }


def write_json(path: Path, results: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema_version": SCHEMA_VERSION, **results}, indent=2) + "\n")
    return path


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """Right-aligned columns, first column left-aligned."""
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), *(line(r) for r in rows)])
