"""`mbd reproduce`: the paper's qualitative claims, re-measured on the embedded tiny model (18 minutes with 300
training steps, about 35 with the default 800, on 2 CPU cores; docs/reproduce.md holds the last measured report).

    mbd reproduce                                      # all parts -> runs/reproduce/reproduce.md
    mbd reproduce --parts core                         # claims (a), (b), (c), (f) only
    mbd reproduce --parts schedulers --steps 150       # claim (d); reuses what earlier runs stored
    mbd reproduce --report-only                        # rewrite the report from what is stored

Claims (paper section, checked with the numbers printed next to each verdict):
  (a) MBD TPF >= 1.5x SingleBD at accuracy >= SingleBD - 1 pp           (tab:main_results)
  (b) training-free MultiBD raises TPF but loses accuracy                (tab:main_results)
  (c) MultiTF recovers it: MBD wins back >= half of the lost accuracy    (tab:main_results)
  (d) chain-uniform has the best AUP among chain-uniform / D2F-monotonic / random / sorted-uniform (tab:ablation)
  (e) systematic + random group-layouts beat each alone in AUP          (tab:ablation)
  (f) active blocks per forward: mean about 2 (1.5-2.5), 3-4 occasionally (0 < share <= 50%)
                                                                         (fig:train_infer_noise_activity D-E)
Every MBD variant post-trains the shipped base with the same corpus, steps and optimiser as `mbd quickstart`
(the knobs of configs/quickstart.yaml) and differs only in the noise-scheduler or the group-layouts. The
expansion job has no random-only mode: that variant is expanded with as many random layouts as there are
systematic ones and the systematic rows are filtered out by a Ray Data pass.

Resumable: every variant's expansion and exported model are kept under the run directory and skipped when
present (an interrupted training run resumes from its last Ray Train checkpoint), and the evaluation sweep
decodes only problems it has not stored. An honest NOT REPRODUCED is a result, not a failure (exit code 0).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple, Sequence

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel

from mbd.config import ConfigError
from mbd.eval.sweep import ResultStore, resolve_path
from mbd.multitf.layouts import num_layouts
from pipelines.quickstart import (BENCHMARK, DEFAULT_CONFIG, MULTIBD_TF, SINGLEBD, MethodRow, QuickstartConfig,
                                  Stages, expand_stage, format_table, load_config, point_name, ray_session,
                                  rows_of, section_title, sweep_config, train_stage, write_corpus)

PARTS: dict[str, tuple[str, ...]] = {
    "core": ("chain",),
    "schedulers": ("chain", "d2f", "random", "sorted"),
    "layouts": ("chain", "systematic", "random-layouts"),
}
CHECKPOINT_EVERY = 100  # steps between Ray Train checkpoints: what an interrupted variant loses at most


class Variant(NamedTuple):
    label: str
    scheduler: str
    layouts: str  # "both" | "systematic" | "random"


VARIANTS: dict[str, Variant] = {
    "chain": Variant("MBD: chain-uniform, systematic + random (ours)", "chain_uniform", "both"),
    "d2f": Variant("MBD: D2F-style monotonic scheduler", "d2f", "both"),
    "random": Variant("MBD: random scheduler", "random", "both"),
    "sorted": Variant("MBD: sorted-uniform scheduler", "sorted_uniform", "both"),
    "systematic": Variant("MBD: systematic layouts only", "chain_uniform", "systematic"),
    "random-layouts": Variant("MBD: random layouts only", "chain_uniform", "random"),
}


class Claim(BaseModel):
    id: str
    text: str
    reproduced: bool | None  # None: its part was not run
    evidence: str

    @property
    def verdict(self) -> str:
        return {True: "REPRODUCED", False: "NOT REPRODUCED", None: "NOT RUN"}[self.reproduced]


# ---------------------------------------------------------------- work

def keep_random_layouts(batch: pa.Table) -> pa.Table:
    return batch.filter(pc.equal(batch["layout_kind"], "random"))


def expand_variant(cfg: QuickstartConfig, run: Path, base: Path, name: str) -> str:
    """Rows of one variant (skipped when its expand.json exists); returns the rows directory."""
    import ray

    v, out = VARIANTS[name], run / "variants" / name / "layouts"
    done = out / "expand.json"
    if done.is_file():
        print(f"    stored: {out}")
        return json.loads(done.read_text())["rows_dir"]
    n_rand = {"both": cfg.expand.n_rand, "systematic": 0,
              "random": num_layouts(cfg.expand.gmax, 0)}[v.layouts]
    expand = cfg.expand.model_copy(update={"n_rand": n_rand,
                                           "scheduler": cfg.expand.scheduler.model_copy(update={"name": v.scheduler})})
    summary = expand_stage(cfg, run / "corpus" / "train.jsonl", out / ("all" if v.layouts == "random" else ""),
                           base, expand)
    rows_dir = summary.rows_dir
    if v.layouts == "random":
        rows_dir = str(out / "rows")
        ray.data.read_parquet(summary.rows_dir).map_batches(keep_random_layouts, batch_format="pyarrow") \
            .write_parquet(rows_dir)
        print(f"    kept the {n_rand} random layouts per sequence -> {rows_dir}")
    done.write_text(json.dumps({"rows_dir": rows_dir, **summary.model_dump()}, indent=2))
    return rows_dir


def train_variant(cfg: QuickstartConfig, run: Path, base: Path, name: str, rows_dir: str, progress: bool) -> Path:
    model = run / "variants" / name / "model"
    if (model / "config.json").is_file():
        print(f"    stored: {model}")
        return model
    train_stage(cfg, run / "variants" / name, base, rows_dir, progress, export_dir=model,
                checkpoint_every=min(CHECKPOINT_EVERY, cfg.train.steps))
    return model


def methods_for(cfg: QuickstartConfig, variants: Sequence[str]) -> list[tuple[str, str, str, str]]:
    """(label, key, decode YAML, model) for the sweep: the base under SingleBD and MultiBD, each variant under
    MultiBD (one AUP curve each)."""
    out = [(SINGLEBD, "singlebd", cfg.eval.singlebd, "base"), (MULTIBD_TF, "multibd-tf", cfg.eval.multibd, "base")]
    return out + [(VARIANTS[v].label, f"mbd-{v}", cfg.eval.multibd, f"mbd-{v}") for v in variants]


# ---------------------------------------------------------------- claims

def se_pp(acc: float, n: int) -> float:
    """Binomial standard error of an accuracy in percentage points."""
    p = acc / 100
    return 100 * math.sqrt(max(p * (1 - p), 0.0) / max(n, 1))


def active_block_stats(traces: Sequence[Sequence[dict]]) -> dict:
    """Active (ACTIVE-slot) blocks per forward over every traced request."""
    counts = [sum(s == "ACTIVE" for s in e["states"]) for t in traces for e in t]
    hist = Counter(counts)
    n = len(counts)
    return {"requests": len(traces), "forwards": n, "mean": sum(counts) / n if n else float("nan"),
            "share": {k: hist[k] / n for k in sorted(hist)} if n else {},
            "share_3plus": sum(v for k, v in hist.items() if k >= 3) / n if n else float("nan")}


def judge(rows: dict[str, MethodRow], stats: dict | None) -> list[Claim]:
    """Verdicts from the rows present; a claim whose rows (or traces) are missing is NOT RUN."""
    s, tf, m = rows.get(SINGLEBD), rows.get(MULTIBD_TF), rows.get(VARIANTS["chain"].label)
    claims = []
    if s and tf and m:
        ratio = m.tpf / s.tpf if s.tpf else float("nan")
        claims.append(Claim(id="a", text="MBD TPF >= 1.5x SingleBD at accuracy >= SingleBD - 1 pp",
                            reproduced=ratio >= 1.5 and m.accuracy >= s.accuracy - 1.0,
                            evidence=f"TPF ratio {ratio:.2f}x; Acc {m.accuracy:.2f} vs {s.accuracy:.2f} "
                                     f"({m.accuracy - s.accuracy:+.2f} pp)"))
        claims.append(Claim(id="b", text="training-free MultiBD raises TPF but loses accuracy",
                            reproduced=tf.tpf > s.tpf and tf.accuracy < s.accuracy,
                            evidence=f"TPF {s.tpf:.2f} -> {tf.tpf:.2f}; Acc {s.accuracy:.2f} -> {tf.accuracy:.2f} "
                                     f"({tf.accuracy - s.accuracy:+.2f} pp, SE ±{se_pp(s.accuracy, s.n):.1f})"))
        lost = s.accuracy - tf.accuracy
        won = m.accuracy - tf.accuracy
        claims.append(Claim(id="c", text="MultiTF recovers it (MBD wins back >= half of the accuracy MultiBD lost)",
                            reproduced=lost > 0 and won >= 0.5 * lost,
                            evidence=(f"lost {lost:.2f} pp, MBD recovers {won:+.2f} pp ({won / lost:.0%})" if lost > 0
                                      else f"nothing to recover: training-free MultiBD lost {lost:.2f} pp; "
                                           f"MBD vs training-free {won:+.2f} pp")))
    else:
        claims += [Claim(id=i, text=t, reproduced=None, evidence="no stored results") for i, t in
                   (("a", "MBD TPF >= 1.5x SingleBD at accuracy >= SingleBD - 1 pp"),
                    ("b", "training-free MultiBD raises TPF but loses accuracy"), ("c", "MultiTF recovers it"))]
    for cid, part, text in (("d", "schedulers", "chain-uniform has the best AUP among the noise-schedulers"),
                            ("e", "layouts", "systematic + random layouts beat each alone in AUP")):
        group = [rows.get(VARIANTS[v].label) for v in PARTS[part]]
        if not all(group) or any(r.aup is None for r in group):
            claims.append(Claim(id=cid, text=text, reproduced=None, evidence=f"part '{part}' not run"))
            continue
        claims.append(Claim(id=cid, text=text, reproduced=all(group[0].aup > r.aup for r in group[1:]),
                            evidence="; ".join(f"{r.method.removeprefix('MBD: ')} AUP {r.aup:.2f} "
                                               f"(Acc {r.accuracy:.2f}, TPF {r.tpf:.2f})" for r in group)))
    text = "active blocks per forward: mean about 2 (1.5-2.5), 3 or more occasionally (0 < share <= 50%)"
    if stats and stats["forwards"]:
        claims.append(Claim(id="f", text=text,
                            reproduced=1.5 <= stats["mean"] <= 2.5 and 0 < stats["share_3plus"] <= 0.5,
                            evidence=f"mean {stats['mean']:.2f} over {stats['forwards']} forwards of "
                                     f"{stats['requests']} requests; share by count "
                                     + ", ".join(f"{k}: {v:.1%}" for k, v in stats["share"].items())))
    else:
        claims.append(Claim(id="f", text=text, reproduced=None, evidence="no traces of the MBD model"))
    return sorted(claims, key=lambda c: c.id)


# ---------------------------------------------------------------- report

def write_report(path: Path, cfg: QuickstartConfig, rows: dict[str, MethodRow], claims: Sequence[Claim],
                 stats: dict | None, wall_s: dict[str, float], sweep_report: str) -> str:
    def table(labels: Sequence[str], title: str) -> str:
        return format_table([rows[label] for label in labels if label in rows], title)

    t = cfg.train
    lines = [
        "# `mbd reproduce`: the paper's claims on the tiny model", "",
        f"Base: `{cfg.base_model}`; corpus: {cfg.corpus.problems} tinymath train problems; MultiTF: {t.steps} "
        f"steps, {t.num_workers} workers x micro-batch {t.micro_batch_size}, ZeRO-{t.zero_stage}, lr {t.lr}; "
        f"G_max {cfg.expand.gmax}, N_rand {cfg.expand.n_rand}; evaluation: first {cfg.eval.problems} held-out "
        f"problems, greedy; AUP over the TPF-sorted curve points {cfg.eval.curve} (the paper's trapezoid formula; "
        f"the first point is the operating point in the Acc/TPF/TPS columns). Seed {cfg.seed}.", "",
        "## Claims", "",
        "| Claim | Verdict | Evidence |", "|:---|:---|:---|",
        *[f"| ({c.id}) {c.text} | **{c.verdict}** | {c.evidence} |" for c in claims], "",
        "## Main comparison (tab:main_results layout)", "",
        table([SINGLEBD, MULTIBD_TF, VARIANTS["chain"].label], section_title(cfg)), "",
        "## Noise-scheduler ablation (tab:ablation)", "",
        table([SINGLEBD] + [VARIANTS[v].label for v in PARTS["schedulers"]], "block-level noise-scheduler"), "",
        "## Group-layout ablation (tab:ablation)", "",
        table([SINGLEBD] + [VARIANTS[v].label for v in PARTS["layouts"]], "noise-group layouts"), "",
        "## Active blocks per forward (MBD, operating point)", "",
        "```", json.dumps(stats, indent=2) if stats else "no traces", "```", "",
        f"Accuracy standard errors: ±{se_pp(80.0, cfg.eval.problems):.1f} pp at 80% over {cfg.eval.problems} "
        "problems; differences smaller than that are noise.", "",
        "Wall time per step (s, the longest run of each when resumed): "
        + ", ".join(f"{k} {v:.0f}" for k, v in wall_s.items()), "",
        f"Full sweep report (every curve point, TPS table, plots): `{sweep_report}`", "",
    ]
    text = "\n".join(lines)
    path.write_text(text)
    return text


# ---------------------------------------------------------------- driver

def run_reproduce(cfg: QuickstartConfig, run: Path, parts: Sequence[str], progress: bool = True,
                  report_only: bool = False) -> tuple[list[Claim], Path]:
    base = resolve_path(cfg.base_model)
    if not (base / "config.json").is_file():
        raise ConfigError(f"base_model: {cfg.base_model} has no config.json (train it with `mbd pretrain-tiny`)")
    variants = list(dict.fromkeys(v for p in parts for v in PARTS[p]))
    run.mkdir(parents=True, exist_ok=True)
    plan = [] if report_only else ["corpus"] + [f"{w}:{v}" for v in variants for w in ("expand", "train")] + ["eval"]
    stages = Stages(plan)
    models = [("base", base)] + [(f"mbd-{v}", run / "variants" / v / "model") for v in variants]
    methods = methods_for(cfg, variants)
    sweep = sweep_config(cfg, run / "eval", models, methods)
    if not report_only:
        with ray_session(cfg.num_cpus):
            import ray

            ray.data.DataContext.get_current().enable_progress_bars = progress
            with stages.run("corpus", f"{cfg.corpus.problems} tinymath train-split problems"):
                write_corpus(run / "corpus" / "train.jsonl", cfg.corpus.problems, cfg.seed)
            for v in variants:
                with stages.run(f"expand:{v}", VARIANTS[v].label):
                    rows_dir = expand_variant(cfg, run, base, v)
                with stages.run(f"train:{v}", f"{cfg.train.steps} MultiTF steps"):
                    train_variant(cfg, run, base, v, rows_dir, progress)
            from pipelines.eval_sweep import run_sweep

            with stages.run("eval", f"{len(methods)} methods x {len(cfg.eval.curve)} points x {cfg.eval.problems} "
                                    f"held-out problems (stored problems are skipped)"):
                summary = run_sweep(sweep, progress=progress)
    else:
        from mbd.eval.report import write_sweep_report
        from mbd.eval.sweep import load_problems

        summary = write_sweep_report(sweep, load_problems(sweep))
    stored = {(c.model, c.config) for c in summary.cells}
    complete = [m for m in methods if all((m[3], point_name(m[1], o)) in stored for o in cfg.eval.curve)]
    rows = {r.method: r for r in rows_of(cfg, summary.cells, complete)}
    traces = ResultStore(run / "eval").load_traces("mbd-chain", point_name("mbd-chain", cfg.eval.curve[0]), BENCHMARK)
    stats = active_block_stats(list(traces.values())) if traces else None
    claims = judge(rows, stats)
    # a resumed run skips stored steps in ~0 s: keep each step's longest measured wall time across runs
    saved = run / "wall_s.json"
    wall = json.loads(saved.read_text()) if saved.is_file() else {}
    wall |= {k: max(v, wall.get(k, 0.0)) for k, v in stages.wall_s.items()}
    saved.write_text(json.dumps(wall, indent=2))
    report = run / "reproduce.md"
    write_report(report, cfg, rows, claims, stats, wall, summary.report_path)
    return claims, report


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mbd reproduce", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="QuickstartConfig YAML (the shared knobs)")
    ap.add_argument("--run-dir", default="runs/reproduce")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--steps", type=int, help="override train.steps of every variant")
    ap.add_argument("--problems", type=int, help="override eval.problems")
    ap.add_argument("--corpus", type=int, help="override corpus.problems")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from stored results; no Ray")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    overrides = {k: v for k, v in {"train.steps": args.steps, "eval.problems": args.problems,
                                   "corpus.problems": args.corpus}.items() if v is not None}
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    try:
        unknown = sorted(set(parts) - set(PARTS))
        if unknown or not parts:
            raise ConfigError(f"--parts: unknown {unknown or parts}; choose from {','.join(PARTS)}")
        cfg = load_config(args.config, overrides)
        t0 = time.perf_counter()
        claims, report = run_reproduce(cfg, Path(args.run_dir), parts, not args.no_progress, args.report_only)
    except ConfigError as e:
        print(f"mbd reproduce: {e}", file=sys.stderr)
        return 2
    print()
    for c in claims:
        print(f"({c.id}) {c.verdict:<15} {c.text}\n    {c.evidence}")
    print(f"\nreport: {report} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
