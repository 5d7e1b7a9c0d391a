"""Run a step once under a `TorchFunctionMode` and a `TorchDispatchMode` together, recording
every hazard (with the user's source line) and the trace of aten ops with their output shapes.

The function mode sees the calls that never reach dispatch on CPU (`tolist`, a no-op `.cpu()`)
and names syncs the way the user wrote them (`Tensor.item`, not `_local_scalar_dense`); the
dispatch mode sees what indexing, `bool()` and `unique` become, and records the trace that
the linter compares across two runs.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from graphrelay.lint.hazards import EXEMPT, Hazard, aten_hazard, function_hazard, patched_calls
from graphrelay.lint.location import current_site
from graphrelay.lint.report import Finding, SourceLocation


@dataclass(frozen=True)
class TraceEntry:
    """One op as the step ran it: two runs of a capturable step give equal traces."""

    op: str
    output_shapes: tuple
    location: Optional[SourceLocation]

    def shapes_text(self) -> str:
        return ", ".join(str(list(s)) if isinstance(s, tuple) else s for s in self.output_shapes)

    def describe(self) -> str:
        return f"{self.op} -> {self.shapes_text()}" if self.output_shapes else self.op


@dataclass
class RunRecord:
    """Findings (each site once, first-seen order) and the op trace of one run."""

    findings: dict[tuple, Finding] = field(default_factory=dict)
    trace: list[TraceEntry] = field(default_factory=list)
    # Ops issued inside Triton kernel launches: not traced (the interpreter's, not the user's),
    # but proof that the step did run something.
    ops_in_kernels: int = 0
    # The torch function the step called that is running now (the function mode sees only the
    # outermost one), to name the call an aten op came from: `x[[0, 2]]` is `Tensor.__getitem__`.
    current_call: Optional[Callable] = None
    # >0 while a call already reported (or exempted) at function level runs, so the aten ops
    # it turns into (`item` -> `_local_scalar_dense`) are not reported a second time.
    _covered_depth: int = 0

    def report(self, hazard: Hazard, location: Optional[SourceLocation]) -> None:
        finding = Finding(kind=hazard.kind, op=hazard.op, location=location, fix=hazard.fix, detail=hazard.detail)
        self.findings.setdefault((hazard.kind, hazard.op, location), finding)

    @contextlib.contextmanager
    def covered(self) -> Iterator[None]:
        self._covered_depth += 1
        try:
            yield
        finally:
            self._covered_depth -= 1

    @property
    def is_covered(self) -> bool:
        return self._covered_depth > 0

    @contextlib.contextmanager
    def calling(self, func: Callable) -> Iterator[None]:
        outer, self.current_call = self.current_call, func
        try:
            yield
        finally:
            self.current_call = outer


def _output_shapes(out: Any) -> tuple:
    # Values never enter the trace (they differ by design between runs); shapes and the kind
    # of non-tensor result (e.g. the Python scalar of `_local_scalar_dense`) do.
    return tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in tree_leaves(out))


class _Recording:
    """Both modes write one run's record."""

    def __init__(self, record: RunRecord) -> None:
        super().__init__()
        self.record = record


class HazardFunctionMode(_Recording, TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with self.record.calling(func):
            hazard = function_hazard(func, args, kwargs)
            if hazard is None:
                return func(*args, **kwargs)
            site = current_site()
            if site.in_kernel_launch:
                return func(*args, **kwargs)
            if hazard is not EXEMPT:
                self.record.report(hazard, site.location)
                self.record.trace.append(TraceEntry(hazard.op, (), site.location))
            with self.record.covered():
                return func(*args, **kwargs)


class HazardDispatchMode(_Recording, TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        site = current_site()
        if site.in_kernel_launch:
            self.record.ops_in_kernels += 1
            return func(*args, **kwargs)
        hazard = aten_hazard(func, args, kwargs, self.record.current_call)
        if hazard is not None and not self.record.is_covered:
            # Reported before running: on meta tensors a sync raises, and the finding must stay.
            self.record.report(hazard, site.location)
        out = func(*args, **kwargs)
        self.record.trace.append(TraceEntry(str(func), _output_shapes(out), site.location))
        return out


def _recording_stand_in(original: Callable, hazard: Hazard, call_original: bool, record: RunRecord) -> Callable:
    @functools.wraps(original)
    def stand_in(*args, **kwargs):
        site = current_site()
        if not site.in_kernel_launch:
            record.report(hazard, site.location)
            record.trace.append(TraceEntry(hazard.op, (), site.location))
        if not call_original:
            return None
        # Its own aten ops (from_numpy's lift_fresh) are part of the hazard just reported.
        with record.covered():
            return original(*args, **kwargs)

    return stand_in


@contextlib.contextmanager
def _patched_host_calls(record: RunRecord) -> Iterator[None]:
    # NOTE: patches module and class attributes, so only calls looked up at call time
    # (`torch.cuda.synchronize()`) are seen, not a name imported into the user's module.
    originals = []
    try:
        for call in patched_calls():
            original = getattr(call.owner, call.name)
            originals.append((call.owner, call.name, original))
            setattr(call.owner, call.name, _recording_stand_in(original, call.hazard, call.call_original, record))
        yield
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)


def record_run(step: Callable[..., Any], inputs: Sequence[Any]) -> RunRecord:
    """Run `step(*inputs)` once under both modes. Inputs are used as given: clone them first."""
    record = RunRecord()
    with _patched_host_calls(record), HazardFunctionMode(record), HazardDispatchMode(record):
        step(*inputs)
    return record
