"""`mbd reproduce`: the paper's qualitative claims, re-measured on the embedded tiny model (18 minutes with 300
training steps, about 35 with the default 800, on 2 CPU cores; docs/reproduce.md holds the last measured report).

    mbd reproduce                                      # all parts -> runs/reproduce/reproduce.md
    mbd reproduce --parts core                         # claims (a), (b), (c), (f) only
    mbd reproduce --parts schedulers --steps 150       # claim (d); reuses what earlier runs stored
    mbd reproduce --report-only                        # rewrite the report from what is stored

Claims (paper section), each judged by a stated test on the same held-out problems (mbd.eval.claims): a 95%
interval wholly on the claim's side of its threshold is REPRODUCED, wholly on the other side NOT REPRODUCED,
straddling it INCONCLUSIVE (the data cannot tell at this n):
  (a) MBD TPF >= 1.78x SingleBD at accuracy >= SingleBD - 1 pp: paired Wald CI of the accuracy difference
      above -1 pp (non-inferiority)                                                (tab:main_results, tab:tps)
  (b) training-free MultiBD raises TPF but loses accuracy: paired CI of the loss above 0 (exact McNemar beside)
  (c) MultiTF recovers >= half of that loss: paired CI of Acc(MBD) - Acc(training-free) above half the loss
  (d) chain-uniform has the best AUP among chain-uniform / D2F-monotonic / random / sorted-uniform, and
  (e) systematic + random group-layouts beat each alone in AUP: paired-bootstrap CI (over problems) of each AUP
      difference above 0; every MultiBD curve sweeps tau_m2t down to 0.5, tau_add and buffer_size (tab:ablation)
  (f) active blocks per forward: mean about 2 (bootstrap CI over requests inside [1.5, 2.5]), 3 or more
      occasionally (0 < share <= 50%)                                     (fig:train_infer_noise_activity D-E)
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
import sys
import time
from pathlib import Path
from typing import NamedTuple, Sequence

import pyarrow as pa
import pyarrow.compute as pc
from mbd.config import ConfigError, resolve_path
from mbd.eval.claims import Claim, Curve, claims_table, judge_active, judge_aup, judge_main
from mbd.eval.report import MethodRow, method_table
from mbd.eval.sweep import ResultStore
from mbd.multitf.layouts import num_layouts
from pipelines.ray_session import ray_session
from pipelines.stages import (BENCHMARK, DEFAULT_CONFIG, MULTIBD_TF, SINGLEBD, ExpandSection, MethodSpec,
                              QuickstartConfig, Stages, curves_of, expand_stage, load_config, point_name, rows_of,
                              section_title, sweep_config, train_stage, write_corpus)

__all__ = ["run_reproduce", "main"]

PARTS: dict[str, tuple[str, ...]] = {
    "core": ("chain",),
    "schedulers": ("chain", "d2f", "random", "sorted"),
    "layouts": ("chain", "systematic", "random-layouts"),
}
CHECKPOINT_EVERY = 100  # steps between Ray Train checkpoints: what an interrupted variant loses at most


class Variant(NamedTuple):
    label: str
    scheduler: str
    layouts: str  # "both" | "systematic" | "random" | "d2f" (the authors' D2F rows: one group, no layouts)


VARIANTS: dict[str, Variant] = {
    "chain": Variant("MBD: chain-uniform, systematic + random (ours)", "chain_uniform", "both"),
    "d2f": Variant("MBD: D2F-style monotonic scheduler", "linear", "d2f"),
    "random": Variant("MBD: random scheduler", "random", "both"),
    "sorted": Variant("MBD: sorted-uniform scheduler", "sorted_uniform", "both"),
    "systematic": Variant("MBD: systematic layouts only", "chain_uniform", "systematic"),
    "random-layouts": Variant("MBD: random layouts only", "chain_uniform", "random"),
}


# ---------------------------------------------------------------- work

def keep_random_layouts(batch: pa.Table) -> pa.Table:
    return batch.filter(pc.equal(batch["layout_kind"], "random"))


def variant_expand(cfg: QuickstartConfig, name: str) -> ExpandSection:
    """The quickstart's expansion settings with variant `name`'s scheduler and group-layouts."""
    v = VARIANTS[name]
    n_rand = {"both": cfg.expand.n_rand, "systematic": 0, "d2f": 0,
              "random": num_layouts(cfg.expand.gmax, 0)}[v.layouts]
    return cfg.expand.model_copy(update={"n_rand": n_rand, "mode": "d2f" if v.layouts == "d2f" else "multitf",
                                         "scheduler": cfg.expand.scheduler.model_copy(update={"name": v.scheduler})})


def expand_variant(cfg: QuickstartConfig, run: Path, base: Path, name: str) -> str:
    """Rows of one variant (skipped when its expand.json exists); returns the rows directory."""
    import ray

    v, out = VARIANTS[name], run / "variants" / name / "layouts"
    done = out / "expand.json"
    if done.is_file():
        print(f"    stored: {out}")
        return json.loads(done.read_text())["rows_dir"]
    expand = variant_expand(cfg, name)
    summary = expand_stage(cfg, run / "corpus" / "train.jsonl", out / ("all" if v.layouts == "random" else ""),
                           base, expand)
    rows_dir = summary.rows_dir
    if v.layouts == "random":
        rows_dir = str(out / "rows")
        ray.data.read_parquet(summary.rows_dir).map_batches(keep_random_layouts, batch_format="pyarrow") \
            .write_parquet(rows_dir)
        print(f"    kept the {expand.n_rand} random layouts per sequence -> {rows_dir}")
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


def methods_for(cfg: QuickstartConfig, variants: Sequence[str]) -> list[MethodSpec]:
    """(label, key, decode YAML, model) for the sweep: the base under SingleBD and MultiBD, each variant under
    MultiBD (one AUP curve each)."""
    out = [(SINGLEBD, "singlebd", cfg.eval.singlebd, "base"), (MULTIBD_TF, "multibd-tf", cfg.eval.multibd, "base")]
    return out + [(VARIANTS[v].label, f"mbd-{v}", cfg.eval.multibd, f"mbd-{v}") for v in variants]


# ---------------------------------------------------------------- claims and report

def judge_all(cfg: QuickstartConfig, run: Path, methods: Sequence[MethodSpec],
              stored: set[tuple[str, str]]) -> list[Claim]:
    """Every claim from the per-problem records stored for the complete methods (others are NOT RUN)."""
    complete = [m for m in methods if all((m[3], point_name(m[1], o)) in stored for o in cfg.eval.overrides(m[2]))]
    curves = curves_of(cfg, run, complete)

    def group(part: str) -> list[Curve] | None:
        labels = [VARIANTS[v].label for v in PARTS[part]]
        return [curves[label] for label in labels] if all(label in curves for label in labels) else None

    chain = VARIANTS["chain"].label
    store = ResultStore(run / "eval")
    traces = store.load_traces("mbd-chain", point_name("mbd-chain", cfg.eval.curve[0]), BENCHMARK)
    return [*judge_main(curves.get(SINGLEBD), curves.get(MULTIBD_TF), curves.get(chain)),
            judge_aup("d", group("schedulers")), judge_aup("e", group("layouts")),
            judge_active(list(traces.values()))]


def write_report(path: Path, cfg: QuickstartConfig, rows: dict[str, MethodRow], claims: Sequence[Claim],
                 wall_s: dict[str, float], sweep_report: str) -> str:
    def table(labels: Sequence[str], title: str) -> str:
        return method_table([rows[label] for label in labels if label in rows], title, BENCHMARK)

    t = cfg.train
    lines = [
        "# `mbd reproduce`: the paper's claims on the tiny model", "",
        f"Base: `{cfg.base_model}`; corpus: {cfg.corpus.problems} tinymath train problems; MultiTF: {t.steps} "
        f"steps, {t.num_workers} workers x micro-batch {t.micro_batch_size}, ZeRO-{t.zero_stage}, lr {t.lr}; "
        f"G_max {cfg.expand.gmax}, N_rand {cfg.expand.n_rand}; evaluation: first {cfg.eval.problems} held-out "
        f"problems, greedy; AUP over the TPF-sorted curve points {cfg.eval.curve} (+ {cfg.eval.multibd_curve} for "
        f"MultiBD methods; the paper's trapezoid formula; the first point is the operating point in the "
        f"Acc/TPF columns; no TPS column: per-cell sweep timings are not comparable across rows). Seed {cfg.seed}. "
        f"Verdicts: REPRODUCED / NOT REPRODUCED when the stated 95% "
        f"interval lies on one side of the claim's threshold, INCONCLUSIVE when it straddles it.", "",
        "## Claims", "", claims_table(claims), "",
        "## Main comparison (tab:main_results layout)", "",
        table([SINGLEBD, MULTIBD_TF, VARIANTS["chain"].label], section_title(cfg)), "",
        "## Noise-scheduler ablation (tab:ablation)", "",
        table([SINGLEBD] + [VARIANTS[v].label for v in PARTS["schedulers"]], "block-level noise-scheduler"), "",
        "## Group-layout ablation (tab:ablation)", "",
        table([SINGLEBD] + [VARIANTS[v].label for v in PARTS["layouts"]], "noise-group layouts"), "",
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
        with ray_session(run, cfg.num_cpus):
            import ray

            ray.data.DataContext.get_current().enable_progress_bars = False  # expand prints its summary
            with stages.run("corpus", f"{cfg.corpus.problems} tinymath train-split problems"):
                write_corpus(run / "corpus" / "train.jsonl", cfg.corpus.problems, cfg.seed)
            for v in variants:
                with stages.run(f"expand:{v}", VARIANTS[v].label):
                    rows_dir = expand_variant(cfg, run, base, v)
                with stages.run(f"train:{v}", f"{cfg.train.steps} MultiTF steps"):
                    train_variant(cfg, run, base, v, rows_dir, progress)
            from pipelines.eval_sweep import run_sweep

            with stages.run("eval", f"{len(methods)} methods x their curve points x {cfg.eval.problems} "
                                    f"held-out problems (stored problems are skipped)"):
                summary = run_sweep(sweep, progress=progress)
    else:
        from mbd.eval.report import write_sweep_report
        from mbd.eval.sweep import load_problems

        summary = write_sweep_report(sweep, load_problems(sweep))
    stored = {(c.model, c.config) for c in summary.cells if c.n == cfg.eval.problems}
    complete = [m for m in methods if all((m[3], point_name(m[1], o)) in stored for o in cfg.eval.overrides(m[2]))]
    rows = {r.method: r for r in rows_of(cfg, summary.cells, complete)}
    claims = judge_all(cfg, run, methods, stored)
    # a resumed run skips stored steps in ~0 s: keep each step's longest measured wall time across runs
    saved = run / "wall_s.json"
    wall = json.loads(saved.read_text()) if saved.is_file() else {}
    wall |= {k: max(v, wall.get(k, 0.0)) for k, v in stages.wall_s.items()}
    saved.write_text(json.dumps(wall, indent=2))
    report = run / "reproduce.md"
    write_report(report, cfg, rows, claims, wall, summary.report_path)
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
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="override a QuickstartConfig field, e.g. --set train.lr=3e-4")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from stored results; no Ray")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    sets = [f"{k}={v}" for k, v in {"train.steps": args.steps, "eval.problems": args.problems,
                                    "corpus.problems": args.corpus}.items() if v is not None] + args.sets
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    try:
        unknown = sorted(set(parts) - set(PARTS))
        if unknown or not parts:
            raise ConfigError(f"--parts: unknown {unknown or parts}; choose from {','.join(PARTS)}")
        cfg = load_config(args.config, sets)
        t0 = time.perf_counter()
        claims, report = run_reproduce(cfg, Path(args.run_dir), parts, not args.no_progress, args.report_only)
    except ConfigError as e:
        print(f"mbd reproduce: {e}", file=sys.stderr)
        return 2
    print()
    for c in claims:
        print(f"({c.id}) {c.verdict:<15} {c.text}\n    test: {c.test}\n    {c.evidence}")
    print(f"\nreport: {report} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
