"""`mbd quickstart`: the whole product on the embedded tiny model, on a local Ray cluster, in one command.

    mbd quickstart                                    # configs/quickstart.yaml -> runs/quickstart/
    mbd quickstart --steps 20 --problems 16 --no-serve --run-dir /tmp/qs
    mbd quickstart --keep-serving                     # stage 4 keeps the HTTP server up until Ctrl-C

Four stages, each with its own progress display and a wall-time line:
1. expand: the tinymath TRAIN split (generated from the seed) -> Ray Data -> MultiTF group-layouts (Parquet).
2. train:  Ray Train, 2 CPU workers, DeepSpeed ZeRO: MultiTF CE post-trains the shipped SingleBD base
           (mbd/assets/tiny) on those rows -> the tiny MBD model, exported as an HF directory.
3. eval:   a sweep on the HELD-OUT split: SingleBD (native, base), MultiBD training-free (base) and MBD
           (MultiBD on the post-trained model); Acc / TPF / TPS / AUP in tab:main_results' layout, plus the
           accuracy-vs-TPF and fig:train_infer_noise_activity C-E plots.
4. serve:  Ray Serve starts the MBD model and answers one OpenAI-style chat request on 127.0.0.1.

The run directory is rebuilt on every run (only a directory this command made is reused); the stages call
the project's own jobs (`run_expand`, `run_train`, `run_sweep`, `build_app`) and add no algorithm of their
own. Joins the cluster in RAY_ADDRESS or an already connected one, else starts `ray.init(num_cpus=2)`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from pydantic import BaseModel, Field, model_validator

from mbd.config import REPO_ROOT, ConfigError, DecodeConfig, StrictModel, load_decode, load_yaml, resolve_path, validate
from mbd.eval.report import CellMetrics, Curve, Method, MethodRow, comparison_line, load_curve, method_rows, \
    method_table
from mbd.eval.sweep import ResultStore
from mbd.multitf.schedulers import SchedulerConfig
from pipelines.ray_session import ray_session

DEFAULT_CONFIG = REPO_ROOT / "configs" / "quickstart.yaml"
APP_NAME = "mbd-quickstart"
MARKER = ".mbd-quickstart"  # a run directory holding it was made by this command and may be rebuilt
BENCHMARK = "tinymath"
STAGES = ("expand", "train", "eval", "serve")
SINGLEBD, MULTIBD_TF, MBD = "SingleBD (Native)", "MultiBD (training-free)", "MBD-tiny"
MBD_AS_SINGLEBD = "MBD-tiny decoded SingleBD"  # diagnostic: what post-training did to SingleBD quality


# ---------------------------------------------------------------- configuration

class CorpusSection(StrictModel):
    problems: int = Field(default=2000, gt=0, description="tinymath train-split problems expanded and trained on")


class ExpandSection(StrictModel):
    gmax: int = Field(default=4, ge=2)
    n_rand: int = Field(default=2, ge=0)
    scheduler: SchedulerConfig = SchedulerConfig()
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


class EvalSection(StrictModel):
    problems: int = Field(default=1000, gt=0, description="first N problems of the held-out split")
    singlebd: str = "configs/decode/tiny_singlebd.yaml"
    multibd: str = "configs/decode/tiny_multibd.yaml"
    curve: list[dict[str, Any]] = Field(default=[{}, {"tau_m2t": 0.7}, {"tau_m2t": 0.5}], min_length=1,
                                        description="decode overrides of every method; point 0 is the operating "
                                                    "point")
    multibd_curve: list[dict[str, Any]] = Field(
        default=[{"tau_add": 0.25}, {"buffer_size": 2}],
        description="further points of MultiBD methods only (buffer_size / tau_add do nothing under SingleBD)")
    batch_size: int = Field(default=16, ge=1)
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
    seed: int = Field(default=0, ge=0)
    corpus: CorpusSection = CorpusSection()
    expand: ExpandSection = ExpandSection()
    train: TrainSection = TrainSection()
    eval: EvalSection = EvalSection()
    serve: ServeSection = ServeSection()

    @model_validator(mode="after")
    def _check(self) -> "QuickstartConfig":
        from mbd.eval.benchmarks import get_benchmark
        from mbd.tiny.task import split_size

        if self.corpus.problems > split_size("train"):
            raise ValueError(f"corpus.problems={self.corpus.problems}: the train split holds {split_size('train')}")
        held = len(get_benchmark(BENCHMARK).load(limit=self.eval.problems))
        if held < self.eval.problems:
            raise ValueError(f"eval.problems={self.eval.problems}: the {BENCHMARK} benchmark holds {held}")
        for path in (self.eval.singlebd, self.eval.multibd):
            self.eval.points(path)  # a bad decode file or override fails before any stage runs
        return self


def load_config(path: str | Path, sets: Sequence[str] = ()) -> QuickstartConfig:
    """The YAML with `--set key.sub=value` items applied (the CLI's shorthand flags are sets too)."""
    return load_yaml(path, QuickstartConfig, sets=sets)


# ---------------------------------------------------------------- results

class ServeReply(BaseModel):
    url: str
    prompt: str
    content: str
    usage: dict[str, int]
    mbd: dict[str, Any]


class QuickstartSummary(BaseModel):
    run_dir: str
    stage_wall_s: dict[str, float]
    total_wall_s: float
    rows_out: int
    layouts_per_sequence: int
    train_final: dict[str, float]
    model_dir: str
    rows: list[MethodRow]
    comparisons: list[str] = Field(description="paired accuracy differences (95% CI, exact McNemar) vs SingleBD")
    table_markdown: str
    report_path: str
    plots: list[str]
    serve: ServeReply | None


# ---------------------------------------------------------------- stages

class Stages:
    """Numbered stage banners and a wall-time line per stage."""

    def __init__(self, names: Sequence[str]):
        self.names, self.wall_s = list(names), {}

    @contextmanager
    def run(self, name: str, what: str) -> Iterator[None]:
        i, n = self.names.index(name) + 1, len(self.names)
        print(f"\n==> [{i}/{n}] {name}: {what}", flush=True)
        t0 = time.perf_counter()
        yield
        self.wall_s[name] = round(time.perf_counter() - t0, 1)
        print(f"==> [{i}/{n}] {name}: done, wall time {self.wall_s[name]:.1f} s", flush=True)


def prepare_run_dir(path: Path, fresh: bool = True) -> Path:
    """Create the run directory; a non-empty directory not made by this command is refused (never wiped)."""
    if path.exists() and any(path.iterdir()) and not (path / MARKER).exists():
        raise ConfigError(f"run_dir: {path} is not empty and was not made by `mbd quickstart`; "
                          f"pass another --run-dir or empty it")
    if fresh and path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).touch()
    return path


def write_corpus(path: Path, problems: int, seed: int) -> Path:
    from mbd.tiny.task import generate, write_jsonl

    return write_jsonl(path, generate("train", problems, seed))


def expand_stage(cfg: QuickstartConfig, corpus: Path, out: Path, base: Path, expand: ExpandSection | None = None):
    """Ray Data expansion of `corpus` into `out`/rows with `expand` (default: cfg.expand)."""
    from pipelines.expand_layouts import ExpandConfig, run_expand

    e = expand or cfg.expand
    summary = run_expand(ExpandConfig(
        inputs=[str(corpus)], output_dir=str(out), model_dir=str(base), max_length=e.max_length, gmax=e.gmax,
        n_rand=e.n_rand, scheduler=e.scheduler, seed=cfg.seed, sequences_per_task=e.sequences_per_task))
    print(f"    {summary.sequences_ok} sequences x {summary.layouts_per_sequence} group-layouts = {summary.rows_out} "
          f"rows ({summary.rows_per_s:.0f} rows/s) -> {summary.rows_dir}; quarantined {summary.quarantined}")
    if summary.quarantined:
        raise RuntimeError(f"expand quarantined {summary.quarantined} tinymath records: {summary.quarantine_reasons}")
    return summary


def train_config(cfg: QuickstartConfig, run: Path, base: Path, rows_dir: str, name: str = "train",
                 export_dir: Path | None = None, checkpoint_every: int | None = None):
    """The TrainConfig of a MultiTF post-training run on `rows_dir` (absolute paths: workers run elsewhere)."""
    from mbd.train_config import TrainConfig

    t, e = cfg.train, cfg.expand
    return TrainConfig.model_validate({
        "run": {"name": name, "storage_path": str(run.resolve()), "keep_checkpoints": 1,
                "export_dir": str((export_dir or run / "mbd-tiny").resolve())},
        "model_path": str(base.resolve()),
        "data": {"parquet": str(Path(rows_dir).resolve()), "max_length": e.max_length, "probe_rows": 16},
        "layouts": {"mode": "multitf", "gmax": e.gmax, "n_rand": e.n_rand, "scheduler": e.scheduler.model_dump()},
        "objective": {"name": "multitf_ce"},
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


def sweep_config(cfg: QuickstartConfig, out: Path, models: Sequence[tuple[str, Path]],
                 methods: Sequence[tuple[str, str, str, str]]):
    """SweepConfig over `models` (name, path) and `methods` (label, key, decode YAML, model name): one AUP curve
    per method, its points being `eval.curve` applied to the method's decode YAML."""
    from mbd.eval.sweep import SweepConfig

    decoding = [{"name": point_name(key, o), "config": str(resolve_path(path)), "overrides": o, "curve": label,
                 "models": [model]} for label, key, path, model in methods for o in cfg.eval.overrides(path)]
    return SweepConfig.model_validate({
        "name": out.parent.name, "output_dir": str(out),
        "models": [{"name": n, "path": str(p), "section": "tiny"} for n, p in models],
        "decoding": decoding, "benchmarks": [{"name": BENCHMARK, "limit": cfg.eval.problems}],
        "engine": {"device": "cpu", "max_batch_rows": cfg.eval.batch_size}, "trace_problems": cfg.eval.trace_problems,
        "workers": 1, "cpus_per_worker": 1, "cpus_per_scorer": 0.5,
    })


def main_methods(cfg: QuickstartConfig) -> list[tuple[str, str, str, str]]:
    return [(SINGLEBD, "singlebd", cfg.eval.singlebd, "base"), (MULTIBD_TF, "multibd-tf", cfg.eval.multibd, "base"),
            (MBD, "mbd", cfg.eval.multibd, "mbd-tiny"), (MBD_AS_SINGLEBD, "mbd-singlebd", cfg.eval.singlebd, "mbd-tiny")]


def as_methods(cfg: QuickstartConfig, methods: Sequence[tuple[str, str, str, str]]) -> list[Method]:
    """(label, key, decode YAML, model) -> report Methods whose configs are the sweep's curve-point names."""
    return [Method(label=label, model=model, configs=[point_name(key, o) for o in cfg.eval.overrides(path)])
            for label, key, path, model in methods]


def rows_of(cfg: QuickstartConfig, cells: Sequence[CellMetrics],
            methods: Sequence[tuple[str, str, str, str]]) -> list[MethodRow]:
    return method_rows(cells, as_methods(cfg, methods), BENCHMARK)


def curves_of(cfg: QuickstartConfig, run: Path, methods: Sequence[tuple[str, str, str, str]]) -> dict[str, Curve]:
    """Per-problem records of each method's curve, on the evaluated held-out problems."""
    from mbd.eval.benchmarks import get_benchmark

    ids = [p.problem_id for p in get_benchmark(BENCHMARK).load(limit=cfg.eval.problems)]
    store = ResultStore(run / "eval")
    return {m.label: load_curve(store, m, BENCHMARK, ids) for m in as_methods(cfg, methods)}


def section_title(cfg: QuickstartConfig) -> str:
    multi = cfg.eval.points(cfg.eval.multibd)[0]
    return f"tiny sdar (bufsz={multi.buffer_size}, blksz={multi.block_size or 'model'})"


def eval_stage(cfg: QuickstartConfig, run: Path, base: Path, mbd_dir: Path, progress: bool):
    from pipelines.eval_sweep import run_sweep

    methods = main_methods(cfg)
    summary = run_sweep(sweep_config(cfg, run / "eval", [("base", base), ("mbd-tiny", mbd_dir)], methods),
                        progress=progress)
    return summary, rows_of(cfg, summary.cells, methods)


def serve_stage(cfg: QuickstartConfig, model_dir: Path, keep_serving: bool, own_cluster: bool) -> ServeReply:
    """Deploy the OpenAI-compatible app on loopback, send one chat request, print it, take the app down.

    On a cluster we started, the app is deleted and `ray.shutdown()` ends Serve's actors: `serve.shutdown()`
    would have the controller kill itself inside its own retried `graceful_shutdown` task, which Ray reports as a
    failed task on the console. On a cluster we joined, Serve is shut down as we found it."""
    from ray import serve

    from mbd.tiny.task import generate
    from actors.tp_worker import free_port
    from serve_app.app import build_app
    from serve_app.config import load_serve_config

    scfg = load_serve_config(resolve_path(cfg.serve.config))
    port = cfg.serve.port or free_port()
    scfg = scfg.model_copy(update={"model": scfg.model.model_copy(update={"path": str(model_dir.resolve())}),
                                   "http": scfg.http.model_copy(update={"host": "127.0.0.1", "port": port})})
    prompt = cfg.serve.prompt or generate("heldout", 1, cfg.seed)[0]["question"]
    url = f"http://127.0.0.1:{port}{scfg.http.route_prefix.rstrip('/')}/v1"
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app({"serve_config": scfg}), name=APP_NAME, route_prefix=scfg.http.route_prefix)
        body = {"model": scfg.model.name, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": cfg.serve.max_tokens, "temperature": 0}
        print(f"    POST {url}/chat/completions {json.dumps(body)}", flush=True)
        headers = {"Content-Type": "application/json"}
        if scfg.http.api_key:
            headers["Authorization"] = f"Bearer {scfg.http.api_key}"
        req = urllib.request.Request(f"{url}/chat/completions", data=json.dumps(body).encode(), headers=headers)
        with urllib.request.urlopen(req, timeout=300) as resp:
            data = json.loads(resp.read())
        reply = ServeReply(url=url, prompt=prompt, content=data["choices"][0]["message"]["content"],
                           usage=data["usage"], mbd={k: v for k, v in data["mbd"].items() if k != "token_ids"})
        print(f"    reply: {reply.content!r}\n    usage: {reply.usage}; decoding: {reply.mbd}", flush=True)
        if keep_serving:
            print(f"    serving '{scfg.model.name}' at {url} (OpenAI API); Ctrl-C to stop", flush=True)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                print("    stopping", flush=True)
        return reply
    finally:
        serve.delete(APP_NAME)
        if not own_cluster:
            serve.shutdown()


def run_quickstart(cfg: QuickstartConfig, keep_serving: bool = False, progress: bool = True) -> QuickstartSummary:
    """All four stages; writes <run_dir>/quickstart.json and quickstart.md and returns the summary."""
    t0 = time.perf_counter()
    base = resolve_path(cfg.base_model)
    if not (base / "config.json").is_file():
        raise ConfigError(f"base_model: {cfg.base_model} has no config.json (train it with `mbd pretrain-tiny`)")
    run = prepare_run_dir(Path(cfg.run_dir))
    stages = Stages(STAGES if cfg.serve.enabled else STAGES[:3])
    reply = None
    with ray_session(run, cfg.num_cpus) as own_cluster:
        import ray

        ray.data.DataContext.get_current().enable_progress_bars = False  # one line per stage: expand prints its summary
        with stages.run("expand", f"Ray Data: {cfg.corpus.problems} train-split problems -> MultiTF group-layouts"):
            corpus = write_corpus(run / "corpus" / "train.jsonl", cfg.corpus.problems, cfg.seed)
            expanded = expand_stage(cfg, corpus, run / "layouts", base)
        with stages.run("train", f"Ray Train + DeepSpeed ZeRO-{cfg.train.zero_stage}, {cfg.train.num_workers} "
                                 f"workers, {cfg.train.steps} MultiTF steps on the shipped base"):
            trained = train_stage(cfg, run, base, expanded.rows_dir, progress)
        mbd_dir = Path(trained.export_dir)
        with stages.run("eval", f"{cfg.eval.problems} held-out problems: SingleBD / MultiBD training-free / MBD, "
                                f"{len(cfg.eval.curve)}+{len(cfg.eval.multibd_curve)} points per AUP curve"):
            swept, rows = eval_stage(cfg, run, base, mbd_dir, progress)
        if cfg.serve.enabled:
            with stages.run("serve", "Ray Serve: the MBD model answers one OpenAI-style request"):
                reply = serve_stage(cfg, mbd_dir, keep_serving, own_cluster)
    table = method_table(rows, section_title(cfg), BENCHMARK)
    curves = curves_of(cfg, run, main_methods(cfg))
    comparisons = [comparison_line(curves[SINGLEBD], curves[m]) for m in (MBD, MBD_AS_SINGLEBD)]
    summary = QuickstartSummary(
        run_dir=str(run), stage_wall_s=stages.wall_s, total_wall_s=round(time.perf_counter() - t0, 1),
        rows_out=expanded.rows_out, layouts_per_sequence=expanded.layouts_per_sequence, train_final=trained.final,
        model_dir=str(mbd_dir), rows=rows, comparisons=comparisons, table_markdown=table, report_path=swept.report_path, plots=swept.plots,
        serve=reply)
    (run / "quickstart.json").write_text(summary.model_dump_json(indent=2))
    lines = "".join(f"- {c}\n" for c in comparisons)
    (run / "quickstart.md").write_text(f"# mbd quickstart\n\n{table}\n\n{lines}\nWall time per stage (s): "
                                       f"{json.dumps(stages.wall_s)}; total {summary.total_wall_s} s.\n")
    return summary


def print_summary(s: QuickstartSummary) -> None:
    print(f"\n{s.table_markdown}\n")
    for c in s.comparisons:
        print(c)
    print()
    print("wall time per stage: " + ", ".join(f"{k} {v:.1f} s" for k, v in s.stage_wall_s.items())
          + f"; total {s.total_wall_s:.1f} s")
    print(f"artefacts in {s.run_dir}/:\n  MBD model (HF):   {s.model_dir}\n  eval report:      {s.report_path}")
    for p in s.plots:
        print(f"  plot:             {p}")
    print(f"  summary:          {s.run_dir}/quickstart.json, {s.run_dir}/quickstart.md")


# ---------------------------------------------------------------- CLI

def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mbd quickstart", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="QuickstartConfig YAML")
    ap.add_argument("--run-dir", help="override run_dir (default runs/quickstart)")
    ap.add_argument("--steps", type=int, help="override train.steps")
    ap.add_argument("--problems", type=int, help="override eval.problems (held-out problems per method)")
    ap.add_argument("--corpus", type=int, help="override corpus.problems (train-split problems expanded)")
    ap.add_argument("--base-model", help="override base_model (an HF-format BD-LM directory)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field, e.g. --set train.lr=3e-4 --set eval.batch_size=32")
    ap.add_argument("--no-serve", action="store_true", help="skip stage 4 (Ray Serve)")
    ap.add_argument("--keep-serving", action="store_true", help="keep the HTTP server up after the request")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars (log-friendly)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    sets = [f"{k}={v}" for k, v in {"run_dir": args.run_dir, "train.steps": args.steps, "eval.problems": args.problems,
                                    "corpus.problems": args.corpus, "base_model": args.base_model}.items()
            if v is not None] + (["serve.enabled=false"] if args.no_serve else []) + args.sets
    try:
        cfg = load_config(args.config, sets)
        if args.keep_serving and not cfg.serve.enabled:
            raise ConfigError("--keep-serving needs the serve stage (drop --no-serve / set serve.enabled: true)")
        summary = run_quickstart(cfg, keep_serving=args.keep_serving, progress=not args.no_progress)
    except ConfigError as e:
        print(f"mbd quickstart: {e}", file=sys.stderr)
        return 2
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
