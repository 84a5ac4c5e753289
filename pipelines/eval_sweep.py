"""`mbd eval --sweep configs/eval/tiny_sweep.yaml`: an evaluation sweep as a Ray job.

    mbd eval --sweep configs/eval/tiny_sweep.yaml
    mbd eval --sweep configs/eval/paper_main.yaml --limit 50 --output-dir /tmp/quick
    mbd eval --sweep configs/eval/tiny_sweep.yaml --report-only

The driver plans (model, config, benchmark) units of problems not yet stored (mbd.eval.sweep_work), reserves one
placement group for its decoder actors (actors/eval_worker.py: one per GPU, or a CPU share each) and its
scoring slots, spread over the cluster's nodes (pipelines/sweep_pool.py: a cluster that can never hold it is
refused at once, naming the shortfall), and sends every decoded completion to a scoring task in a slot, so
sandboxed code execution never blocks decoding. A node lost mid-sweep costs only the work in flight, redone on
the nodes left. Each scored problem is appended to the results store at once: rerunning an interrupted sweep
decodes only what is missing. An output_dir URI
(s3://, gs://, file://, ...) is worked on in a local staging copy, uploaded every SYNC_S and at the end. At the
end the report (tab:main_results / tab:tps_comparison tables), records.parquet and the plots are written and
the main table is printed. Connects to the cluster in RAY_ADDRESS (as under `ray job submit`), else starts a
local Ray. Benchmarks must be registered in every process (the built-ins and tinymath are).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import ray

from mbd.config import ConfigError, apply_sets, read_yaml, resolve_path, validate
from mbd.eval.benchmarks import Problem, ScoreResult, get_benchmark
from mbd.eval.isolation import UNSAFE_ENV, IsolationUnavailable, require_isolation
from mbd.eval.report import SweepSummary
from mbd.eval.sweep_report import write_sweep_report
from mbd.eval.result_sync import StagedOutput, staged_output
from mbd.eval.sweep import (
    Cell,
    Decoded,
    DecodedUnit,
    PrefixCacheRecord,
    ResultStore,
    SweepConfig,
    load_problems,
    load_splits,
    make_record,
    score_completion,
)
from mbd.eval.sweep_work import Unit, WorkQueue, check_models, plan_units
from mbd.progress import ProgressLine
from pipelines.ray_session import init_ray, ray_session
from pipelines.sweep_pool import DecoderPool

__all__ = ["main", "run_sweep"]  # what other pipelines may use

UNITS_IN_FLIGHT = 2  # per worker: the next unit is queued at the actor while the driver handles the last one
POLL_S = 5.0  # the dispatch loop checks this often that its reservation is whole while it waits for results
SYNC_S = 30.0  # an output_dir URI gets the stored records at least this often (and at the end)
MAX_LOSSES = 3  # lost workers (nodes) a sweep survives; the next loss fails it
# what losing a node (or a worker process) looks like to the driver; any other error fails the sweep
LOST = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
        ray.exceptions.ObjectLostError, ray.exceptions.TaskUnschedulableError,
        ray.exceptions.ActorUnschedulableError, ray.exceptions.TaskPlacementGroupRemoved,
        ray.exceptions.ActorPlacementGroupRemoved)


@ray.remote
def _score(benchmark: str, problem: Problem, completion: str) -> ScoreResult:
    return score_completion(benchmark, problem, completion)


def _scorer_env() -> dict:
    """Scorers run model-written code: carry the user's explicit opt-out of kernel isolation to them."""
    return {"env_vars": {UNSAFE_ENV: "1"}} if os.environ.get(UNSAFE_ENV) == "1" else {}


def run_sweep(cfg: SweepConfig, progress: bool = True) -> SweepSummary:
    """Decode and score every missing (model, config, benchmark, problem), then write the report; an output_dir
    URI is worked on in a local staging copy (mbd/eval/result_sync.py)."""
    with staged_output(cfg.output_dir) as stage:
        return stage.published(_run_local(cfg.model_copy(update={"output_dir": str(stage.local)}), stage, progress))


def _run_local(cfg: SweepConfig, stage: StagedOutput, progress: bool) -> SweepSummary:
    t0 = time.perf_counter()
    splits = load_splits(cfg)
    problems = {label: s.scored for label, s in splits.items()}
    store = ResultStore(cfg.output_dir)
    units, skipped = plan_units(cfg, problems, store, {label: s.exemplars for label, s in splits.items()})
    decoded = 0
    if any(get_benchmark(u.cell.bench.name).kind == "code" for u in units):
        require_isolation()  # refuse before decoding anything, not in a scorer hours later
    if units:
        check_models({u.cell.model.name: u.cell.model for u in units}.values())
        if not ray.is_initialized():
            init_ray()
        pool = DecoderPool(cfg, len(units), cfg.reserve_timeout_s)
        rows = len(cfg.pairs())
        total = rows * sum(len(p) for p in problems.values())
        line = ProgressLine("sweep problems", total, total - sum(len(u.problems) for u in units), show=progress)
        try:
            decoded = _Dispatch(cfg, WorkQueue(units), pool, store, _Accuracy(line), stage).run()
        finally:
            pool.close()
            line.close()
    return write_sweep_report(cfg, problems, decoded, skipped, time.perf_counter() - t0)


class _Accuracy:
    """The sweep's progress line: problems scored (stored ones included) and, per benchmark, the accuracy of
    the problems scored in this run."""

    def __init__(self, line: ProgressLine):
        self.line, self.counts = line, {}

    def scored(self, benchmark: str, correct: bool) -> None:
        right, n = self.counts.get(benchmark, (0, 0))
        self.counts[benchmark] = (right + correct, n + 1)
        self.line.update(1, accuracy=" ".join(f"{b} {100 * r / n:.1f}%" for b, (r, n) in self.counts.items()))


class _Dispatch:
    """The dispatch loop: keep every decoder fed, score each decoded problem in a scoring slot, store each verdict.

    A lost decoder or scoring task (its node died) never stalls the loop: every unit and score in flight goes
    back to be redone, the pool reserves again on the nodes left, and the loop carries on. Nothing is stored
    twice: a unit's records are written only when its scores come back, and a unit whose decoding came back
    before the loss is only scored again, not decoded again."""

    def __init__(self, cfg: SweepConfig, queue: WorkQueue, pool: DecoderPool, store: ResultStore,
                 progress: _Accuracy, stage: StagedOutput):
        self.cfg, self.queue, self.pool, self.store, self.stage = cfg, queue, pool, store, stage
        self.progress = progress
        self.inflight: dict[ray.ObjectRef, tuple] = {}
        self.problem_refs: dict[tuple[str, str], ray.ObjectRef] = {}
        self.decoded = self.losses = 0
        self._reset_workers()

    def _reset_workers(self) -> None:
        self.busy = [0] * len(self.pool.workers)
        self.holds: list[tuple | None] = [None] * len(self.pool.workers)  # the engine key each worker holds

    def run(self) -> int:
        for w in range(len(self.pool.workers)):
            self.feed(w)
        while self.inflight:
            ready, _ = ray.wait(list(self.inflight), num_returns=1, timeout=POLL_S)
            if not ready:
                if self.pool.broken():
                    self.recover(RuntimeError("a bundle of the sweep's placement group lost its node"))
                continue
            what = self.inflight.pop(ready[0])
            try:
                value = ray.get(ready[0])
            except LOST as e:
                self.inflight[ready[0]] = what
                self.recover(e)
                continue
            if what[0] == "decode":
                self.decoded_unit(what[1], what[2], value)
            else:
                _, cell, problem, d = what
                self.store.append(make_record(cell.model.name, cell.decode.name, cell.benchmark, problem,
                                              d.model_copy(update={"trace": None}), value))
                self.progress.scored(cell.benchmark, value.correct)
                self.stage.push(every_s=SYNC_S)
        return self.decoded

    def feed(self, w: int) -> None:
        while self.busy[w] < UNITS_IN_FLIGHT and (unit := self.queue.pop(self.holds[w])) is not None:
            self.holds[w] = unit.key
            self.busy[w] += 1
            ref = self.pool.workers[w].decode.remote(unit.cell.model, unit.params, unit.prompts(), unit.keep_trace)
            self.inflight[ref] = ("decode", w, unit)

    def decoded_unit(self, w: int, unit: Unit, out: DecodedUnit) -> None:
        self.busy[w] -= 1
        self.feed(w)
        cell = unit.cell
        self.store.append_prefix_cache(cell.model.name, cell.decode.name, cell.benchmark, PrefixCacheRecord(
            problem_ids=[p.problem_id for p in unit.problems], query_tokens=out.prefix_query_tokens,
            hit_tokens=out.prefix_hit_tokens, node=out.node))
        for problem, d in zip(unit.problems, out.decoded):
            if d.trace is not None:
                self.store.append_trace(cell.model.name, cell.decode.name, cell.benchmark, problem.problem_id,
                                        d.trace)
            self.score(cell, problem, d)
            self.decoded += 1

    def score(self, cell: Cell, problem: Problem, d: Decoded) -> None:
        key = (problem.benchmark, problem.problem_id)
        if key not in self.problem_refs:  # one copy in the object store, shared by every config's scoring tasks
            self.problem_refs[key] = ray.put(problem)
        ref = _score.options(**self.pool.score_options(_scorer_env())).remote(
            cell.bench.name, self.problem_refs[key], d.completion)
        self.inflight[ref] = ("score", cell, problem, d)

    def recover(self, error: BaseException) -> None:
        """Put every unit in flight back in the queue and every score in flight aside, reserve again, go on."""
        self.losses += 1
        if self.losses > MAX_LOSSES:
            raise RuntimeError(f"the sweep lost workers {self.losses} times; giving up") from error
        units = [w[2] for w in self.inflight.values() if w[0] == "decode"]
        scores = [w[1:] for w in self.inflight.values() if w[0] == "score"]
        self.inflight.clear()
        for unit in reversed(units):
            self.queue.requeue(unit)
        self.pool.rebuild(error, {"units": len(units), "problems": sum(len(u.problems) for u in units),
                                  "scores": len(scores)})
        self._reset_workers()
        for cell, problem, d in scores:
            self.score(cell, problem, d)
        for w in range(len(self.pool.workers)):
            self.feed(w)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mbd eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", required=True, help="sweep YAML, e.g. configs/eval/tiny_sweep.yaml")
    ap.add_argument("--output-dir", help="override output_dir")
    ap.add_argument("--limit", type=int, help="override every benchmark's limit (quick runs)")
    ap.add_argument("--workers", type=int, help="override the number of decoder actors")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], help="override device")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field, e.g. --set workers=2 --set scorers=1")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from stored records; no Ray")
    ap.add_argument("--no-progress", action="store_true",
                    help="no redrawn progress line: a full one every 30 s (e.g. in job logs)")
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
        with staged_output(cfg.output_dir) as stage:
            local = cfg.model_copy(update={"output_dir": str(stage.local)})
            if args.report_only:
                summary = write_sweep_report(local, load_problems(local))
            else:
                with ray_session(stage.local):
                    summary = run_sweep(local, progress=not args.no_progress)
            summary = stage.published(summary)
    except (ConfigError, FileNotFoundError, IsolationUnavailable) as e:
        print(f"mbd eval: {e}", file=sys.stderr)
        return 2
    print(summary.table_markdown)
    print(f"\ndecoded {summary.decoded}, resumed past {summary.skipped} stored problems, {summary.wall_s:.1f}s; "
          f"report: {summary.report_path}; plots: {', '.join(summary.plots)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
