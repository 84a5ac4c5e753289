"""Guard for training changes: the quickstart recipe's MBD-tiny against SingleBD on 10,000 held-out problems.

    python -m benchmarks.tiny_parity                          # seeds 0,1,2: about 20 minutes on 2 cores
    python -m benchmarks.tiny_parity --seeds 0 --run-dir /tmp/parity --set train.lr=2e-3

Run it before a change to mbd/multitf/, pipelines/expand_layouts.py or pipelines/train_multitf.py lands
(docs/training.md): 1,000 problems (the quickstart's) give a 5 pp wide interval and cannot see the 2 pp that a
change on the path from corpus to loss once cost. Each seed s trains the quickstart recipe (configs/quickstart.yaml
with `seed: s`: corpus, Ray Data expansion, Ray Train + DeepSpeed, `pipelines.stages`), and one evaluation sweep
decodes the first --problems held-out problems at the operating points: every MBD-tiny under MultiBD and the
shipped base under SingleBD. Per seed it prints the paired accuracy difference (95% CI over problems) and the TPF
ratio, then the mean over seeds with its seed-level interval (`mbd.eval.stats.seed_paired_difference`).

Exit status 1 when the mean difference is below -1 pp or the mean TPF ratio below 2.0x (the point targets of the
quickstart recipe), else 0. Trained models and decoded problems are kept under --run-dir and reused on a re-run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mbd.config import resolve_path
from mbd.eval.stats import paired_difference, seed_paired_difference
from pipelines.ray_session import ray_session
from pipelines.stages import (DEFAULT_CONFIG, SINGLEBD, MethodSpec, QuickstartConfig, curves_of, expand_stage,
                              load_config, sweep_config, train_stage, write_corpus)

MIN_DIFF_PP = -1.0  # MBD-tiny at most 1 pp below SingleBD (point estimate)
MIN_TPF_RATIO = 2.0


def train_seed(cfg: QuickstartConfig, run: Path, base: Path, seed: int, progress: bool) -> Path:
    """The quickstart recipe with `seed: seed` -> its exported MBD-tiny (kept, and reused when present)."""
    out = run / f"seed{seed}"
    model = out / "mbd-tiny"
    if (model / "config.json").is_file():
        print(f"    stored: {model}", flush=True)
        return model
    seeded = cfg.model_copy(update={"seed": seed})
    corpus = write_corpus(out / "corpus" / "train.jsonl", cfg.corpus.problems, seed)
    rows_dir = expand_stage(seeded, corpus, out / "layouts", base).rows_dir
    train_stage(seeded, out, base, rows_dir, progress)
    return model


def methods_of(cfg: QuickstartConfig, seeds: list[int]) -> list[MethodSpec]:
    return [(SINGLEBD, "singlebd", cfg.eval.singlebd, "base")] + [
        (f"MBD-tiny seed {s}", f"mbd-s{s}", cfg.eval.multibd, f"mbd-s{s}") for s in seeds]


def measure(cfg: QuickstartConfig, run: Path, seeds: list[int], problems: int, progress: bool) -> dict:
    """Train every seed, decode the operating points, and compare each MBD-tiny with SingleBD."""
    from pipelines.eval_sweep import run_sweep

    base = resolve_path(cfg.base_model)
    methods = methods_of(cfg, seeds)
    with ray_session(run, cfg.num_cpus):
        models = [("base", base)] + [(f"mbd-s{s}", train_seed(cfg, run, base, s, progress)) for s in seeds]
        run_sweep(sweep_config(cfg, run / "eval", models, methods, problems, operating=True), progress=progress)
    curves = curves_of(cfg, run / "eval", methods, problems, operating=True)
    single, mbd = curves[SINGLEBD], [curves[m[0]] for m in methods[1:]]
    per_seed = [{"seed": s, "accuracy": m.accuracy(), "tpf_ratio": m.tpf() / single.tpf(),
                 **paired_difference(single.correct[0], m.correct[0]).model_dump()} for s, m in zip(seeds, mbd)]
    out = {"problems": problems, "singlebd": {"accuracy": single.accuracy(), "tpf": single.tpf()},
           "per_seed": per_seed, "mean_diff_pp": sum(p["diff_pp"] for p in per_seed) / len(seeds),
           "mean_tpf_ratio": sum(p["tpf_ratio"] for p in per_seed) / len(seeds)}
    if len(seeds) > 1:
        out["over_seeds"] = seed_paired_difference(single.correct[0], [m.correct[0] for m in mbd]).model_dump()
    return out


def report(r: dict) -> bool:
    print(f"\nSingleBD (shipped base): {r['singlebd']['accuracy']:.2f}%, TPF {r['singlebd']['tpf']:.2f}; "
          f"{r['problems']} held-out problems")
    print(f"{'seed':>4} {'MBD-tiny':>8} {'MBD - SingleBD (95% CI over problems)':>40} {'TPF':>6}")
    for p in r["per_seed"]:
        ci = f"{p['diff_pp']:+.2f} pp [{p['ci_low_pp']:+.2f}, {p['ci_high_pp']:+.2f}]"
        print(f"{p['seed']:>4} {p['accuracy']:>7.2f}% {ci:>40} {p['tpf_ratio']:>5.2f}x")
    if "over_seeds" in r:
        s = r["over_seeds"]
        print(f"over seeds: {s['mean']:+.2f} pp [95% CI {s['ci_low']:+.2f}, {s['ci_high']:+.2f}] (seed SD "
              f"{s['sd_seeds']:.2f} pp, df {s['df']})")
    ok = r["mean_diff_pp"] >= MIN_DIFF_PP and r["mean_tpf_ratio"] >= MIN_TPF_RATIO
    print(f"{'PASS' if ok else 'FAIL'}: mean difference {r['mean_diff_pp']:+.2f} pp (target >= {MIN_DIFF_PP:+.1f}), "
          f"mean TPF ratio {r['mean_tpf_ratio']:.2f}x (target >= {MIN_TPF_RATIO:.1f}x)")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    ap.add_argument("--problems", type=int, default=10000, help="first N held-out problems")
    ap.add_argument("--run-dir", default="runs/tiny_parity")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="override a QuickstartConfig field of every seed, e.g. --set train.lr=2e-3")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    cfg = load_config(args.config, args.sets)
    run = Path(args.run_dir).resolve()
    result = measure(cfg, run, seeds, args.problems, not args.no_progress)
    (run / "parity.json").write_text(json.dumps({"sets": args.sets, **result}, indent=2))
    return 0 if report(result) else 1


if __name__ == "__main__":
    sys.exit(main())
