"""Sweep reports: the paper's tables (tab:main_results, tab:tps_comparison) and plots, from per-problem records.

- Main table: one row per (model, decoding configuration), grouped in sections (the paper groups a base model's
  SingleBD / MultiBD rows with its MBD-* model); Acc and TPF per benchmark, their means over benchmarks, and
  the AUP of the row's curve. By default every (model, method) row is its own curve (the paper gives each
  row its own AUP): the row's operating point plus the hidden points of its threshold grid (`sweep:` of the
  decoding entry in the sweep YAML). An explicit `curve:` name joins rows of a section into one curve. The
  AUP is `metrics.aup` (the paper's trapezoids) over the curve's (TPF, Acc) points per benchmark, averaged over
  benchmarks (`metrics.mean_aup`); beside it `metrics.aup_d3llm`, with y_max the best accuracy of the
  section on that benchmark (d3LLM passes the best accuracy of the compared methods). A curve of one point has
  no AUP ("–"). The paper's per-row values cannot be reproduced exactly: the threshold sweeps behind them are
  not documented.
- Throughput table: average TPF, step latency, TPS per benchmark, gains against the section's first row, and the
  prefix-cache hit rate (prompt tokens served from cached pages over those looked up, from the engine's counters
  over every decoded unit of the cell; averaged over benchmarks). Few-shot entries (`fewshot: k`) share their
  exemplars' prefix across problems, which is where the rate is high; their columns are titled e.g. GSM8K (8shot).
- Plots (`mbd.eval.plots`, which read these tables): accuracy vs TPF per benchmark with AUP in the legend, and
  the fig:train_infer_noise_activity panels C-E from engine traces; `mbd.eval.sweep_report` writes both to disk.
- Method rows (`mbd quickstart`, `mbd reproduce`): one row per method, the AUP of its curve. Paired
  comparisons and the paper's claims judged from the same records: `mbd.eval.claims`.

TPS is generated tokens / request latency summed over problems (metrics.summarize), i.e. per-request speed:
with batch_size 1 it is the paper's single-sample TPS. Step latency is the NFE-weighted mean of the engine's
per-request step latency (decode forwards only, no prefill, no queueing).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from pydantic import BaseModel, Field

from mbd.eval.metrics import AupPoint, GenerationRecord, aup, aup_d3llm, mean_aup, summarize
from mbd.eval.sweep import ItemRecord, PrefixCacheRecord, SweepConfig
from mbd.eval.timing import TpsStat

DISPLAY = {"gsm8k": "GSM8K", "math500": "MATH500", "mbpp_plus": "MBPP+", "humaneval_plus": "HumanEval+",
           "humaneval": "HumanEval", "tinymath": "tinymath"}
NONE = "–"


def display(label: str) -> str:
    """A benchmark entry's title: `gsm8k` -> GSM8K, `gsm8k+8shot` -> GSM8K (8shot)."""
    name, _, mode = label.partition("+")
    return DISPLAY.get(name, name) + (f" ({mode.replace('+', ', ')})" if mode else "")


class CellMetrics(BaseModel):
    """Aggregates of one (model, config, benchmark) cell."""

    model: str
    config: str
    benchmark: str
    n: int
    accuracy: float = Field(description="percent")
    tpf: float
    tps: float
    step_latency_ms: float
    prefix_hit_rate: float | None = Field(None, description="prefix-cache hit tokens / looked-up prompt tokens over "
                                                            "the cell's decoded units; None: no lookups stored")


class Row(BaseModel):
    model: str
    config: str
    section: str
    curve: str
    shown: bool = Field(True, description="False for the hidden sweep points of another row's curve")

    @property
    def label(self) -> str:
        return row_label(self.model, self.config, self.section)


def row_label(model: str, config: str, section: str) -> str:
    return config if section == model else f"{model} / {config}"


class Layout(BaseModel):
    """Table order: rows (grouped by section in first-appearance order) and benchmark columns."""

    rows: list[Row]
    benchmarks: list[str]

    @classmethod
    def from_sweep(cls, cfg: SweepConfig) -> "Layout":
        return cls(rows=[Row(model=m.name, config=d.name, section=m.table_section,
                             curve=d.curve or default_curve(m.name, d.point_of or d.name), shown=d.point_of is None)
                         for m, d in cfg.pairs()], benchmarks=[b.label for b in cfg.benchmarks])

    @classmethod
    def from_cells(cls, metrics: Sequence[CellMetrics]) -> "Layout":
        """One section per model, one curve per (model, config), in the order the cells come."""
        rows = list(dict.fromkeys((c.model, c.config) for c in metrics))
        return cls(rows=[Row(model=m, config=c, section=m, curve=default_curve(m, c)) for m, c in rows],
                   benchmarks=list(dict.fromkeys(c.benchmark for c in metrics)))

    def sections(self) -> dict[str, list[Row]]:
        out: dict[str, list[Row]] = {}
        for r in self.rows:
            out.setdefault(r.section, []).append(r)
        return out


def default_curve(model: str, config: str) -> str:
    """The curve of a (model, method) row that names none."""
    return f"{model}:{config}"


class CurveAUP(BaseModel):
    section: str
    curve: str
    configs: list[str]
    per_benchmark: dict[str, float | None]
    mean: float | None
    per_benchmark_d3llm: dict[str, float | None]
    mean_d3llm: float | None


class Report(BaseModel):
    layout: Layout
    cells: list[CellMetrics]
    curves: list[CurveAUP]
    main_table: str
    aup_table: str
    tps_table: str

    def markdown(self, title: str = "Evaluation sweep") -> str:
        counts = {}
        for b in self.layout.benchmarks:
            ns = sorted({c.n for c in self.cells if c.benchmark == b})
            counts[b] = "0" if not ns else str(ns[0]) if len(ns) == 1 else f"{ns[0]}-{ns[-1]}"
        n_line = ", ".join(f"{display(b)} {n}" for b, n in counts.items())
        return (f"# {title}\n\nProblems per benchmark: {n_line}.\n\n## Accuracy, TPF and AUP (tab:main_results)\n\n"
                f"{self.main_table}\n\n## AUP per curve\n\n{self.aup_table}\n\n"
                f"## Throughput (tab:tps_comparison)\n\n{self.tps_table}\n")


# ---------------------------------------------------------------------------------------------- numbers


def aggregate(records: Iterable[ItemRecord],
              prefix_cache: Mapping[tuple[str, str, str], Sequence[PrefixCacheRecord]] | None = None
              ) -> list[CellMetrics]:
    """Per (model, config, benchmark): accuracy (%), TPF (ratio of sums), TPS, step latency, and the prefix-cache
    hit rate of the cell's stored lookups (0 when they looked nothing up); first-seen order."""
    groups: dict[tuple[str, str, str], list[ItemRecord]] = {}
    for r in records:
        groups.setdefault((r.model, r.config, r.benchmark), []).append(r)
    out = []
    for (model, config, bench), rs in groups.items():
        m = summarize([GenerationRecord(correct=r.correct, generated_tokens=r.num_generated, nfe=r.nfe,
                                        wall_s=r.wall_time_s) for r in rs])
        nfe = sum(r.nfe for r in rs)
        lat = sum(r.step_latency_ms * r.nfe for r in rs) / nfe if nfe else 0.0
        lookups = (prefix_cache or {}).get((model, config, bench))
        hit_rate = None
        if lookups:
            query = sum(u.query_tokens for u in lookups)
            hit_rate = sum(u.hit_tokens for u in lookups) / query if query else 0.0
        out.append(CellMetrics(model=model, config=config, benchmark=bench, n=m.n, accuracy=m.accuracy, tpf=m.tpf,
                               tps=m.tps, step_latency_ms=lat, prefix_hit_rate=hit_rate))
    return out


def _mean(xs: Sequence[float | None]) -> float | None:
    return None if not xs or any(x is None for x in xs) else sum(xs) / len(xs)  # type: ignore[arg-type]


def fmt(x: float | None, spec: str = ".2f") -> str:
    return NONE if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def curve_aups(layout: Layout, by_cell: Mapping[tuple[str, str, str], CellMetrics]) -> list[CurveAUP]:
    out = []
    for section, rows in layout.sections().items():
        y_max = {b: max((c.accuracy for r in rows if (c := by_cell.get((r.model, r.config, b)))), default=0.0)
                 for b in layout.benchmarks}
        for curve in dict.fromkeys(r.curve for r in rows):
            members = [r for r in rows if r.curve == curve]
            points: dict[str, list[AupPoint]] = {}
            per: dict[str, float | None] = {}
            d3: dict[str, float | None] = {}
            for b in layout.benchmarks:
                cs = [by_cell.get((r.model, r.config, b)) for r in members]
                if len(members) >= 2 and all(c is not None and c.tpf > 0 for c in cs):
                    points[b] = [AupPoint(tpf=c.tpf, accuracy=c.accuracy) for c in cs]  # type: ignore[union-attr]
                    per[b] = aup(points[b])
                    d3[b] = aup_d3llm(points[b], y_max=y_max[b]) if y_max[b] > 0 else None
                else:
                    per[b] = d3[b] = None
            complete = bool(points) and len(points) == len(layout.benchmarks)
            mean = mean_aup(points) if complete else None
            mean_d3 = _mean(list(d3.values())) if complete else None
            out.append(CurveAUP(section=section, curve=curve, configs=[r.label for r in members], per_benchmark=per,
                                mean=mean, per_benchmark_d3llm=d3, mean_d3llm=mean_d3))
    return out


def build_report(metrics: Sequence[CellMetrics], layout: Layout | None = None) -> Report:
    layout = layout or Layout.from_cells(metrics)
    by_cell = {(c.model, c.config, c.benchmark): c for c in metrics}
    curves = curve_aups(layout, by_cell)
    curve_of = {(c.section, c.curve): c for c in curves}
    benches = layout.benchmarks
    names = [display(b) for b in benches]

    main_rows, aup_rows, tps_rows = [], [], []
    for section, rows in layout.sections().items():
        main_rows.append([f"**{section}**"] + [""] * (2 * len(benches) + 4))
        tps_rows.append([f"**{section}**"] + [""] * (len(benches) + 7))
        base: tuple[float | None, float | None, float | None] | None = None
        for r in (r for r in rows if r.shown):
            cs = [by_cell.get((r.model, r.config, b)) for b in benches]
            acc = [c.accuracy if c else None for c in cs]
            tpf = [c.tpf if c else None for c in cs]
            curve = curve_of[(section, r.curve)]
            main_rows.append([r.label] + [fmt(x) for pair in zip(acc, tpf) for x in pair]
                             + [fmt(_mean(acc)), fmt(_mean(tpf)), fmt(curve.mean), fmt(curve.mean_d3llm)])
            avg_tpf, lat = _mean(tpf), _mean([c.step_latency_ms if c else None for c in cs])
            tps = [c.tps if c else None for c in cs]
            avg_tps = _mean(tps)
            if base is None:
                base = (avg_tpf, lat, avg_tps)
                gains = ["--", "1.00×", "--"]
            else:
                gains = [_gain(avg_tpf, base[0]), _ratio(lat, base[1]), _gain(avg_tps, base[2])]
            hit = _mean([c.prefix_hit_rate if c else None for c in cs])
            tps_rows.append([r.label, fmt(avg_tpf), gains[0], fmt(lat), gains[1]] + [fmt(x) for x in tps]
                            + [fmt(avg_tps), gains[2], fmt(None if hit is None else 100 * hit, ".1f")])
    for c in curves:
        aup_rows.append([c.section, c.curve, ", ".join(c.configs)] + [fmt(c.per_benchmark[b]) for b in benches]
                        + [fmt(c.mean)] + [fmt(c.per_benchmark_d3llm[b]) for b in benches] + [fmt(c.mean_d3llm)])
    main = markdown_table(["Model"] + [f"{n} {k}" for n in names for k in ("Acc", "TPF")]
                          + ["Avg Acc", "Avg TPF", "AUP", "AUP (d3LLM)"], main_rows)
    aup_table = markdown_table(["Section", "Curve", "Configurations"] + [f"{n} AUP" for n in names] + ["Avg AUP"]
                               + [f"{n} AUP (d3LLM)" for n in names] + ["Avg AUP (d3LLM)"], aup_rows)
    tps_table = markdown_table(["Model", "Avg TPF", "TPF Gain", "Step Lat. (ms)", "Lat. Cost"]
                               + [f"{n} TPS" for n in names] + ["Avg TPS", "TPS Gain", "Prefix Hit (%)"], tps_rows)
    return Report(layout=layout, cells=list(metrics), curves=curves, main_table=main, aup_table=aup_table,
                  tps_table=tps_table)


def _gain(x: float | None, base: float | None) -> str:
    return NONE if x is None or not base else f"{100 * (x / base - 1):+.2f}%"


def _ratio(x: float | None, base: float | None) -> str:
    return NONE if x is None or not base else f"{x / base:.2f}×"


# ------------------------------------------------------------------------------------------ trace stats


def active_counts(trace: Sequence[dict]) -> list[int]:
    """Active blocks (ACTIVE slots of the Block Buffer) at each forward of one request."""
    return [sum(s == "ACTIVE" for s in e["states"]) for e in trace]


def mask_ratios_by_rank(traces: Iterable[Sequence[dict]]) -> list[list[float]]:
    """Mask ratios as fed to the model, by rank among the active slots (first active slot = rank 0)."""
    out: list[list[float]] = []
    for trace in traces:
        for e in trace:
            for rank, r in enumerate(x for x in e["mask_ratio"] if x is not None):
                while len(out) <= rank:
                    out.append([])
                out[rank].append(r)
    return out


def activity_profile(traces: Iterable[Sequence[dict]], bins: int = 20) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean and std of the active-block count over normalised decoding progress ((t + 0.5) / T, in `bins`
    equal bins); empty bins are NaN. Returns (bin centres, mean, std)."""
    per_bin: list[list[int]] = [[] for _ in range(bins)]
    for trace in traces:
        counts = active_counts(trace)
        for t, k in enumerate(counts):
            per_bin[min(int((t + 0.5) / len(counts) * bins), bins - 1)].append(k)
    mean = np.array([np.mean(v) if v else np.nan for v in per_bin])
    std = np.array([np.std(v) if v else np.nan for v in per_bin])
    return (np.arange(bins) + 0.5) / bins, mean, std


# ------------------------------------------------------------------------------------------ sweep output


class SweepSummary(BaseModel):
    """What `run_sweep` returns: where the report is, the main table, and the per-cell aggregates."""

    output_dir: str
    report_path: str
    parquet_path: str
    table_markdown: str = Field(description="the tab:main_results-style table")
    report_markdown: str
    plots: list[str]
    cells: list[CellMetrics]
    decoded: int = Field(description="problems decoded by this run")
    skipped: int = Field(description="problems found already stored (resume)")
    wall_s: float


# ---------------------------------------------------------------------------------------------- methods
# What `mbd quickstart` and `mbd reproduce` show: one row per method (a model under one decode config whose
# curve points are other thresholds of that config). Paired comparisons and claims: `mbd.eval.claims`.


class MethodRow(BaseModel):
    """One row of a tab:main_results-style table: the operating point and the AUP of its curve."""

    method: str
    model: str
    config: str
    n: int
    accuracy: float
    tpf: float
    tps: float = Field(description="the sweep cell's TPS, timed whenever its worker ran it (rows not comparable)")
    aup: float | None
    curve: list[tuple[float, float]] = Field(description="(TPF, Acc) of every curve point")
    tps_timed: dict[int, TpsStat] = Field(default={}, description="TPS measured side by side (mbd.eval.timing), "
                                          "per batch size (requests decoded together)")


class Method(BaseModel):
    """A method to report: `configs` are the sweep's config names of its curve points, the first the operating
    point."""

    label: str
    model: str
    configs: list[str] = Field(min_length=1)


def method_rows(cells: Sequence[CellMetrics], methods: Sequence[Method], benchmark: str) -> list[MethodRow]:
    by = {(c.model, c.config): c for c in cells if c.benchmark == benchmark}
    rows = []
    for m in methods:
        missing = [c for c in m.configs if (m.model, c) not in by]
        if missing:
            raise RuntimeError(f"the sweep stored no {benchmark} results for {m.model} / {missing}")
        pts = [by[(m.model, c)] for c in m.configs]
        curve = [(p.tpf, p.accuracy) for p in pts]
        area = aup([AupPoint(tpf=t, accuracy=a) for t, a in curve]) if len(pts) > 1 and min(curve)[0] > 0 else None
        op = pts[0]
        rows.append(MethodRow(method=m.label, model=m.model, config=m.configs[0], n=op.n, accuracy=op.accuracy,
                              tpf=op.tpf, tps=op.tps, aup=area, curve=curve))
    return rows


def method_table(rows: Sequence[MethodRow], section: str, benchmark: str) -> str:
    """Markdown in tab:main_results' layout for one benchmark (its columns are also the average). The TPS columns
    (one per batch size) are printed only when every row's TPS was measured side by side at the same batch sizes
    (median, min-max over rounds): per-cell sweep TPS is timed at different moments of the machine and cannot be
    compared across rows."""
    name = display(benchmark)
    batches = sorted(rows[0].tps_timed) if rows else []
    timed = bool(batches) and all(sorted(r.tps_timed) == batches for r in rows)
    tps_head = [f"TPS ↑ at batch {b} (median, min-max)" for b in batches] if timed else []
    head = ["Model", f"{name} Acc ↑", f"{name} TPF ↑"] + tps_head + ["AUP ↑"]
    body = [[f"***{section}***"] + [""] * (len(head) - 1)]
    for r in rows:
        tps = [f"{t.median:.1f} ({t.low:.1f}-{t.high:.1f})" for t in (r.tps_timed[b] for b in batches)] if timed else []
        body.append([r.method, fmt(r.accuracy), fmt(r.tpf)] + tps + [fmt(r.aup)])
    return markdown_table(head, body)
