"""What the linter found: hazard kinds, findings with the user's source line, and the report.

A finding names the op, where the user's code triggered it (file:line and the line itself) and
a one-line fix, so a person can act on it without rerunning anything.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Optional


class HazardKind(str, enum.Enum):
    """Why an op breaks (or silently corrupts) a CUDA graph capture."""

    # The host waits for the device (item, bool(), tolist, .cpu(), synchronize): capture fails.
    HOST_SYNC = "host-sync"
    # The output's shape depends on tensor values (nonzero, boolean masks, unique): a graph
    # replays fixed shapes, and on CUDA these ops sync to learn the size.
    DATA_DEPENDENT_SHAPE = "data-dependent-shape"
    # A tensor built from Python data inside the step: capture bakes the values in forever.
    PYTHON_DATA_TENSOR = "python-data-tensor"
    # Different input values led to different ops, shapes or source lines: a replay would run
    # the branch that was captured, whatever the new values say.
    VALUE_DEPENDENT = "value-dependent"


@dataclass(frozen=True)
class SourceLocation:
    """A line of the user's code: the innermost frame outside torch and the linter."""

    filename: str
    lineno: int
    function: str
    line: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno}"


@dataclass(frozen=True)
class Finding:
    """One capture hazard. `other_location` is set for value-dependent divergences only:
    where the run on the other values went instead of `location`."""

    kind: HazardKind
    op: str
    location: Optional[SourceLocation]
    fix: str
    detail: str = ""
    other_location: Optional[SourceLocation] = None

    def format(self) -> str:
        where = str(self.location) if self.location else "<unknown location>"
        lines = [f"{where}: {self.kind.value}: {self.op}"]
        if self.detail:
            lines.append(f"    {self.detail}")
        lines.extend(_quoted_source("example values", self.location, bool(self.other_location)))
        if self.other_location:
            lines.extend(_quoted_source("other values", self.other_location, True))
        lines.append(f"    fix: {self.fix}")
        return "\n".join(lines)


def _quoted_source(label: str, location: Optional[SourceLocation], labelled: bool) -> list[str]:
    if location is None:
        return []
    if not labelled:
        return [f"    | {location.line}"]
    return [f"    {label}: {location}", f"    | {location.line}"]


@dataclass
class LintReport:
    """Findings for one step, in the order first seen, each hazard site reported once."""

    target: str
    findings: list[Finding] = field(default_factory=list)
    ops_recorded: int = 0
    # Whether Triton kernels ran: their launches are checked as one op each on the GPU, so
    # their bodies are not looked into, and a step of launches alone records no ops.
    ran_kernels: bool = False

    @property
    def ok(self) -> bool:
        return not self.findings

    def kinds(self) -> list[HazardKind]:
        return [f.kind for f in self.findings]

    def summary(self) -> str:
        if self.ok:
            kernels = ", plus Triton kernel launches" if self.ran_kernels else ""
            return f"{self.target}: capturable, no hazards ({self.ops_recorded} ops checked{kernels})"
        counts: dict[str, int] = {}
        for finding in self.findings:
            counts[finding.kind.value] = counts.get(finding.kind.value, 0) + 1
        by_kind = ", ".join(f"{n} {kind}" for kind, n in counts.items())
        noun = "hazard" if len(self.findings) == 1 else "hazards"
        return f"{self.target}: {len(self.findings)} capture {noun} ({by_kind})"

    def format(self) -> str:
        return "\n\n".join([f.format() for f in self.findings] + [self.summary()])

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data: how a linter subprocess hands its report back to the command."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LintReport":
        def location(raw: Optional[dict]) -> Optional[SourceLocation]:
            return SourceLocation(**raw) if raw is not None else None

        findings = [
            Finding(
                kind=HazardKind(f["kind"]),
                op=f["op"],
                location=location(f["location"]),
                fix=f["fix"],
                detail=f["detail"],
                other_location=location(f["other_location"]),
            )
            for f in data["findings"]
        ]
        return cls(
            target=data["target"], findings=findings, ops_recorded=data["ops_recorded"], ran_kernels=data["ran_kernels"]
        )
