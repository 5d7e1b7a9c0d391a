"""Lint targets named `FILE.py:NAME`: check the name, import the file, call the factory and
lint the step it returns, all in the calling process (`graphrelay lint` runs this in a worker
process per target, so that a target that exits or hangs can't take the command with it).

NAME is a callable in FILE taking no arguments and returning `(step, example_inputs)`, or
`(step, example_inputs, alt_inputs)` to choose the second run's values.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any, Callable

from graphrelay.lint.linter import LintError, lint_step
from graphrelay.lint.report import LintReport


class TargetError(Exception):
    """A target that can't be linted; the message is the reason, saying what to change."""


def parse_target(target: str) -> tuple[str, str]:
    """`FILE.py:NAME` split into the file and the name, once both look usable."""
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise TargetError(f"{target!r} is not FILE.py:NAME (e.g. my_steps.py:make_decode_step)")
    if not os.path.isfile(path):
        raise TargetError(f"no such file: {path!r}")
    if not path.endswith(".py"):
        raise TargetError(f"{path!r} is not a Python file (expected FILE.py:NAME)")
    return path, name


def _load_module(path: str) -> Any:
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


def _load_factory(path: str, name: str) -> Callable[[], Any]:
    factory = getattr(_load_module(path), name, None)
    if factory is None:
        raise TargetError(f"{path} has no {name!r}; define `def {name}(): return step, example_inputs`")
    if not callable(factory):
        raise TargetError(f"{name} is a {type(factory).__name__}, not a callable returning (step, example_inputs)")
    return factory


def _call_factory(name: str, factory: Callable[[], Any]) -> tuple:
    try:
        made = factory()
    except Exception as exc:
        raise TargetError(f"{name}() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise TargetError(
            f"{name}() returned a {type(made).__name__}; it must return "
            "(step, example_inputs) or (step, example_inputs, alt_inputs)"
        )
    step, *inputs = made
    if not callable(step):
        raise TargetError(f"{name}() returned a {type(step).__name__} as the step; the first item must be callable")
    if any(not isinstance(x, (tuple, list)) for x in inputs):
        raise TargetError(f"{name}(): example_inputs (and alt_inputs) must be a tuple or list of step arguments")
    return made


def lint_target(target: str) -> LintReport:
    """Load and lint one FILE.py:NAME in this process; raises TargetError with the reason."""
    path, name = parse_target(target)
    step, example_inputs, *alt = _call_factory(name, _load_factory(path, name))
    try:
        return lint_step(step, example_inputs, alt_inputs=alt[0] if alt else None, target=target)
    except LintError as exc:
        raise TargetError(exc.reason) from exc
    except ValueError as exc:
        raise TargetError(str(exc)) from exc
