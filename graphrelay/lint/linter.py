"""`lint_step`: run a step twice, on its example inputs and on other values of the same
shapes, and report every capture hazard either run hit plus the first point where the two
runs went different ways.

A captured graph replays the ops, shapes and branches of the capture run whatever the new
values are, so a step is capturable only if both runs trace the same ops, shapes and lines.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable, Optional, Sequence

from graphrelay.lint.hazards import FIX_VALUE_DEPENDENT
from graphrelay.lint.inputs import check_same_layout, clone_inputs, other_values
from graphrelay.lint.location import is_internal
from graphrelay.lint.modes import RunRecord, TraceEntry, record_run
from graphrelay.lint.report import Finding, HazardKind, LintReport


class LintError(RuntimeError):
    """The step could not be linted (it raised, or ran no tensor ops): no verdict exists.
    `reason` is the message without the target's name."""

    def __init__(self, target: str, reason: str) -> None:
        super().__init__(f"{target}: {reason}")
        self.target = target
        self.reason = reason


def _raise_location(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not is_internal(f.filename)]
    if not frames:
        return ""
    frame = frames[-1]
    return f" at {frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"


def _run(step: Callable[..., Any], inputs: Sequence[Any], target: str, which: str) -> RunRecord:
    try:
        return record_run(step, clone_inputs(inputs))
    # SystemExit too: a step that calls sys.exit is a step that can't be linted, not a reason
    # for the caller (a test run, the CLI's worker) to stop.
    except (Exception, SystemExit) as exc:
        raise LintError(
            target, f"the step raised {type(exc).__name__}: {exc} on {which}{_raise_location(exc)}"
        ) from exc


def _divergence(example: list[TraceEntry], other: list[TraceEntry]) -> Optional[Finding]:
    for index, (ours, theirs) in enumerate(zip(example, other)):
        if ours == theirs:
            continue
        if (ours.op, ours.location) == (theirs.op, theirs.location):
            detail = (
                f"output shape {ours.shapes_text()} with the example values, "
                f"{theirs.shapes_text()} with other values"
            )
            return Finding(HazardKind.VALUE_DEPENDENT, ours.op, ours.location, FIX_VALUE_DEPENDENT, detail)
        detail = (
            f"op #{index} was {ours.describe()} with the example values, "
            f"{theirs.describe()} with other values"
        )
        return Finding(
            HazardKind.VALUE_DEPENDENT, ours.op, ours.location, FIX_VALUE_DEPENDENT, detail, theirs.location
        )
    if len(example) == len(other):
        return None
    longer, which = (example, "the example values") if len(example) > len(other) else (other, "other values")
    extra = longer[min(len(example), len(other))]
    detail = (
        f"{len(example)} ops ran with the example values, {len(other)} with other values; "
        f"the first extra op, with {which}: {extra.describe()}"
    )
    return Finding(HazardKind.VALUE_DEPENDENT, extra.op, extra.location, FIX_VALUE_DEPENDENT, detail)


def lint_step(
    step: Callable[..., Any],
    example_inputs: Sequence[Any],
    *,
    alt_inputs: Optional[Sequence[Any]] = None,
    target: Optional[str] = None,
    seed: int = 0,
) -> LintReport:
    """Report the capture hazards of `step(*example_inputs)`, run on CPU (or meta) tensors.

    `alt_inputs` replaces the auto-generated second set of inputs (same structure, shapes and
    dtypes, other values); pass it when the example's values don't bound valid values (e.g. a
    constant tensor, or indices that must be distinct across several inputs). Neither input set
    is modified. Raises `LintError` when the step raises or runs no tensor ops, `ValueError` on
    mismatched alt_inputs.
    """
    example = tuple(example_inputs)
    target = target or getattr(step, "__qualname__", repr(step))
    if alt_inputs is None:
        alternative = other_values(example, seed)
    else:
        alternative = tuple(alt_inputs)
        check_same_layout(example, alternative)
    first = _run(step, example, target, "the example inputs")
    if not first.trace and not first.ops_in_kernels:
        # Nothing ran, so nothing was checked: calling a generator function only builds the
        # generator. "No hazards" would be a verdict on code the linter never saw.
        raise LintError(target, "the step ran no tensor ops (a generator function, or a step that does nothing)")
    second = _run(step, alternative, target, "the other values")
    findings = dict(first.findings)
    for key, finding in second.findings.items():
        findings.setdefault(key, finding)
    divergence = _divergence(first.trace, second.trace)
    report = LintReport(
        target=target,
        findings=list(findings.values()),
        ops_recorded=len(first.trace),
        ran_kernels=first.ops_in_kernels > 0,
    )
    if divergence is not None:
        report.findings.append(divergence)
    return report
