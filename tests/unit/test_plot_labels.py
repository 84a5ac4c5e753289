"""The accuracy-vs-TPF plot's point labels, measured as the renderer draws them: configurations a few hundredths of
a TPF apart (`singlebd` and `singlebd+tau_m2t=0.9`) get labels that overlap no other label, no marker and no
legend, and stay inside their panel."""

import itertools

import pytest

from mbd.eval.plots import DPI, accuracy_vs_tpf_figure, label_box, point_labels
from mbd.eval.report import CellMetrics, Layout, Row, build_report

# (model, config, curve): {benchmark: (tpf, accuracy)}; most configs crowd two corners of the panel
POINTS = {
    ("SDAR-8B", "singlebd", "sdar"): {"gsm8k": (1.00, 89.1), "math500": (1.00, 61.2)},
    ("SDAR-8B", "singlebd+tau_m2t=0.9", "sdar"): {"gsm8k": (1.04, 88.9), "math500": (1.03, 61.0)},
    ("SDAR-8B", "singlebd+tau_m2t=0.8", "sdar"): {"gsm8k": (1.09, 88.6), "math500": (1.07, 60.7)},
    ("MBD-8B", "multibd", "mbd"): {"gsm8k": (2.61, 88.7), "math500": (2.32, 60.9)},
    ("MBD-8B", "multibd+tau_add=0.3", "mbd"): {"gsm8k": (2.66, 88.5), "math500": (2.36, 60.8)},
    ("MBD-8B", "multibd+tau_add=0.5", "mbd"): {"gsm8k": (2.70, 88.8), "math500": (2.41, 61.1)},
    ("MBD-8B", "multibd+tau_add=0.9", "mbd"): {"gsm8k": (4.12, 79.3), "math500": (3.65, 49.8)},
}


def crowded_report():
    cells = [CellMetrics(model=m, config=c, benchmark=b, n=100, accuracy=acc, tpf=tpf, tps=10.0, step_latency_ms=5.0)
             for (m, c, _), per in POINTS.items() for b, (tpf, acc) in per.items()]
    rows = [Row(model=m, config=c, section="SDAR-8B", curve=curve) for m, c, curve in POINTS]
    return build_report(cells, Layout(rows=rows, benchmarks=["gsm8k", "math500"]))


def _overlap(a, b) -> bool:
    return min(a.x1, b.x1) > max(a.x0, b.x0) and min(a.y1, b.y1) > max(a.y0, b.y0)


def _inside(box, area) -> bool:
    return area.x0 <= box.x0 and box.x1 <= area.x1 and area.y0 <= box.y0 and box.y1 <= area.y1


@pytest.fixture
def figure():
    """The figure as it is written (placed and drawn at the file's dpi)."""
    import matplotlib.pyplot as plt

    fig = accuracy_vs_tpf_figure(crowded_report())
    assert fig.dpi == DPI
    fig.canvas.draw()
    yield fig
    plt.close(fig)


def test_labels_at_one_fixed_offset_would_overlap(figure):
    """The case is a real one: the old placement (every label 3 points up-right of its point) overlaps."""
    renderer = figure.canvas.get_renderer()
    ax = figure.axes[0]
    for label in point_labels(ax):
        label.xyann = (3, 3)
        label.set_horizontalalignment("left")
        label.set_verticalalignment("baseline")
    boxes = [label_box(label, renderer) for label in point_labels(ax)]
    assert any(_overlap(a, b) for a, b in itertools.combinations(boxes, 2))


def test_no_label_overlaps_another_a_marker_or_the_legend(figure):
    renderer = figure.canvas.get_renderer()
    assert len(figure.axes) == 3  # gsm8k, math500, Average
    for ax in figure.axes:
        labels = point_labels(ax)
        assert sorted(t.get_text() for t in labels) == sorted(c for _, c, _ in POINTS)
        boxes = [label_box(t, renderer) for t in labels]
        for (i, a), (j, b) in itertools.combinations(enumerate(boxes), 2):
            assert not _overlap(a, b), f"{ax.get_title()}: '{labels[i].get_text()}' overlaps '{labels[j].get_text()}'"
        area = ax.get_window_extent(renderer)
        legend = ax.get_legend().get_window_extent(renderer)
        points = [ax.transData.transform(xy) for line in ax.get_lines() for xy in line.get_xydata()]
        assert len(points) == len(POINTS)
        for label, box in zip(labels, boxes):
            assert _inside(box, area), f"{ax.get_title()}: '{label.get_text()}' leaves its panel"
            assert not _overlap(box, legend)
            assert not any(box.x0 <= x <= box.x1 and box.y0 <= y <= box.y1 for x, y in points), \
                f"{ax.get_title()}: '{label.get_text()}' covers a marker"
