"""PNG plots of benchmark results (matplotlib, no display needed).

A figure is a row of panels; a panel is a set of named lines over a shared x axis. The relay
benchmark draws µs against batch size, log-log, one panel per field set; other benchmarks
pass their own panels.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Sequence


class Line(NamedTuple):
    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    dashed: bool = False  # for reference lines (a floor, a target) rather than measurements


class Panel(NamedTuple):
    title: str
    xlabel: str
    ylabel: str
    lines: Sequence[Line]
    loglog: bool = False


def save_panels(path: Path, panels: Sequence[Panel], title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # headless: CI and GPU machines have no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for line in panel.lines:
            ax.plot(line.xs, line.ys, linestyle="--" if line.dashed else "-",
                    marker=None if line.dashed else "o", markersize=3, label=line.label)
        if panel.loglog:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.xaxis.set_major_formatter(ScalarFormatter())  # 256, not 2^8
            ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.set_title(panel.title)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
