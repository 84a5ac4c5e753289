"""`mbd reproduce`: the paper's qualitative claims, re-measured on the embedded tiny model (docs/reproduce.md holds
the last measured report and the time of each part on 2 CPU cores).

    mbd reproduce                                      # all parts -> runs/reproduce/reproduce.md
    mbd reproduce --parts core                         # claims (a), (b), (c), (f) only
    mbd reproduce --parts core --seeds 3               # every claim pre-registered with 3 seeds (a new run)
    mbd reproduce --parts schedulers                   # claim (d) in the same run: chain-uniform runs are shared
    mbd reproduce --report-only                        # rewrite the report from what is stored

Claims (paper section), each judged by a stated test on the same held-out problems (mbd.eval.claims): a 95%
interval wholly on the claim's side of its threshold is REPRODUCED, wholly on the other side NOT REPRODUCED,
straddling it INCONCLUSIVE (the data cannot tell at this n). Claims (a)-(c) are judged at the operating points
on eval.claim_problems (10,000) held-out problems, the AUP claims on the curves' eval.problems (1,000):
  (a) MBD TPF at least 1.78 times SingleBD's at accuracy >= SingleBD - 1 pp: CI of the accuracy difference above -1 pp
      (non-inferiority)                                                            (tab:main_results, tab:tps)
  (b) training-free MultiBD raises TPF but loses accuracy: paired CI of the loss above 0 (exact McNemar beside)
  (c) MultiTF recovers >= half of that loss: CI of Acc(MBD) - Acc(training-free) above half the loss
  (d) chain-uniform has the best AUP among chain-uniform / D2F-monotonic / random / sorted-uniform, and
  (e) systematic + random group-layouts beat each alone in AUP: CI of each AUP difference above 0; every
      MultiBD curve sweeps tau_m2t down to 0.5, tau_add and buffer_size                       (tab:ablation)
  (f) active blocks per forward: mean about 2 (bootstrap CI over requests inside [1.5, 2.5]), 3 or more
      occasionally (0 < share <= 50%)                                     (fig:train_infer_noise_activity D-E)
Pre-registered seeds: `claim_seeds` (the config's: 6 for (a) and (c), 5 for (d) and (e); `--seeds N` sets all four) fixes
before anything trains how many training seeds each claim is judged over (pipelines/preregistration.py). The run
lives in a folder named by that registration, so another count is another run with its own verdicts, and a claim
is judged over exactly its registered seeds (the first N of each variant it compares), never more, or NOT RUN
until all of them are stored: no verdict changes by adding seeds to a run. (f) pools the traces of (a)'s runs.
With one seed the CIs are over problems (paired Wald, paired bootstrap for AUP): they judge the one trained model.
With N >= 2 (seed s: the quickstart recipe with `seed: s`, so its corpus, layouts, noise and row order) the
claim is judged over seeds (`mbd.eval.stats.seed_interval`):
the mean of the per-seed differences with a Student-t interval whose variance adds the seed-to-seed spread to
the problems' share (Welch-Satterthwaite degrees of freedom: about N-1 when the seeds disagree). A seed-level
test, not a pooled one: a paired test over problems pooled across seeds treats the N trained models as fixed, so
one run 4 pp off would move its verdict as much as the problems allow; here such a run widens the interval.
Every MBD variant post-trains the shipped base with the same corpus, steps and optimiser as `mbd quickstart`
(the knobs of configs/quickstart.yaml) and differs only in the noise-scheduler or the group-layouts. The
expansion job has no random-only mode: that variant is expanded with as many random layouts as there are
systematic ones and the systematic rows are filtered out by a Ray Data pass.

Resumable: every variant's expansion and exported model are kept under the registration's folder and skipped when
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
from mbd.eval.report import MethodRow, SweepSummary, method_table
from mbd.eval.sweep import ResultStore
from mbd.multitf.layouts import num_layouts
from pipelines.preregistration import REGISTRATION, Registration, code_commit, register, registration_dir
from pipelines.ray_session import ray_session
from pipelines.stages import (BENCHMARK, DEFAULT_CONFIG, MULTIBD_TF, SINGLEBD, ExpandSection, MethodSpec,
                              QuickstartConfig, Stages, curves_of, expand_stage, load_config, overrides_of, point_name,
                              rows_of, section_title, sweep_config, train_stage, write_corpus)

__all__ = ["run_reproduce", "main"]

PARTS: dict[str, tuple[str, ...]] = {
    "core": ("chain",),
    "schedulers": ("chain", "d2f", "random", "sorted"),
    "layouts": ("chain", "systematic", "random-layouts"),
}
PART_CLAIMS: dict[str, tuple[str, ...]] = {"core": ("a", "c"), "schedulers": ("d",), "layouts": ("e",)}
CHECKPOINT_EVERY = 100  # steps between Ray Train checkpoints: what an interrupted variant loses at most
WALL_LOG = "wall_s.json"  # each step's wall time summed over the invocations that ran it (`Stages`)


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


class Run(NamedTuple):
    """One variant trained with one seed: the quickstart recipe with `seed: seed` (corpus, layouts and noise, row
    order). The config's own seed keeps the names a one-seed run has always had."""

    variant: str
    seed: int
    first: bool

    @property
    def key(self) -> str:
        return self.variant if self.first else f"{self.variant}-s{self.seed}"

    @property
    def model(self) -> str:
        return f"mbd-{self.key}"

    @property
    def label(self) -> str:
        return VARIANTS[self.variant].label + ("" if self.first else f" [seed {self.seed}]")


def seeds_of(cfg: QuickstartConfig, claim: str) -> int:
    return getattr(cfg.claim_seeds, claim)


def runs_of(cfg: QuickstartConfig, parts: Sequence[str]) -> list[Run]:
    """Each variant of `parts` trained as many times as the most seeds a claim of those parts registered for it."""
    need: dict[str, int] = {}
    for part in parts:
        for v in PARTS[part]:
            need[v] = max([need.get(v, 0), *(seeds_of(cfg, c) for c in PART_CLAIMS[part])])
    return [Run(v, cfg.seed + k, k == 0) for v, n in need.items() for k in range(n)]


def first_runs(runs: Sequence[Run], variant: str, n: int) -> list[Run]:
    """The first `n` seeds of `variant`: the runs a claim registered with n seeds is judged over."""
    return [r for r in runs if r.variant == variant][:n]


def corpus_of(run: Path, r: Run) -> Path:
    return run / "corpus" / ("train.jsonl" if r.first else f"train-s{r.seed}.jsonl")


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


def expand_variant(cfg: QuickstartConfig, run: Path, base: Path, r: Run) -> str:
    """Rows of one run (skipped when its expand.json exists); returns the rows directory."""
    from pipelines.parquet import read_parquet

    v, out = VARIANTS[r.variant], run / "variants" / r.key / "layouts"
    done = out / "expand.json"
    if done.is_file():
        print(f"    stored: {out}")
        return json.loads(done.read_text())["rows_dir"]
    expand = variant_expand(cfg, r.variant)
    summary = expand_stage(cfg.model_copy(update={"seed": r.seed}), corpus_of(run, r),
                           out / ("all" if v.layouts == "random" else ""), base, expand)
    rows_dir = summary.rows_dir
    if v.layouts == "random":
        rows_dir = str(out / "rows")
        read_parquet(summary.rows_dir).map_batches(keep_random_layouts, batch_format="pyarrow") \
            .write_parquet(rows_dir)
        print(f"    kept the {expand.n_rand} random layouts per sequence -> {rows_dir}")
    done.write_text(json.dumps({"rows_dir": rows_dir, **summary.model_dump()}, indent=2))
    return rows_dir


def train_variant(cfg: QuickstartConfig, run: Path, base: Path, r: Run, rows_dir: str, progress: bool) -> Path:
    model = run / "variants" / r.key / "model"
    if (model / "config.json").is_file():
        print(f"    stored: {model}")
        return model
    train_stage(cfg.model_copy(update={"seed": r.seed}), run / "variants" / r.key, base, rows_dir, progress,
                export_dir=model, checkpoint_every=min(CHECKPOINT_EVERY, cfg.train.steps))
    return model


def methods_for(cfg: QuickstartConfig, runs: Sequence[Run]) -> list[MethodSpec]:
    """(label, key, decode YAML, model) for the sweep: the base under SingleBD and MultiBD, each run under MultiBD
    (one AUP curve each)."""
    out = [(SINGLEBD, "singlebd", cfg.eval.singlebd, "base"), (MULTIBD_TF, "multibd-tf", cfg.eval.multibd, "base")]
    return out + [(r.label, r.model, cfg.eval.multibd, r.model) for r in runs]


def claim_methods(cfg: QuickstartConfig, methods: Sequence[MethodSpec], runs: Sequence[Run]) -> list[MethodSpec]:
    """The methods of claims (a)-(c): the base under SingleBD and MultiBD, and the chain-uniform runs they
    registered."""
    n = max(seeds_of(cfg, "a"), seeds_of(cfg, "c"))
    keep = {SINGLEBD, MULTIBD_TF} | {r.label for r in first_runs(runs, "chain", n)}
    return [m for m in methods if m[0] in keep]


def complete(cfg: QuickstartConfig, methods: Sequence[MethodSpec], stored: set[tuple[str, str]],
             operating: bool = False) -> list[MethodSpec]:
    """The methods whose every point (`operating`: the operating point) is in `stored` (model, config) cells."""
    return [m for m in methods
            if all((m[3], point_name(m[1], o)) in stored for o in overrides_of(cfg, m[2], operating))]


# ---------------------------------------------------------------- claims and report

def judge_all(cfg: QuickstartConfig, run: Path, runs: Sequence[Run], stored: set[tuple[str, str]],
              claim_stored: set[tuple[str, str]]) -> list[Claim]:
    """Every claim from the per-problem records stored for the complete methods, each over exactly the seeds it
    registered (a claim missing one of them is NOT RUN; a stored run beyond them is never looked at): (a)-(c) from
    the operating points on eval.claim_problems (`claim_stored`), (d) and (e) from the curves on eval.problems."""
    methods = methods_for(cfg, runs)
    curves = curves_of(cfg, run / "eval", complete(cfg, methods, stored))
    main = curves_of(cfg, run / "claims", complete(cfg, claim_methods(cfg, methods, runs), claim_stored,
                                                   operating=True), cfg.eval.claim_problems, operating=True)

    def seeds(variant: str, claim: str, pool: dict[str, Curve]) -> list[Curve] | None:
        n = seeds_of(cfg, claim)
        labels = [r.label for r in first_runs(runs, variant, n)]
        return [pool[label] for label in labels] if len(labels) == n and all(lb in pool for lb in labels) else None

    def group(part: str) -> list[list[Curve]] | None:
        found = [seeds(v, PART_CLAIMS[part][0], curves) for v in PARTS[part]]
        return None if any(f is None for f in found) else found

    store = ResultStore(run / "eval")
    traces = [t for r in first_runs(runs, "chain", seeds_of(cfg, "a"))
              for t in store.load_traces(r.model, point_name(r.model, cfg.eval.curve[0]), BENCHMARK).values()]
    single, free = main.get(SINGLEBD), main.get(MULTIBD_TF)
    a_b = judge_main(single, free, seeds("chain", "a", main))[:2]
    c = judge_main(single, free, seeds("chain", "c", main))[2]
    return [*a_b, c, judge_aup("d", group("schedulers")), judge_aup("e", group("layouts")), judge_active(traces)]


def registration_line(cfg: QuickstartConfig, reg: Registration) -> str:
    counts = ", ".join(f"({k}) {v}" for k, v in cfg.claim_seeds.model_dump().items())
    return (f"Pre-registered at {reg.registered_at}, before any training (`{REGISTRATION}`): training seeds per claim "
            f"{counts}. Each claim is judged over exactly these seeds; another count is another run in another folder, "
            f"so no verdict here changes by adding seeds. Code at registration: {reg.commit or 'not a git checkout'}; "
            f"report written by {code_commit() or 'not a git checkout'}.")


def write_report(path: Path, cfg: QuickstartConfig, reg: Registration, runs: Sequence[Run], rows: dict[str, MethodRow],
                 claims: Sequence[Claim], wall_s: dict[str, float], sweep_report: str) -> str:
    def table(variants: Sequence[str], title: str, base: Sequence[str] = (SINGLEBD,)) -> str:
        labels = [*base, *(r.label for v in variants for r in runs if r.variant == v)]
        return method_table([rows[label] for label in labels if label in rows], title, BENCHMARK)

    t, seeds = cfg.train, sorted({r.seed for r in runs})
    lines = [
        "# `mbd reproduce`: the paper's claims on the tiny model", "", registration_line(cfg, reg), "",
        f"Base: `{cfg.base_model}`; corpus: {cfg.corpus.problems} tinymath posttrain problems; MultiTF: {t.steps} "
        f"steps, {t.num_workers} workers x micro-batch {t.micro_batch_size}, ZeRO-{t.zero_stage}, lr {t.lr}; "
        f"G_max {cfg.expand.gmax}, N_rand {cfg.expand.n_rand}; seeds {seeds} (each a fresh run: corpus, layouts, "
        f"noise, row order). Claims (a)-(c): operating points on the first {cfg.eval.claim_problems} held-out "
        f"problems. Tables and claims (d)-(f): first {cfg.eval.problems} held-out problems, greedy; AUP over the "
        f"TPF-sorted curve points {cfg.eval.curve} (+ {cfg.eval.multibd_curve} for MultiBD methods; the paper's "
        f"trapezoid formula; the first point is the operating point in the Acc/TPF columns; no TPS column: "
        f"per-cell sweep timings are not comparable across rows). Verdicts: REPRODUCED / NOT REPRODUCED when the "
        f"stated 95% interval lies on one side of the claim's threshold, INCONCLUSIVE when it straddles it.", "",
        "## Claims", "", claims_table(claims), "",
        "## Main comparison (tab:main_results layout)", "",
        table(["chain"], section_title(cfg), (SINGLEBD, MULTIBD_TF)), "",
        "## Noise-scheduler ablation (tab:ablation)", "",
        table(PARTS["schedulers"], "block-level noise-scheduler"), "",
        "## Group-layout ablation (tab:ablation)", "",
        table(PARTS["layouts"], "noise-group layouts"), "",
        "Wall time per step (s, summed over the invocations that ran it; a step skipped as stored adds about 0, "
        f"one ended mid-way by a kill adds nothing; `{WALL_LOG}`): "
        + ", ".join(f"{k} {v:.0f}" for k, v in wall_s.items()), "",
        f"Full sweep report (every curve point, TPS table, plots): `{sweep_report}`", "",
    ]
    text = "\n".join(lines)
    path.write_text(text)
    return text


# ---------------------------------------------------------------- driver

def train_all(cfg: QuickstartConfig, run: Path, base: Path, runs: Sequence[Run], stages: Stages,
              progress: bool) -> None:
    """Each seed's corpus, then every run's expansion and training (stored ones are skipped)."""
    with stages.run("corpus", f"{cfg.corpus.problems} tinymath posttrain-part problems per seed"):
        for r in {r.seed: r for r in runs}.values():
            write_corpus(corpus_of(run, r), cfg.corpus.problems, r.seed)
    for r in runs:
        with stages.run(f"expand:{r.key}", r.label):
            rows_dir = expand_variant(cfg, run, base, r)
        with stages.run(f"train:{r.key}", f"{cfg.train.steps} MultiTF steps, seed {r.seed}"):
            train_variant(cfg, run, base, r, rows_dir, progress)


def run_reproduce(cfg: QuickstartConfig, run_dir: Path, parts: Sequence[str], progress: bool = True,
                  report_only: bool = False) -> tuple[list[Claim], Path]:
    """The run registered by `cfg` under `run_dir` (registered now if new; `report_only` needs it registered)."""
    base = resolve_path(cfg.base_model)
    if not (base / "config.json").is_file():
        raise ConfigError(f"base_model: {cfg.base_model} has no config.json (train it with `mbd pretrain-tiny`)")
    if report_only and not (registration_dir(cfg, run_dir) / REGISTRATION).is_file():
        raise ConfigError(f"--report-only: no run registered with this config under {run_dir} (expected "
                          f"{registration_dir(cfg, run_dir)}); pass the settings of the run to report")
    run, reg = register(cfg, run_dir)
    print(f"run: {run} (pre-registered {reg.registered_at})", flush=True)
    runs = runs_of(cfg, parts)
    plan = [] if report_only else ["corpus", *(f"{w}:{r.key}" for r in runs for w in ("expand", "train")), "eval",
                                   "claims"]
    stages = Stages(plan, log=run / WALL_LOG)
    models = [("base", base)] + [(r.model, run / "variants" / r.key / "model") for r in runs]
    methods = methods_for(cfg, runs)
    chain = claim_methods(cfg, methods, runs)
    sweeps = {"eval": sweep_config(cfg, run / "eval", models, methods),
              "claims": sweep_config(cfg, run / "claims", [m for m in models if m[0] in {c[3] for c in chain}], chain,
                                     cfg.eval.claim_problems, operating=True)}
    if not report_only:
        with ray_session(run, cfg.num_cpus):
            import ray

            ray.data.DataContext.get_current().enable_progress_bars = False  # expand prints its summary
            train_all(cfg, run, base, runs, stages, progress)
            from pipelines.eval_sweep import run_sweep

            with stages.run("eval", f"{len(methods)} methods x their curve points x {cfg.eval.problems} "
                                    f"held-out problems (stored problems are skipped)"):
                summary = run_sweep(sweeps["eval"], progress=progress)
            with stages.run("claims", f"claims (a)-(c): {len(chain)} operating points x {cfg.eval.claim_problems} "
                                      f"held-out problems"):
                claimed = run_sweep(sweeps["claims"], progress=progress)
    else:
        from mbd.eval.sweep_report import write_sweep_report
        from mbd.eval.sweep import load_problems

        summary, claimed = (write_sweep_report(s, load_problems(s)) for s in sweeps.values())
    return report(cfg, run, reg, runs, summary, claimed, stages)


def report(cfg: QuickstartConfig, run: Path, reg: Registration, runs: Sequence[Run], summary: SweepSummary,
           claimed: SweepSummary, stages: Stages) -> tuple[list[Claim], Path]:
    """Judge the claims from what the two sweeps stored and write reproduce.md."""
    stored = {(c.model, c.config) for c in summary.cells if c.n == cfg.eval.problems}
    claim_stored = {(c.model, c.config) for c in claimed.cells if c.n == cfg.eval.claim_problems}
    rows = {r.method: r for r in rows_of(cfg, summary.cells, complete(cfg, methods_for(cfg, runs), stored))}
    claims = judge_all(cfg, run, runs, stored, claim_stored)
    path = run / "reproduce.md"
    write_report(path, cfg, reg, runs, rows, claims, stages.total_s, summary.report_path)
    return claims, path


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mbd reproduce", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="QuickstartConfig YAML (the shared knobs)")
    ap.add_argument("--run-dir", default="runs/reproduce")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--seeds", type=int, help="pre-register N training seeds (seed .. seed+N-1) for each of (a), "
                                              "(c), (d), (e) (sets claim_seeds.*; default: the config's)")
    ap.add_argument("--steps", type=int, help="override train.steps of every variant")
    ap.add_argument("--problems", type=int, help="override eval.problems (the curves, claims (d)-(f))")
    ap.add_argument("--claim-problems", type=int, help="override eval.claim_problems (claims (a)-(c))")
    ap.add_argument("--corpus", type=int, help="override corpus.problems")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="override a QuickstartConfig field, e.g. --set train.lr=3e-4")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from stored results; no Ray")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def parts_of(arg: str) -> list[str]:
    parts = [p.strip() for p in arg.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise ConfigError(f"--parts: unknown {unknown or parts}; choose from {','.join(PARTS)}")
    return parts


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    sets = [f"{k}={v}" for k, v in {"train.steps": args.steps, "eval.problems": args.problems,
                                    "eval.claim_problems": args.claim_problems,
                                    "corpus.problems": args.corpus}.items() if v is not None] \
        + [f"claim_seeds.{c}={args.seeds}" for c in "acde" if args.seeds is not None] + args.sets
    try:
        parts = parts_of(args.parts)
        cfg = load_config(args.config, sets)
        t0 = time.perf_counter()
        claims, path = run_reproduce(cfg, Path(args.run_dir), parts, not args.no_progress, args.report_only)
    except ConfigError as e:
        print(f"mbd reproduce: {e}", file=sys.stderr)
        return 2
    print()
    for c in claims:
        print(f"({c.id}) {c.verdict:<15} {c.text}\n    test: {c.test}\n    {c.evidence}")
    print(f"\nreport: {path} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
