"""`graphrelay lint FILE.py:NAME [FILE.py:NAME ...]`: lint step functions from the shell.

NAME is a callable in FILE taking no arguments and returning `(step, example_inputs)`, or
`(step, example_inputs, alt_inputs)` to choose the second run's values; the linter calls
`step(*example_inputs)`. Exit status: 0 when every step is clean, 1 when a hazard was found,
2 when a target could not be linted (bad path or name, wrong return, the step raised).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any, Callable

from graphrelay.lint.linter import LintError, lint_step
from graphrelay.lint.report import LintReport

USAGE = """usage: graphrelay lint FILE.py:NAME [FILE.py:NAME ...]

Check that step functions are capturable into a CUDA graph, on CPU, without a GPU.

  FILE.py:NAME  NAME is a function in FILE.py taking no arguments and returning
                (step, example_inputs) or (step, example_inputs, alt_inputs);
                the step is run as step(*example_inputs) on CPU tensors.

Reports host syncs, data-dependent output shapes, tensors built from Python data in the
step, and control flow or shapes that depend on input values, each with its source line
and a fix. Exit status: 0 clean, 1 hazards found, 2 a target could not be linted."""

EXIT_CLEAN, EXIT_HAZARDS, EXIT_ERROR = 0, 1, 2


class TargetError(Exception):
    """A target that names no usable step factory; the message says what to change."""


def _load_module(path: str) -> Any:
    if not os.path.isfile(path):
        raise TargetError(f"no such file: {path!r}")
    if not path.endswith(".py"):
        raise TargetError(f"{path!r} is not a Python file (expected FILE.py:NAME)")
    # The file's folder goes on sys.path, as when running it as a script, so its imports work.
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    # One module per file, however many of its factories are linted; named by its full path
    # so two files called steps.py don't collide.
    module_name = "_graphrelay_lint_" + "".join(c if c.isalnum() else "_" for c in os.path.abspath(path))
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    # Registered before running, so dataclasses and pickling in the file can find it.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise TargetError(f"importing {path} raised {type(exc).__name__}: {exc}") from exc
    return module


def _load_factory(target: str) -> Callable[[], Any]:
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise TargetError(f"{target!r} is not FILE.py:NAME (e.g. my_steps.py:make_decode_step)")
    module = _load_module(path)
    factory = getattr(module, name, None)
    if factory is None:
        raise TargetError(f"{path} has no {name!r}; define `def {name}(): return step, example_inputs`")
    if not callable(factory):
        raise TargetError(f"{path}:{name} is a {type(factory).__name__}, not a callable returning (step, example_inputs)")
    return factory


def _call_factory(target: str, factory: Callable[[], Any]) -> tuple:
    try:
        made = factory()
    except Exception as exc:
        raise TargetError(f"{target}() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise TargetError(
            f"{target}() returned a {type(made).__name__}; it must return "
            "(step, example_inputs) or (step, example_inputs, alt_inputs)"
        )
    step, *inputs = made
    if not callable(step):
        raise TargetError(f"{target}() returned a {type(step).__name__} as the step; the first item must be callable")
    if any(not isinstance(x, (tuple, list)) for x in inputs):
        raise TargetError(f"{target}(): example_inputs (and alt_inputs) must be a tuple or list of step arguments")
    return made


def lint_target(target: str) -> LintReport:
    """Load and lint one FILE.py:NAME; raises TargetError or LintError."""
    step, example_inputs, *alt = _call_factory(target, _load_factory(target))
    try:
        return lint_step(step, example_inputs, alt_inputs=alt[0] if alt else None, target=target)
    except ValueError as exc:
        raise TargetError(f"{target}: {exc}") from exc


def lint_main(argv: list[str]) -> int:
    if any(arg in ("-h", "--help") for arg in argv):
        print(USAGE)
        return EXIT_CLEAN
    if not argv:
        print(USAGE, file=sys.stderr)
        return EXIT_ERROR
    status = EXIT_CLEAN
    for target in argv:
        try:
            report = lint_target(target)
        except (TargetError, LintError) as exc:
            print(f"graphrelay lint: error: {exc}", file=sys.stderr)
            status = EXIT_ERROR
            continue
        print(report.format() + "\n")
        if not report.ok:
            status = max(status, EXIT_HAZARDS)
    return status
