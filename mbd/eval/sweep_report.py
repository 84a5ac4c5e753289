"""Writing a sweep's report: its stored records read back, then report.md, records.parquet, summary.json and the
plots under the output directory. Apart from `mbd.eval.report` (the tables, which the plots read) so that the
plots and the tables do not import each other."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from mbd.eval.benchmarks import Problem
from mbd.eval.plots import plot_accuracy_vs_tpf, plot_noise_activity
from mbd.eval.report import Layout, SweepSummary, aggregate, build_report, row_label
from mbd.eval.sweep import ItemRecord, PrefixCacheRecord, ResultStore, SweepConfig, cells, write_parquet


def write_sweep_report(cfg: SweepConfig, problems: Mapping[str, Sequence[Problem]], decoded: int = 0,
                       skipped: int = 0, wall_s: float = 0.0) -> SweepSummary:
    """Read the sweep's stored records (only the current problem ids of its cells), then write report.md,
    records.parquet, summary.json and plots/ under the output directory."""
    store, out = ResultStore(cfg.output_dir), Path(cfg.output_dir)
    records: list[ItemRecord] = []
    traces: dict[str, list[list[dict]]] = {}
    lookups: dict[tuple[str, str, str], list[PrefixCacheRecord]] = {}
    for cell in cells(cfg):
        ids = [p.problem_id for p in problems[cell.benchmark]]
        stored = store.load(cell.model.name, cell.decode.name, cell.benchmark)
        records += [stored[i] for i in ids if i in stored]
        current = set(ids)  # the units that decoded any of the current problems
        lookups[(cell.model.name, cell.decode.name, cell.benchmark)] = [
            u for u in store.load_prefix_cache(cell.model.name, cell.decode.name, cell.benchmark)
            if current.intersection(u.problem_ids)]
        label = row_label(cell.model.name, cell.decode.name, cell.model.table_section)
        kept = store.load_traces(cell.model.name, cell.decode.name, cell.benchmark)
        traces.setdefault(label, []).extend(kept[i] for i in ids if i in kept)

    report = build_report(aggregate(records, lookups), Layout.from_sweep(cfg))
    report_md = report.markdown(f"Evaluation sweep `{cfg.name}`")
    report_path = out / "report.md"
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(report_md)
    plots = [str(plot_accuracy_vs_tpf(report, out / "plots" / "accuracy_vs_tpf.png"))]
    if any(traces.values()):
        plots.append(str(plot_noise_activity(traces, out / "plots" / "noise_activity.png")))
    summary = SweepSummary(output_dir=str(out), report_path=str(report_path),
                           parquet_path=str(write_parquet(records, out / "records.parquet")),
                           table_markdown=report.main_table, report_markdown=report_md, plots=plots,
                           cells=report.cells, decoded=decoded, skipped=skipped, wall_s=wall_s)
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary.model_dump(), indent=2))
    os.replace(tmp, out / "summary.json")
    return summary
