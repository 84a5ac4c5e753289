"""A/B of tiny recipes on the DEV split (`tinymath-dev`, never a test problem): how a choice is made before the
registered test run.

    python -m benchmarks.tiny_dev_ab train --arm current --base mbd/assets/tiny --set train.objective.name=multitf_ce
    python -m benchmarks.tiny_dev_ab train --arm faithful --base runs/base-bd          # the family's objective
    python -m benchmarks.tiny_dev_ab decode --arm current --arm faithful
    python -m benchmarks.tiny_dev_ab report --arm current --arm faithful --json runs/dev_ab/report.json

An arm is a base model plus the quickstart recipe with --set items (configs/quickstart.yaml); `train` post-trains
it once per seed (the quickstart's stages: posttrain corpus, Ray Data expansion, Ray Train), kept under
--run-dir/<arm>/seed<s> and reused. `decode` decodes the first --problems dev problems with every decode point
(`POINTS`) for every arm's base (SingleBD points) and MBD-tiny (MultiBD points), greedy on CPU, and stores each
problem's outcome. `report` prints, per arm and MultiBD point, MBD-tiny - its own base's SingleBD (paired over the
problems per seed, Student-t over seeds with `mbd.eval.stats.seed_paired_difference`), and, between two arms,
the difference of their seed-matched runs. Folders are named by arm, not by a code hash: the caller keeps the code
fixed across an A/B (docs/reproduce.md states the commit).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from mbd.config import DecodeConfig, load_decode, resolve_path, validate
from mbd.eval.stats import paired_difference, seed_interval, seed_paired_difference, t_quantile_975
from pipelines.stages import DEFAULT_CONFIG, DEV_BENCHMARK, load_config

# name -> (decode YAML, overrides). multibd_ge: tau_add / tau_semi 0.49 under the strict test of
# alg:optimized_multibd pass exactly where the former `>= 0.5` did at B = 4 (progress takes the values k / 4).
POINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "singlebd": ("configs/decode/tiny_singlebd.yaml", {}),
    "singlebd_m2t95": ("configs/decode/tiny_singlebd.yaml", {"tau_m2t": 0.95}),
    "multibd_ge": ("configs/decode/tiny_multibd.yaml", {"tau_add": 0.49, "tau_semi": 0.49, "tau_m2t": 0.9}),
    "multibd_strict_05": ("configs/decode/tiny_multibd.yaml", {"tau_add": 0.5, "tau_semi": 0.5, "tau_m2t": 0.9}),
    "multibd_paper_b4": ("configs/decode/tiny_multibd.yaml", {"tau_add": 0.10, "tau_semi": 0.25, "tau_m2t": 0.95}),
    # activation at 2 of 4 tokens (a third block can open: claim (f)), the semi fallback still at 3 of 4
    "multibd_add2_semi3": ("configs/decode/tiny_multibd.yaml", {"tau_add": 0.49, "tau_semi": 0.5, "tau_m2t": 0.9}),
}


def point(name: str) -> DecodeConfig:
    path, over = POINTS[name]
    base = load_decode(resolve_path(path))[0]
    return validate(DecodeConfig, {**base.model_dump(), **over}, f"decode point {name}")


def arm_dir(run: Path, arm: str) -> Path:
    return run / arm


def train(run: Path, arm: str, base: Path, sets: list[str], seeds: list[int], progress: bool) -> None:
    from benchmarks.tiny_parity import train_seed
    from pipelines.ray_session import ray_session

    out = arm_dir(run, arm)
    out.mkdir(parents=True, exist_ok=True)
    meta = out / "arm.json"
    record = {"base": str(base.resolve()), "sets": sets}
    if meta.is_file() and json.loads(meta.read_text()) != record:
        raise SystemExit(f"{meta}: this arm was trained with {meta.read_text()}; use another --arm name")
    meta.write_text(json.dumps(record, indent=2))
    cfg = load_config(DEFAULT_CONFIG, sets)
    with ray_session(out, cfg.num_cpus):
        for s in seeds:
            train_seed(cfg, out, base.resolve(), s, progress)


def decode_one(model: Path, name: str, problems: int, out: Path, cfg: DecodeConfig | None = None) -> dict:
    """Outcome of every problem (kept in `out`, reused when present), decoded at `cfg` (default: `point(name)`)."""
    if out.is_file():
        return json.loads(out.read_text())
    from mbd.config import EngineConfig
    from mbd.decoding import build_engine
    from mbd.eval.benchmarks import get_benchmark

    bench = get_benchmark(DEV_BENCHMARK)
    probs = bench.load(limit=problems)
    engine = build_engine(model, cfg or point(name), EngineConfig(device="cpu", dtype="float32", max_batch_rows=16,
                                                                  threads=1))
    results = engine.generate([p.prompt_text for p in probs])
    rec = {"model": str(model), "point": name, "problems": len(probs),
           "correct": [bench.score(p, r.text).correct for p, r in zip(probs, results)],
           "nfe": [r.nfe for r in results], "generated": [r.num_generated for r in results],
           "text": [r.text for r in results], "token_ids": [r.token_ids for r in results],
           "finish": [r.finish_reason for r in results]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec))
    print(f"    {model.name} {name}: {100 * sum(rec['correct']) / len(probs):.2f}% TPF "
          f"{sum(rec['generated']) / sum(rec['nfe']):.2f}", flush=True)
    return rec


def models_of(run: Path, arm: str) -> tuple[Path, dict[int, Path]]:
    meta = json.loads((arm_dir(run, arm) / "arm.json").read_text())
    seeds = sorted(int(p.name[4:]) for p in arm_dir(run, arm).glob("seed*") if (p / "mbd-tiny/config.json").is_file())
    return Path(meta["base"]), {s: arm_dir(run, arm) / f"seed{s}" / "mbd-tiny" for s in seeds}


def decode(run: Path, arms: list[str], problems: int, points: list[str]) -> None:
    for arm in arms:
        base, mbd = models_of(run, arm)
        for name in points:
            if name.startswith("singlebd"):
                decode_one(base, name, problems, arm_dir(run, arm) / "decoded" / f"base.{name}.{problems}.json")
        for s, model in mbd.items():
            for name in points:
                if name.startswith("multibd"):
                    decode_one(model, name, problems, arm_dir(run, arm) / "decoded" / f"seed{s}.{name}.{problems}.json")


def tpf(recs: list[dict]) -> float:
    return sum(sum(r["generated"]) for r in recs) / sum(sum(r["nfe"]) for r in recs)


def load(run: Path, arm: str, key: str, problems: int) -> dict:
    return json.loads((arm_dir(run, arm) / "decoded" / f"{key}.{problems}.json").read_text())


def arm_report(run: Path, arm: str, problems: int, points: list[str]) -> dict:
    """Base SingleBD points, and per MultiBD point MBD-tiny vs the base's SingleBD (tau_m2t 0.9) over seeds."""
    _, mbd = models_of(run, arm)
    single = load(run, arm, "base.singlebd", problems)
    out: dict = {"seeds": sorted(mbd), "singlebd": {}, "multibd": {}}
    for name in points:
        if name.startswith("singlebd"):
            r = load(run, arm, f"base.{name}", problems)
            out["singlebd"][name] = {"accuracy": 100 * float(np.mean(r["correct"])), "tpf": tpf([r])}
    for name in points:
        if not name.startswith("multibd"):
            continue
        runs = [load(run, arm, f"seed{s}.{name}", problems) for s in sorted(mbd)]
        row = {"accuracy": [100 * float(np.mean(r["correct"])) for r in runs],
               "tpf_ratio": [tpf([r]) / out["singlebd"]["singlebd"]["tpf"] for r in runs],
               "per_seed": [paired_difference(single["correct"], r["correct"]).model_dump() for r in runs]}
        if len(runs) > 1:
            row["over_seeds"] = seed_paired_difference(single["correct"], [r["correct"] for r in runs]).model_dump()
        out["multibd"][name] = row
    return out


def between(run: Path, a: str, b: str, name: str, problems: int) -> dict | None:
    """Arm b - arm a at MultiBD point `name`, seed s against seed s (the same post-training corpus): per seed the
    accuracy difference in pp, over seeds a Student-t interval whose problem share is the paired SE."""
    sa, sb = models_of(run, a)[1], models_of(run, b)[1]
    seeds = sorted(set(sa) & set(sb))
    if len(seeds) < 2:
        return None
    ra = np.array([load(run, a, f"seed{s}.{name}", problems)["correct"] for s in seeds], dtype=float)
    rb = np.array([load(run, b, f"seed{s}.{name}", problems)["correct"] for s in seeds], dtype=float)
    d = rb.mean(0) - ra.mean(0)
    se = 100 * float(d.std(ddof=1)) / math.sqrt(d.size)
    return seed_interval((100 * (rb.mean(1) - ra.mean(1))).tolist(), se, d.size).model_dump()


def seeds_for_halfwidth(sd_seeds: float, se_problems: float, half: float = 1.0, most: int = 50) -> int | None:
    """Fewest seeds S whose 95% interval (`seed_interval`, df ~ S - 1 when the seeds' spread dominates) is at most
    `half` pp wide on each side, given the seed SD and the problems' SE of the registered test; None if > most."""
    for s in range(2, most + 1):
        if t_quantile_975(s - 1) * math.sqrt(sd_seeds**2 / s + se_problems**2) <= half:
            return s
    return None


def report(run: Path, arms: list[str], problems: int, points: list[str]) -> dict:
    out = {"problems": problems, "benchmark": DEV_BENCHMARK, "arms": {a: arm_report(run, a, problems, points) for a in arms}}
    for a in arms:
        r = out["arms"][a]
        single = ", ".join(f"{k} {v['accuracy']:.2f}% TPF {v['tpf']:.2f}" for k, v in r["singlebd"].items())
        print(f"\n[{a}] base SingleBD: {single}")
        for name, row in r["multibd"].items():
            seeds = ", ".join(f"{p['diff_pp']:+.2f}" for p in row["per_seed"])
            line = f"  MBD-tiny {name}: acc {np.mean(row['accuracy']):.2f}% TPF x{np.mean(row['tpf_ratio']):.2f}; " \
                   f"vs SingleBD per seed {seeds} pp"
            if "over_seeds" in row:
                s = row["over_seeds"]
                # the test's problem SE: this SE scaled from the dev problems to the 10,000 test problems
                se_test = s["se_problems"] * math.sqrt(problems / 10000)
                row["seeds_for_1pp"] = seeds_for_halfwidth(s["sd_seeds"], se_test)
                line += (f"; over seeds {s['mean']:+.2f} [{s['ci_low']:+.2f}, {s['ci_high']:+.2f}] "
                         f"(SD {s['sd_seeds']:.2f}"
                         f"; seeds for a +-1 pp interval on 10,000 problems: {row['seeds_for_1pp']})")
            print(line)
    if len(arms) == 2:
        out["between"] = {}
        for name in points:
            if name.startswith("multibd") and (d := between(run, arms[0], arms[1], name, problems)):
                out["between"][name] = d
                print(f"{arms[1]} - {arms[0]} at {name}: {d['mean']:+.2f} pp [{d['ci_low']:+.2f}, {d['ci_high']:+.2f}] "
                      f"(per seed {', '.join(f'{v:+.2f}' for v in d['per_seed'])})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["train", "decode", "report"])
    ap.add_argument("--arm", action="append", required=True)
    ap.add_argument("--base", default="mbd/assets/tiny", help="train: the arm's base model")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="train: a quickstart config item")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--problems", type=int, default=2000, help="first N dev problems")
    ap.add_argument("--run-dir", default="runs/dev_ab")
    ap.add_argument("--json", default=None, help="report: also write it here")
    ap.add_argument("--points", nargs="+", default=list(POINTS), choices=list(POINTS),
                    help="decode / report: these points only (the base's singlebd is always needed)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    run = Path(args.run_dir).resolve()
    if args.phase == "train":
        train(run, args.arm[0], resolve_path(args.base), args.sets, args.seeds, not args.no_progress)
    elif args.phase == "decode":
        decode(run, args.arm, args.problems, args.points)
    else:
        result = report(run, args.arm, args.problems, args.points)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
