"""The stages `mbd quickstart` and `mbd reproduce` share, on the embedded tiny model: their config
(configs/quickstart.yaml), stage banners, the tinymath corpus, Ray Data expansion, Ray Train post-training and
the evaluation sweep's config and read-back.

Each stage calls a project job (`run_expand`, `run_train`) or builds the config of one (`sweep_config` for
`run_sweep`) and adds no algorithm of its own. A method is a tuple (label, key, decode YAML, model name): one
AUP curve, whose points are `eval.curve` (plus `eval.multibd_curve` under MultiBD) applied to the decode YAML.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

from pydantic import Field, model_validator

from mbd.config import REPO_ROOT, DecodeConfig, StrictModel, load_decode, load_yaml, resolve_path, validate
from mbd.eval.claims import Curve, load_curve
from mbd.eval.report import CellMetrics, Method, MethodRow, method_rows
from mbd.eval.sweep import ResultStore
from mbd.multitf.objectives import ObjectiveSection
from mbd.multitf.corrupt import Masking
from mbd.multitf.schedulers import SchedulerConfig

__all__ = ["DEFAULT_CONFIG", "BENCHMARK", "DEV_BENCHMARK", "SINGLEBD", "MULTIBD_TF", "MethodSpec", "QuickstartConfig",
           "ExpandSection", "ClaimSeeds", "load_config", "Stages", "write_corpus", "expand_stage", "train_config",
           "train_stage",
           "point_name", "sweep_config", "as_methods", "rows_of", "tps_stage", "curves_of", "section_title",
           "overrides_of"]

DEFAULT_CONFIG = REPO_ROOT / "configs" / "quickstart.yaml"
BENCHMARK = "tinymath"  # the held-out split: the registered test, judged once
DEV_BENCHMARK = "tinymath-dev"  # the dev split: where recipes, thresholds and steps are chosen
SINGLEBD, MULTIBD_TF = "SingleBD (Native)", "MultiBD (training-free)"
MethodSpec = tuple[str, str, str, str]  # (label, key, decode YAML, model name)


# ---------------------------------------------------------------- configuration

class CorpusSection(StrictModel):
    problems: int = Field(default=2000, gt=0, description="tinymath posttrain-part problems expanded and trained on")


class ExpandSection(StrictModel):
    mode: Literal["multitf", "d2f"] = Field(default="multitf", description="d2f: the authors' D2F ablation rows")
    gmax: int = Field(default=4, ge=2)
    n_rand: int = Field(default=2, ge=0)
    scheduler: SchedulerConfig = SchedulerConfig()
    masking: Masking = Field(default="floor_count", description="floor_count (alg:multitf_training) or bernoulli "
                                                                "(eq:forward): mbd.multitf.corrupt")
    max_length: int = Field(default=128, gt=0, description="padded prompt + response tokens")
    sequences_per_task: int = Field(default=250, gt=0)


class TrainSection(StrictModel):
    steps: int = Field(default=800, gt=0)
    num_workers: int = Field(default=2, ge=1)
    cpus_per_worker: float = Field(default=0.5, gt=0)
    zero_stage: int = Field(default=2, ge=2, le=3)
    micro_batch_size: int = Field(default=16, ge=1)
    grad_accum: int = Field(default=1, ge=1)
    lr: float = Field(default=1e-3, gt=0)
    warmup_steps: int = Field(default=20, ge=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    grad_clip: float = Field(default=1.0, ge=0)
    objective: ObjectiveSection | None = Field(
        default=None, description="None: the base model family's objective (`objectives.FAMILY_OBJECTIVE`: the tiny "
        "sdar base trains with the SDAR 1/t-weighted CE of sec:appendix_sdar_objective)")


class EvalSection(StrictModel):
    problems: int = Field(default=1000, gt=0, description="first N problems of the held-out split")
    claim_problems: int = Field(default=10000, gt=0, description="`mbd reproduce`: first N held-out problems of "
                                "claims (a)-(c), decoded at the operating points only (the quickstart's 1,000 give a "
                                "5 pp wide interval, these about 1.6 pp)")
    singlebd: str = "configs/decode/tiny_singlebd.yaml"
    multibd: str = "configs/decode/tiny_multibd.yaml"
    curve: list[dict[str, Any]] = Field(default=[{}, {"tau_m2t": 0.7}, {"tau_m2t": 0.5}], min_length=1,
                                        description="decode overrides of every method; point 0 is the operating "
                                                    "point")
    multibd_curve: list[dict[str, Any]] = Field(
        default=[{"tau_add": 0.25}, {"buffer_size": 2}],
        description="further points of MultiBD methods only (buffer_size / tau_add do nothing under SingleBD)")
    batch_size: int = Field(default=16, ge=1)
    tps_problems: int = Field(default=16, ge=1, description="held-out problems of the side-by-side TPS timing")
    tps_rounds: int = Field(default=3, ge=1, description="interleaved rounds of the TPS timing (median reported)")
    tps_batches: list[int] = Field(default=[1, 8], min_length=1, description=(
        "requests decoded together in the TPS timing, a column each: 1 is the paper's setting, 8 the tiny service's "
        "batch rows (MBD's tokens/s gain shrinks as the batch grows: README, docs/performance.md)"))
    trace_problems: int = Field(default=32, ge=0)

    def overrides(self, path: str) -> list[dict[str, Any]]:
        """The curve of the method decoding with `path`: `curve`, plus `multibd_curve` when it is MultiBD."""
        base = load_decode(resolve_path(path))[0]
        return self.curve + (self.multibd_curve if base.buffer_size > 1 else [])

    def points(self, path: str) -> list[DecodeConfig]:
        """The curve's DecodeConfigs for one decode YAML (fails naming the bad override)."""
        base = load_decode(resolve_path(path))[0]
        return [validate(DecodeConfig, {**base.model_dump(), **o}, f"eval curve point {i} ({o}) on {path}")
                for i, o in enumerate(self.overrides(path))]


class ClaimSeeds(StrictModel):
    """`mbd reproduce`: the training seeds each claim is judged over, fixed before anything trains. The count is part
    of the run's pre-registration (pipelines/preregistration.py): another count is another run, so a verdict is
    never revised by adding seeds until it turns. (b) needs no trained model; (f) pools the traces of (a)'s runs."""

    a: int = Field(default=5, ge=1)
    c: int = Field(default=5, ge=1)
    d: int = Field(default=5, ge=1)
    e: int = Field(default=5, ge=1)


class ServeSection(StrictModel):
    enabled: bool = True
    config: str = "configs/serve/tiny.yaml"
    port: int = Field(default=0, ge=0, le=65535, description="0: pick a free port")
    prompt: str | None = Field(default=None, description="None: the first held-out problem")
    max_tokens: int = Field(default=96, gt=0)


class QuickstartConfig(StrictModel):
    run_dir: str = "runs/quickstart"
    base_model: str = "mbd/assets/tiny"
    num_cpus: int = Field(default=2, ge=1)
    seed: int = Field(default=0, ge=0, description="corpus draw (from the posttrain part), layouts and noise, "
                                                  "training row order")
    corpus: CorpusSection = CorpusSection()
    expand: ExpandSection = ExpandSection()
    train: TrainSection = TrainSection()
    eval: EvalSection = EvalSection()
    claim_seeds: ClaimSeeds = ClaimSeeds()
    serve: ServeSection = ServeSection()

    @model_validator(mode="after")
    def _check(self) -> "QuickstartConfig":
        from mbd.eval.benchmarks import get_benchmark
        from mbd.tiny.task import split_size

        if self.corpus.problems > split_size("posttrain"):
            raise ValueError(f"corpus.problems={self.corpus.problems}: the posttrain part holds "
                             f"{split_size('posttrain')}")
        for field in ("problems", "claim_problems"):
            want = getattr(self.eval, field)
            held = len(get_benchmark(BENCHMARK).load(limit=want))
            if held < want:
                raise ValueError(f"eval.{field}={want}: the {BENCHMARK} benchmark holds {held}")
        for path in (self.eval.singlebd, self.eval.multibd):
            self.eval.points(path)  # a bad decode file or override fails before any stage runs
        return self


def load_config(path: str | Path, sets: Sequence[str] = ()) -> QuickstartConfig:
    """The YAML with `--set key.sub=value` items applied (the CLI's shorthand flags are sets too)."""
    return load_yaml(path, QuickstartConfig, sets=sets)


# ---------------------------------------------------------------- stages

class Stages:
    """Numbered stage banners and a wall-time line per stage. With a `log` (a resumable run's JSON file), each stage's
    time is also added to its total there the moment the stage ends, so a run resumed after a kill reports the time
    every finished piece of work took, not only what its last invocation redid."""

    def __init__(self, names: Sequence[str], log: Path | None = None):
        self.names, self.wall_s, self.log = list(names), {}, log
        self.total_s: dict[str, float] = json.loads(log.read_text()) if log is not None and log.is_file() else {}

    @contextmanager
    def run(self, name: str, what: str) -> Iterator[None]:
        i, n = self.names.index(name) + 1, len(self.names)
        print(f"\n==> [{i}/{n}] {name}: {what}", flush=True)
        t0 = time.perf_counter()
        yield
        self.wall_s[name] = round(time.perf_counter() - t0, 1)
        print(f"==> [{i}/{n}] {name}: done, wall time {self.wall_s[name]:.1f} s", flush=True)
        if self.log is not None:
            self.total_s[name] = round(self.total_s.get(name, 0.0) + self.wall_s[name], 1)
            tmp = self.log.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.total_s, indent=2))
            tmp.replace(self.log)


def write_corpus(path: Path, problems: int, seed: int) -> Path:
    """`problems` records of the tinymath posttrain part drawn with `seed`. The part is disjoint from the pretrain
    part by a hash of the question (mbd.tiny.task), so no seed of this corpus can replay a pretraining record of
    any seed: when both drew from one training split, the same seed gave the base's own first records word for
    word (docs/reproduce.md)."""
    from mbd.tiny.task import generate, write_jsonl

    return write_jsonl(path, generate("posttrain", problems, seed))


def expand_stage(cfg: QuickstartConfig, corpus: Path, out: Path, base: Path, expand: ExpandSection | None = None):
    """Ray Data expansion of `corpus` into `out`/rows with `expand` (default: cfg.expand)."""
    from pipelines.expand_layouts import ExpandConfig, run_expand

    e = expand or cfg.expand
    summary = run_expand(ExpandConfig(
        inputs=[str(corpus)], output_dir=str(out), model_dir=str(base), max_length=e.max_length, mode=e.mode,
        gmax=e.gmax, n_rand=e.n_rand, scheduler=e.scheduler, masking=e.masking, seed=cfg.seed,
        sequences_per_task=e.sequences_per_task))
    print(f"    {summary.sequences_ok} sequences x {summary.layouts_per_sequence} group-layouts = {summary.rows_out} "
          f"rows ({summary.rows_per_s:.0f} rows/s) -> {summary.rows_dir}; quarantined {summary.quarantined}")
    if summary.quarantined:
        raise RuntimeError(f"expand quarantined {summary.quarantined} tinymath records: {summary.quarantine_reasons}")
    return summary


def train_config(cfg: QuickstartConfig, run: Path, base: Path, rows_dir: str, name: str = "train",
                 export_dir: Path | None = None, checkpoint_every: int | None = None):
    """The TrainConfig of a MultiTF post-training run on `rows_dir` (absolute paths: workers run elsewhere); the
    objective is `train.objective`, else the base family's."""
    from mbd.checkpoint_files import read_model_config
    from mbd.multitf.objectives import family_objective
    from mbd.train_config import TrainConfig

    t, e = cfg.train, cfg.expand
    objective = t.objective or family_objective(read_model_config(base).family)
    return TrainConfig.model_validate({
        "run": {"name": name, "storage_path": str(run.resolve()), "keep_checkpoints": 1,
                "export_dir": str((export_dir or run / "mbd-tiny").resolve())},
        "model_path": str(base.resolve()),
        "data": {"parquet": str(Path(rows_dir).resolve()), "max_length": e.max_length, "probe_rows": 16},
        "layouts": {"mode": "multitf", "gmax": e.gmax, "n_rand": e.n_rand, "scheduler": e.scheduler.model_dump(),
                    "masking": e.masking},
        "objective": objective.model_dump(),
        "deepspeed": {"zero_stage": t.zero_stage, "micro_batch_size": t.micro_batch_size, "grad_accum": t.grad_accum,
                      "lr": t.lr, "warmup_steps": t.warmup_steps, "min_lr_ratio": t.min_lr_ratio,
                      "grad_clip": t.grad_clip},
        "steps": t.steps, "checkpoint_every": checkpoint_every or t.steps, "num_workers": t.num_workers,
        "cpus_per_worker": t.cpus_per_worker, "seed": cfg.seed,
    })


def train_stage(cfg: QuickstartConfig, run: Path, base: Path, rows_dir: str, progress: bool, **kw: Any):
    from pipelines.train_multitf import run_train

    summary = run_train(train_config(cfg, run, base, rows_dir, **kw), show_progress=progress)
    probes = [m["probe_loss"] for m in summary.history if "probe_loss" in m]
    print(f"    {summary.last_step} steps, loss {summary.final.get('loss', float('nan')):.4f}, probe loss "
          f"{probes[0]:.4f} -> {probes[-1]:.4f}; MBD model -> {summary.export_dir}")
    return summary


def point_name(key: str, override: dict[str, Any]) -> str:
    return key + "".join(f".{k}={v}" for k, v in override.items())


def overrides_of(cfg: QuickstartConfig, path: str, operating: bool) -> list[dict[str, Any]]:
    """The curve points of a method decoding with `path`, or only its operating point (point 0)."""
    points = cfg.eval.overrides(path)
    return points[:1] if operating else points


def sweep_config(cfg: QuickstartConfig, out: Path, models: Sequence[tuple[str, Path]],
                 methods: Sequence[MethodSpec], problems: int | None = None, operating: bool = False,
                 benchmark: str = BENCHMARK):
    """SweepConfig over `models` (name, path) and `methods` (label, key, decode YAML, model name) on the first
    `problems` (default eval.problems) problems of `benchmark` (held-out; DEV_BENCHMARK for tuning): one AUP curve
    per method, its points being `eval.curve` applied to the method's decode YAML (`operating`: the operating
    point only)."""
    from mbd.eval.sweep import SweepConfig

    decoding = [{"name": point_name(key, o), "config": str(resolve_path(path)), "overrides": o, "curve": label,
                 "models": [model]} for label, key, path, model in methods for o in overrides_of(cfg, path, operating)]
    return SweepConfig.model_validate({
        "name": out.parent.name, "output_dir": str(out),
        "models": [{"name": n, "path": str(p), "section": "tiny"} for n, p in models],
        "decoding": decoding, "benchmarks": [{"name": benchmark, "limit": problems or cfg.eval.problems}],
        "engine": {"device": "cpu", "max_batch_rows": cfg.eval.batch_size}, "trace_problems": cfg.eval.trace_problems,
        "workers": 1, "cpus_per_worker": 1, "cpus_per_scorer": 0.5,
    })


def as_methods(cfg: QuickstartConfig, methods: Sequence[MethodSpec], operating: bool = False) -> list[Method]:
    """(label, key, decode YAML, model) -> report Methods whose configs are the sweep's curve-point names."""
    return [Method(label=label, model=model, configs=[point_name(key, o) for o in overrides_of(cfg, path, operating)])
            for label, key, path, model in methods]


def rows_of(cfg: QuickstartConfig, cells: Sequence[CellMetrics],
            methods: Sequence[MethodSpec]) -> list[MethodRow]:
    return method_rows(cells, as_methods(cfg, methods), BENCHMARK)


def curves_of(cfg: QuickstartConfig, store: Path, methods: Sequence[MethodSpec], problems: int | None = None,
              operating: bool = False, benchmark: str = BENCHMARK) -> dict[str, Curve]:
    """Per-problem records of each method's curve (`operating`: its operating point only) stored under `store`, on
    the first `problems` (default eval.problems) problems of `benchmark`."""
    from mbd.eval.benchmarks import get_benchmark

    ids = [p.problem_id for p in get_benchmark(benchmark).load(limit=problems or cfg.eval.problems)]
    results = ResultStore(store)
    return {m.label: load_curve(results, m, benchmark, ids) for m in as_methods(cfg, methods, operating)}


def tps_stage(cfg: QuickstartConfig, sweep, methods: Sequence[MethodSpec],
              rows: Sequence[MethodRow]) -> list[MethodRow]:
    """`rows` with TPS measured side by side in this process, at each of `eval.tps_batches`: each method's operating
    point decodes the same first `eval.tps_problems` problems in `eval.tps_rounds` interleaved rounds
    (mbd.eval.timing), that many requests decoded together."""
    from mbd.decoding.spec import build_engine, load_engine_model
    from mbd.eval.prompts import chat_messages
    from mbd.eval.sweep import load_splits
    from mbd.eval.timing import TpsStat, engine_decoder, interleaved_tps

    split = load_splits(sweep)[BENCHMARK]
    paths = {m.name: m.path for m in sweep.models}
    loaded = {name: load_engine_model(paths[name], sweep.engine) for name in {m[3] for m in methods}}
    timed: dict[str, dict[int, TpsStat]] = {label: {} for label, *_ in methods}
    for batch in cfg.eval.tps_batches:
        engine_cfg = sweep.engine.model_copy(update={"max_batch_rows": batch, "batch_buckets": None})
        decoders = {}
        for label, _, path, model in methods:
            tok = loaded[model][1]
            prompts = [tok.encode_chat(chat_messages(p, split.exemplars)) for p in split.scored[: cfg.eval.tps_problems]]
            engine = build_engine(paths[model], cfg.eval.points(path)[0], engine_cfg, loaded=loaded[model])
            decoders[label] = engine_decoder(engine, prompts, cfg.eval.points(path)[0])
        stats = interleaved_tps(decoders, cfg.eval.tps_rounds)
        print(f"    TPS side by side at batch {batch}: {len(decoders)} methods x {cfg.eval.tps_rounds} interleaved rounds "
              f"on the first {min(cfg.eval.tps_problems, len(split.scored))} held-out problems; "
              + ", ".join(f"{k} {s.median:.1f} ({s.low:.1f}-{s.high:.1f})" for k, s in stats.items()), flush=True)
        for label, stat in stats.items():
            timed[label][batch] = stat
    return [r.model_copy(update={"tps_timed": timed[r.method]}) for r in rows]


def section_title(cfg: QuickstartConfig) -> str:
    multi = cfg.eval.points(cfg.eval.multibd)[0]
    return f"tiny sdar (bufsz={multi.buffer_size}, blksz={multi.block_size or 'model'})"
