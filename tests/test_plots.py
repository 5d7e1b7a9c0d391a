"""Benchmark plots: every legend sits below its panel, no wider than it, so it neither covers
a line nor is cut off (loop_bench.png's four long labels in one row were both)."""

import pytest

from graphrelay.tools.bench import plots

LABELS = ("iteration (host, mean)", "CPU scheduling", "GPU step (decode)", "GPU busy (decode + prefills)")


@pytest.mark.parametrize("kind", ["bars", "lines"])
def test_legends_fit_under_their_panels(kind):
    import matplotlib.pyplot as plt

    if kind == "bars":
        panel = plots.BarPanel("tiny", "mode", "µs", ["eager", "no-overlap", "overlap"],
                               [plots.Bars(label, [2000.0, 600.0, 500.0]) for label in LABELS])
    else:
        panel = plots.Panel("plain fields", "batch size", "µs", [
            plots.Line(label, [1, 4, 16, 256], [100.0 / (i + 1)] * 4) for i, label in enumerate(LABELS)
        ] + [plots.Line("floor", [1, 256], [1.0, 1.0], dashed=True)], loglog=True)
    fig = plots.figure([panel, panel], "title")
    fig.canvas.draw()
    figure_box = fig.bbox
    for ax in fig.axes:
        legend, box = ax.get_legend().get_window_extent(), ax.get_window_extent()
        assert legend.x0 >= box.x0 - 1 and legend.x1 <= box.x1 + 1, "legend wider than its panel"
        assert legend.y1 <= box.y0, "legend overlaps the plotting area"
        assert legend.y0 >= figure_box.y0 and legend.x1 <= figure_box.x1, "legend cut off by the figure"
        assert box.width > 0.35 * figure_box.width, "panel squeezed"
    plt.close(fig)
