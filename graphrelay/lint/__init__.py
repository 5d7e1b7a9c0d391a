"""The capture linter: does a step function survive CUDA graph capture? Checked on CPU.

`lint_step(step, example_inputs)` runs the step on CPU tensors under a torch function mode and
a dispatch mode, and reports host syncs, data-dependent shapes, tensors built from Python data
and value-dependent control flow, each with the user's source line and a fix. The command line
is `graphrelay lint FILE.py:NAME` (see `graphrelay.lint.cli`).
"""

from graphrelay.lint.linter import LintError, lint_step
from graphrelay.lint.report import Finding, HazardKind, LintReport, SourceLocation

__all__ = ["Finding", "HazardKind", "LintError", "LintReport", "SourceLocation", "lint_step"]
