"""`graphrelay lint [--timeout SECONDS] FILE.py:NAME [FILE.py:NAME ...]`: lint step functions
from the shell, each in a worker process of its own (`graphrelay.lint.worker`).

The command must always reach a verdict: a target that calls `sys.exit` or `os._exit`,
crashes the interpreter or never returns can't hide another target's hazards or hang the
command. Its worker is killed after the timeout and the target is reported as not linted.

Exit status: 0 when every target was linted and is clean, 1 when a hazard was found and
every target was linted, 2 when any target could not be linted (bad path or name, wrong
return, the step raised, exited, crashed, timed out or ran no tensor ops). 2 outranks 1: a
run with a target left unchecked is incomplete whatever the others found.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

import graphrelay
from graphrelay.lint.report import LintReport
from graphrelay.lint.targets import TargetError, parse_target

DEFAULT_TIMEOUT_S = 60.0

USAGE = f"""usage: graphrelay lint [--timeout SECONDS] FILE.py:NAME [FILE.py:NAME ...]

Check that step functions are capturable into a CUDA graph, on CPU, without a GPU.

  FILE.py:NAME        NAME is a function in FILE.py taking no arguments and returning
                      (step, example_inputs) or (step, example_inputs, alt_inputs);
                      the step is run as step(*example_inputs) on CPU tensors.
  --timeout SECONDS   give up on a target after this long (default {DEFAULT_TIMEOUT_S:g}), counting
                      the import of FILE.py, the factory and both runs of the step.

Reports host syncs, data-dependent output shapes, tensors built from Python data in the
step, and control flow or shapes that depend on input values, each with its source line
and a fix. Each target runs in a process of its own: one that exits, crashes, hangs or runs
no tensor ops is reported as could not be linted, with the reason.
Exit status: 0 all clean, 1 hazards found, 2 a target could not be linted (2 outranks 1)."""

EXIT_CLEAN, EXIT_HAZARDS, EXIT_ERROR = 0, 1, 2

# Where this linter's package lives: the worker must import the same one, whatever the cwd.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(graphrelay.__file__)))


class UsageError(Exception):
    """Command-line arguments that name no run; the message says what is wrong."""


@dataclass(frozen=True)
class Outcome:
    """One target's result: a report, or the reason no verdict was reached."""

    report: Optional[LintReport] = None
    reason: str = ""


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise UsageError(f"--timeout takes a positive number of seconds, not {value!r}")
    return seconds


def _parse_args(argv: list[str]) -> tuple[list[str], float]:
    targets, timeout = [], DEFAULT_TIMEOUT_S
    args = iter(argv)
    for arg in args:
        if arg == "--timeout" or arg.startswith("--timeout="):
            timeout = _seconds(arg.partition("=")[2] if "=" in arg else next(args, ""))
        elif arg.startswith("-"):
            raise UsageError(f"unknown option {arg!r}")
        else:
            targets.append(arg)
    if not targets:
        raise UsageError("no targets given")
    return targets, timeout


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    # Steps run on CPU tensors, so Triton kernels must run in the interpreter even on a GPU
    # machine; it is chosen when the kernels are defined, hence set before the worker starts.
    env.setdefault("TRITON_INTERPRET", "1")
    return env


def _no_result_reason(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"the linter process was killed by {name} (a crash in native code, or the step killed it)"
    return (
        f"the linter process exited with status {returncode} before reporting "
        "(the file, the factory or the step called sys.exit or os._exit)"
    )


def _lint_in_worker(target: str, timeout: float) -> Outcome:
    """Lint one target in a fresh process, relaying what it printed; never raises for it."""
    with tempfile.TemporaryDirectory(prefix="graphrelay-lint-") as folder:
        result_path = os.path.join(folder, "outcome.json")
        worker = subprocess.Popen(
            [sys.executable, "-m", "graphrelay.lint.worker", target, result_path],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_worker_env(),
            # Its own process group, so a timeout also kills whatever the step started.
            start_new_session=True,
        )
        try:
            out, err = worker.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            out, err = worker.communicate()
            timed_out = True
        sys.stdout.write(out)
        sys.stderr.write(err)
        if timed_out:
            return Outcome(
                reason=f"timed out after {timeout:g} s (a step that loops forever, sleeps or waits; "
                "if it is only slow, raise --timeout)"
            )
        if not os.path.exists(result_path):
            return Outcome(reason=_no_result_reason(worker.returncode))
        with open(result_path) as file:
            outcome = json.load(file)
    if "error" in outcome:
        return Outcome(reason=outcome["error"])
    return Outcome(report=LintReport.from_dict(outcome["report"]))


def _lint_one(target: str, timeout: float) -> Outcome:
    try:
        # Checked here first: a misspelt path needs no process to say so.
        parse_target(target)
    except TargetError as exc:
        return Outcome(reason=str(exc))
    return _lint_in_worker(target, timeout)


def lint_main(argv: list[str]) -> int:
    if any(arg in ("-h", "--help") for arg in argv):
        print(USAGE)
        return EXIT_CLEAN
    try:
        targets, timeout = _parse_args(argv)
    except UsageError as exc:
        print(f"graphrelay lint: {exc}\n\n{USAGE}", file=sys.stderr)
        return EXIT_ERROR
    status = EXIT_CLEAN
    for target in targets:
        outcome = _lint_one(target, timeout)
        if outcome.report is None:
            print(f"graphrelay lint: {target}: could not be linted: {outcome.reason}", file=sys.stderr)
            status = EXIT_ERROR
            continue
        print(outcome.report.format() + "\n")
        if not outcome.report.ok:
            status = max(status, EXIT_HAZARDS)
    return status
