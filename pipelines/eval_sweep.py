"""`mbd eval --sweep configs/eval/tiny_sweep.yaml`: an evaluation sweep as a Ray job.

    mbd eval --sweep configs/eval/tiny_sweep.yaml
    mbd eval --sweep configs/eval/paper_main.yaml --limit 50 --output-dir /tmp/quick
    mbd eval --sweep configs/eval/tiny_sweep.yaml --report-only

The driver plans (model, config, benchmark) units of problems not yet stored (mbd.eval.sweep), hands them to
decoder actors (actors/eval_worker.py: one per GPU, or a CPU share each), and sends every decoded completion
to a pool of Ray scoring tasks, so sandboxed code execution never blocks decoding. Each scored problem is
appended to the results store at once: rerunning an interrupted sweep decodes only what is missing. At the
end the report (tab:main_results / tab:tps_comparison tables), records.parquet and the plots are written and
the main table is printed. Connects to the cluster in RAY_ADDRESS (as under `ray job submit`), else starts a
local Ray. Benchmarks must be registered in every process (the built-ins and tinymath are).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import ray
from tqdm import tqdm

from actors.eval_worker import EvalWorker
from mbd.config import ConfigError, apply_sets, read_yaml, resolve_path, validate
from mbd.eval.benchmarks import Problem, ScoreResult, get_benchmark
from mbd.eval.code_exec import UNSAFE_ENV, IsolationUnavailable, require_isolation
from mbd.eval.report import SweepSummary, write_sweep_report
from mbd.eval.sweep import (PrefixCacheRecord, ResultStore, SweepConfig, WorkQueue, check_models, load_problems,
                            load_splits, make_record, plan_units, score_completion)
from pipelines.ray_session import ray_session

UNITS_IN_FLIGHT = 2  # per worker: the next unit is queued at the actor while the driver handles the last one


@ray.remote
def _score(benchmark: str, problem: Problem, completion: str) -> ScoreResult:
    return score_completion(benchmark, problem, completion)


def _workers(cfg: SweepConfig) -> tuple[str, int, float]:
    """(device, number of decoder actors, GPUs per actor) for the connected cluster."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    device = cfg.engine.device if cfg.engine.device != "auto" else ("cuda" if gpus else "cpu")
    if device == "cuda" and gpus == 0:
        raise ConfigError("engine.device: cuda but the Ray cluster has no GPU; use device: cpu (or auto)")
    return device, cfg.workers or (gpus if device == "cuda" else 1), 1.0 if device == "cuda" else 0.0


def _scorer_env() -> dict:
    """Scorers run model-written code: carry the user's explicit opt-out of kernel isolation to them."""
    return {"env_vars": {UNSAFE_ENV: "1"}} if os.environ.get(UNSAFE_ENV) == "1" else {}


def run_sweep(cfg: SweepConfig, progress: bool = True) -> SweepSummary:
    """Decode and score every missing (model, config, benchmark, problem), then write the report."""
    t0 = time.perf_counter()
    splits = load_splits(cfg)
    problems = {label: s.scored for label, s in splits.items()}
    store = ResultStore(cfg.output_dir)
    units, skipped = plan_units(cfg, problems, store, {label: s.exemplars for label, s in splits.items()})
    queue = WorkQueue(units)
    decoded = 0
    if any(get_benchmark(u.cell.bench.name).kind == "code" for u in units):
        require_isolation()  # refuse before decoding anything, not in a scorer hours later
    if units:
        check_models({u.cell.model.name: u.cell.model for u in units}.values())
        if not ray.is_initialized():
            ray.init()
        device, n, gpus = _workers(cfg)
        threads = cfg.engine.threads or (max(1, int(cfg.cpus_per_worker)) if device == "cpu" else None)
        engine = cfg.engine.model_copy(update={"device": device, "threads": threads, "trace": cfg.trace_problems > 0})
        workers = [EvalWorker.options(num_cpus=cfg.cpus_per_worker, num_gpus=gpus).remote(engine)
                   for _ in range(min(n, len(units)))]
        rows = len(cfg.pairs())
        bars = {}
        for pos, b in enumerate(problems):
            todo = sum(len(u.problems) for u in units if u.cell.benchmark == b)
            bars[b] = tqdm(total=rows * len(problems[b]), initial=rows * len(problems[b]) - todo, desc=b,
                           position=pos, disable=not progress, file=sys.stderr)
        try:
            decoded = _drive(cfg, queue, workers, store, bars)
        finally:
            for w in workers:
                ray.kill(w)
            for bar in bars.values():
                bar.close()
    return write_sweep_report(cfg, problems, decoded, skipped, time.perf_counter() - t0)


def _drive(cfg: SweepConfig, queue: WorkQueue, workers: list, store: ResultStore, bars: dict[str, tqdm]) -> int:
    """The dispatch loop: keep every worker fed, score each decoded problem in the pool, store each verdict."""
    inflight: dict[ray.ObjectRef, tuple] = {}
    busy = [0] * len(workers)
    holds: list[tuple | None] = [None] * len(workers)  # the engine key each worker holds
    problem_refs: dict[tuple[str, str], ray.ObjectRef] = {}
    decoded = 0

    def feed(w: int) -> None:
        while busy[w] < UNITS_IN_FLIGHT and (unit := queue.pop(holds[w])) is not None:
            holds[w] = unit.key
            busy[w] += 1
            ref = workers[w].decode.remote(unit.cell.model, unit.params, unit.prompts(), unit.keep_trace)
            inflight[ref] = ("decode", w, unit)

    def problem_ref(p: Problem) -> ray.ObjectRef:
        key = (p.benchmark, p.problem_id)
        if key not in problem_refs:  # one copy in the object store, shared by every config's scoring tasks
            problem_refs[key] = ray.put(p)
        return problem_refs[key]

    for w in range(len(workers)):
        feed(w)
    while inflight:
        (ref,), _ = ray.wait(list(inflight), num_returns=1)
        what = inflight.pop(ref)
        if what[0] == "decode":
            _, w, unit = what
            busy[w] -= 1
            feed(w)
            cell, out = unit.cell, ray.get(ref)
            store.append_prefix_cache(cell.model.name, cell.decode.name, cell.benchmark, PrefixCacheRecord(
                problem_ids=[p.problem_id for p in unit.problems], query_tokens=out.prefix_query_tokens,
                hit_tokens=out.prefix_hit_tokens))
            for problem, d in zip(unit.problems, out.decoded):
                if d.trace is not None:
                    store.append_trace(cell.model.name, cell.decode.name, cell.benchmark, problem.problem_id, d.trace)
                score = _score.options(num_cpus=cfg.cpus_per_scorer, runtime_env=_scorer_env()).remote(
                    cell.bench.name, problem_ref(problem), d.completion)
                inflight[score] = ("score", cell, problem, d)
                decoded += 1
        else:
            _, cell, problem, d = what
            store.append(make_record(cell.model.name, cell.decode.name, cell.benchmark, problem,
                                     d.model_copy(update={"trace": None}), ray.get(ref)))
            bars[cell.benchmark].update(1)
    return decoded


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mbd eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", required=True, help="sweep YAML, e.g. configs/eval/tiny_sweep.yaml")
    ap.add_argument("--output-dir", help="override output_dir")
    ap.add_argument("--limit", type=int, help="override every benchmark's limit (quick runs)")
    ap.add_argument("--workers", type=int, help="override the number of decoder actors")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], help="override device")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field, e.g. --set workers=2 --set scoring_workers=1")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from stored records; no Ray")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars (e.g. in job logs)")
    ap.add_argument("--unsafe-code-exec", action="store_true",
                    help="score code benchmarks even where kernel isolation (bubblewrap) is unavailable, with "
                         "Python-level guards only: model-written code could then read and change this machine")
    return ap


def load_with_flags(args: argparse.Namespace) -> SweepConfig:
    """The sweep YAML with `--set` items; --output-dir/--workers/--device are shorthands for sets, --limit sets
    every benchmark's limit."""
    sets = [f"{k}={getattr(args, k)}" for k in ("output_dir", "workers") if getattr(args, k) is not None]
    sets += [f"engine.device={args.device}"] if args.device is not None else []
    data = apply_sets(read_yaml(resolve_path(args.sweep)), [*sets, *args.sets])
    if args.limit is not None:
        data["benchmarks"] = [{**b, "limit": args.limit} for b in data.get("benchmarks", [])]
    return validate(SweepConfig, data, args.sweep)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.unsafe_code_exec:
        os.environ[UNSAFE_ENV] = "1"
    try:
        cfg = load_with_flags(args)
        if args.report_only:
            summary = write_sweep_report(cfg, load_problems(cfg))
        else:
            with ray_session(Path(cfg.output_dir)):
                summary = run_sweep(cfg, progress=not args.no_progress)
    except (ConfigError, FileNotFoundError, IsolationUnavailable) as e:
        print(f"mbd eval: {e}", file=sys.stderr)
        return 2
    print(summary.table_markdown)
    print(f"\ndecoded {summary.decoded}, resumed past {summary.skipped} stored problems, {summary.wall_s:.1f}s; "
          f"report: {summary.report_path}; plots: {', '.join(summary.plots)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
