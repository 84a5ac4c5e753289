"""Sweep plots (matplotlib, Agg, files only): accuracy vs TPF per benchmark with AUP in the legend, and the
fig:train_infer_noise_activity panels C-E from engine traces.

Point labels are placed, not just offset: the configurations of one curve often sit a fraction of a TPF apart
(`singlebd` and `singlebd+tau_m2t=0.9`), where labels at one fixed offset print on top of each other. Each label
takes the first spot around its point, nearest first, whose box (as the renderer draws it) covers no other label,
no marker and stays inside the axes; one moved away from its point gets a leader line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mbd.eval.report import Report, active_counts, activity_profile, display, fmt, mask_ratios_by_rank

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.text import Annotation
    from matplotlib.transforms import Bbox

DPI = 120  # figures are laid out and labels placed at the resolution they are written with
LABEL_SIZE = 7  # points
GAP = 1.5  # points between a label and another label or a marker
# Candidate label offsets (points) around a point, nearest ring first; in each ring: up-right, up-left,
# down-right, down-left, right, left, up, down.
DIRECTIONS = ((1, 1), (-1, 1), (1, -1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1))
RINGS = (4.0, 10.0, 18.0, 28.0, 40.0)
ALIGN = {-1: ("right", "top"), 0: ("center", "center"), 1: ("left", "bottom")}
LEADER = {"arrowstyle": "-", "lw": 0.5, "alpha": 0.5, "shrinkA": 0, "shrinkB": 2}  # from a moved label to its point


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and in Ray workers
    import matplotlib.pyplot as plt

    return plt


def accuracy_vs_tpf_figure(report: Report) -> "Figure":
    """One panel per benchmark (plus the average when there are several); one line per AUP curve, each point
    labelled with its configuration, the legend under the panel."""
    plt = _pyplot()
    layout, by_cell = report.layout, {(c.model, c.config, c.benchmark): c for c in report.cells}
    panels = layout.benchmarks + (["Average"] if len(layout.benchmarks) > 1 else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False, dpi=DPI)
    for ax, panel in zip(axes[0], panels):
        for c in report.curves:
            rows = [r for r in layout.rows if r.section == c.section and r.curve == c.curve]
            pts = []
            for r in rows:
                cs = [by_cell.get((r.model, r.config, b)) for b in layout.benchmarks] if panel == "Average" \
                    else [by_cell.get((r.model, r.config, panel))]
                if all(x is not None for x in cs):
                    pts.append((float(np.mean([x.tpf for x in cs])), float(np.mean([x.accuracy for x in cs])),
                                r.config))
            if not pts:
                continue
            pts.sort()
            value = c.mean if panel == "Average" else c.per_benchmark.get(panel)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=f"{c.section}: {c.curve} (AUP {fmt(value)})")
            for x, y, name in pts:
                ax.annotate(name, (x, y), fontsize=LABEL_SIZE, alpha=0.8, textcoords="offset points",
                            xytext=(RINGS[0], RINGS[0]), ha="left", va="bottom", arrowprops=LEADER).set_in_layout(False)
        ax.margins(0.2)
        ax.set_title(display(panel))
        ax.set_xlabel("TPF")
        ax.set_ylabel("Accuracy (%)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=LABEL_SIZE, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    fig.tight_layout()  # labels are left out of the layout, so placing them below does not move the axes
    renderer = fig.canvas.get_renderer()
    for ax in axes[0]:
        place_labels(ax, renderer)
    return fig


def plot_accuracy_vs_tpf(report: Report, path: str | Path) -> Path:
    return _save(accuracy_vs_tpf_figure(report), path)


def point_labels(ax: "Axes") -> list["Annotation"]:
    from matplotlib.text import Annotation

    return [t for t in ax.texts if isinstance(t, Annotation)]


def place_labels(ax: "Axes", renderer) -> None:
    """Move each point label of `ax` to the nearest candidate spot whose box overlaps no placed label and no
    marker and lies inside the axes; where none is free, the spot that overlaps least."""
    from matplotlib.transforms import Bbox

    area, gap = ax.get_window_extent(renderer), GAP * ax.figure.dpi / 72
    markers = []
    for line in ax.get_lines():
        r = line.get_markersize() / 2 * ax.figure.dpi / 72 + gap
        markers += [Bbox.from_bounds(x - r, y - r, 2 * r, 2 * r) for x, y in ax.transData.transform(line.get_xydata())]
    spots = [(dx * ring, dy * ring, ALIGN[dx][0], ALIGN[dy][1]) for ring in RINGS for dx, dy in DIRECTIONS]
    placed: list[Bbox] = []
    for label in point_labels(ax):
        best: tuple[float, Bbox, tuple] | None = None
        for spot in spots:
            box = _try(label, spot, renderer)
            cost = sum(_overlap(box, b) for b in placed + markers) + _outside(box, area)
            if best is None or cost < best[0]:
                best = (cost, box, spot)
            if cost == 0:
                break
        _, box, spot = best  # type: ignore[misc]
        _try(label, spot, renderer)
        label.arrow_patch.set_visible(max(abs(spot[0]), abs(spot[1])) > RINGS[0])
        placed.append(box.padded(gap))


def label_box(label: "Annotation", renderer) -> "Bbox":
    """The label's text box in pixels (an Annotation's own extent also covers its leader line)."""
    from matplotlib.text import Text

    label.update_positions(renderer)
    return Text.get_window_extent(label, renderer)


def _try(label: "Annotation", spot: tuple, renderer) -> "Bbox":
    """Put `label` at `spot` = (dx, dy, ha, va) and measure its text box."""
    dx, dy, ha, va = spot
    label.xyann = (dx, dy)
    label.set_horizontalalignment(ha)
    label.set_verticalalignment(va)
    return label_box(label, renderer)


def _overlap(a: "Bbox", b: "Bbox") -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def _outside(box: "Bbox", area: "Bbox") -> float:
    return box.width * box.height - _overlap(box, area)


def plot_noise_activity(traces: Mapping[str, Sequence[Sequence[dict]]], path: str | Path, samples: int = 6,
                        seed: int = 0) -> Path:
    """fig:train_infer_noise_activity C-E, one row per traced (model, config): (C) mask-ratio distribution
    per active slot, (D) active-block count mean +- std over decoding progress, (E) sampled trajectories."""
    plt = _pyplot()
    rows = [(label, [t for t in ts if t]) for label, ts in traces.items()]
    rows = [(label, ts) for label, ts in rows if ts]
    if not rows:
        raise ValueError("no engine traces to plot: run the sweep with trace_problems > 0")
    fig, axes = plt.subplots(len(rows), 3, figsize=(13, 3.2 * len(rows)), squeeze=False, dpi=DPI)
    rng = np.random.default_rng(seed)
    edges = np.linspace(-0.025, 1.025, 22)  # 21 bins centred on multiples of 0.05 (mask ratios are k / B)
    centres, width = (edges[:-1] + edges[1:]) / 2, 0.9 * (edges[1] - edges[0])
    for (label, ts), (c, d, e) in zip(rows, axes):
        by_rank = mask_ratios_by_rank(ts)
        for rank, ratios in enumerate(by_rank):  # grouped bars: each active slot's share of forwards per bin
            share = np.histogram(ratios, bins=edges)[0] / len(ratios)
            c.bar(centres - width / 2 + (rank + 0.5) * width / len(by_rank), share, width=width / len(by_rank),
                  label=f"active slot {rank + 1} (n={len(ratios)})")
        c.set(title=f"(C) {label}: inference mask ratios", xlabel="mask ratio", ylabel="fraction of forwards")
        c.legend(fontsize=7)
        x, mean, std = activity_profile(ts)
        d.plot(x, mean, color="C0")
        d.fill_between(x, mean - std, mean + std, color="C0", alpha=0.25)
        d.set(title="(D) active blocks: mean ± std", xlabel="decoding progress", ylabel="active blocks")
        for i in rng.choice(len(ts), size=min(samples, len(ts)), replace=False):
            d_counts = active_counts(ts[i])
            e.step(range(1, len(d_counts) + 1), d_counts, where="mid", alpha=0.8)
        e.set(title="(E) sampled trajectories", xlabel="forward pass", ylabel="active blocks")
        for ax in (c, d, e):
            ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig: "Figure", path: str | Path) -> Path:
    """Write the figure (its layout already done) and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
