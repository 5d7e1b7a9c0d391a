"""PNG plots of benchmark results (matplotlib, no display needed).

A figure is a grid of panels of two kinds. A `Panel` is a set of named lines over a shared
numeric x axis (the relay benchmark: µs against batch size, log-log). A `BarPanel` is grouped
bars over named categories (the loop benchmark: one group per mode; the end-to-end benchmark:
one group per batch size, one bar per system), for comparisons where the x values are labels
rather than a scale.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple, Optional, Sequence, Union


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
    logy: bool = False
    # Names of the points x = 0, 1, ...: for x values that are no scale (a sweep of request
    # rates ending in "all at once"). The lines' xs are then those positions.
    xticklabels: Optional[Sequence[str]] = None


class Bars(NamedTuple):
    """One series of a `BarPanel`: a value per category, None where nothing was measured (no
    bar is drawn, so a missing system is not mistaken for a zero)."""

    label: str
    values: Sequence[Optional[float]]
    reference: bool = False  # drawn as a dashed line across each group (a floor), not as a bar


class BarPanel(NamedTuple):
    title: str
    xlabel: str
    ylabel: str
    categories: Sequence[str]
    series: Sequence[Bars]
    logy: bool = False


GROUP_WIDTH = 0.8  # of the 1.0 between category centres; the rest separates the groups


def figure(panels: Sequence[Union[Panel, BarPanel]], title: str, columns: Optional[int] = None):
    """The matplotlib Figure: panels left to right, wrapping after `columns` (default: one row)."""
    import matplotlib

    matplotlib.use("Agg")  # headless: CI and GPU machines have no display
    import matplotlib.pyplot as plt

    columns = columns or len(panels)
    rows = -(-len(panels) // columns)
    # Constrained layout makes room for the legends below each panel (tight_layout does not).
    fig, axes = plt.subplots(rows, columns, figsize=(6.4 * columns, 5.4 * rows), squeeze=False, layout="constrained")
    for ax, panel in zip(axes.flat, panels):
        if isinstance(panel, BarPanel):
            _draw_bars(ax, panel)
        else:
            _draw_lines(ax, panel)
        ax.set_title(panel.title)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)  # the grid's unused cells
    fig.suptitle(title)
    return fig


def save_panels(path: Path, panels: Sequence[Union[Panel, BarPanel]], title: str, columns: Optional[int] = None) -> Path:
    import matplotlib.pyplot as plt

    fig = figure(panels, title, columns)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _draw_lines(ax, panel: Panel) -> None:
    from matplotlib.ticker import ScalarFormatter

    for line in panel.lines:
        ys = [math.nan if y is None else y for y in line.ys]  # a gap where nothing was measured
        ax.plot(line.xs, ys, linestyle="--" if line.dashed else "-",
                marker=None if line.dashed else "o", markersize=3, label=line.label)
    if panel.loglog:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())  # 256, not 2^8
        ax.yaxis.set_major_formatter(ScalarFormatter())
    elif panel.logy:
        ax.set_yscale("log")
    if panel.xticklabels is not None:
        ax.set_xticks(range(len(panel.xticklabels)), list(panel.xticklabels))
    ax.grid(True, which="both", alpha=0.3)
    _legend_below(ax)


def _draw_bars(ax, panel: BarPanel) -> None:
    for series in panel.series:
        if len(series.values) != len(panel.categories):
            raise ValueError(f"bar series {series.label!r} has {len(series.values)} values for "
                             f"{len(panel.categories)} categories in panel {panel.title!r}")
    bars = [s for s in panel.series if not s.reference]
    width = GROUP_WIDTH / max(1, len(bars))
    centres = range(len(panel.categories))
    for i, series in enumerate(bars):
        offset = (i - (len(bars) - 1) / 2) * width
        heights = [math.nan if v is None else v for v in series.values]
        drawn = ax.bar([c + offset for c in centres], heights, width, label=series.label)
        # The value on each bar: log axes make heights hard to read off.
        ax.bar_label(drawn, labels=["" if v is None else _short(v) for v in series.values],
                     fontsize="x-small", rotation=90, padding=2)
    for series in (s for s in panel.series if s.reference):
        points = [(c, v) for c, v in zip(centres, series.values) if v is not None]
        ax.hlines([v for _, v in points], [c - GROUP_WIDTH / 2 for c, _ in points],
                  [c + GROUP_WIDTH / 2 for c, _ in points], colors="black", linestyles="--", label=series.label)
    ax.set_xticks(list(centres), list(panel.categories))
    top = max((v for s in panel.series for v in s.values if v is not None), default=0.0)
    if panel.logy and top > 0:  # a log axis with nothing on it cannot place its ticks
        ax.set_yscale("log")
    if top > 0:  # headroom above the tallest bar for its value label
        ax.set_ylim(top=top * (10 if panel.logy else 1.15))
    ax.grid(True, axis="y", which="both", alpha=0.3)
    _legend_below(ax)


def _legend_below(ax) -> None:
    """The legend under the panel, two entries a row: inside it covered lines, and one row of
    four long labels was wider than the panel (cut off, and the panel squeezed to make room)."""
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14),
              ncols=min(2, len(labels)), frameon=False)


def _short(value: float) -> str:
    """A bar's label: 3 significant digits, without exponents for the large numbers (tokens/s)."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
