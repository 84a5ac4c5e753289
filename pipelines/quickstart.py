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
           accuracy-vs-TPF and fig:train_infer_noise_activity C-E plots. TPS is timed side by side in the
           driver afterwards (methods interleaved, median of eval.tps_rounds rounds), not taken from the sweep.
4. serve:  Ray Serve starts the MBD model and answers one OpenAI-style chat request on 127.0.0.1.

The run directory is rebuilt on every run (only a directory this command made is reused); the stages
(`pipelines/stages.py`, shared with `mbd reproduce`, and the serve stage here) call the project's own jobs
(`run_expand`, `run_train`, `run_sweep`, `build_app`) and add no algorithm of their own. Joins the cluster in
RAY_ADDRESS or an already connected one, else starts `ray.init(num_cpus=2)`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from pydantic import BaseModel, Field

from mbd.config import ConfigError, resolve_path
from mbd.eval.claims import Curve, accuracy_gain, comparison_line, judge_a
from mbd.eval.report import MethodRow, method_table
from pipelines.ray_session import ray_session
from pipelines.stages import (BENCHMARK, DEFAULT_CONFIG, MULTIBD_TF, SINGLEBD, MethodSpec, QuickstartConfig, Stages,
                              curves_of, expand_stage, load_config, rows_of, section_title, sweep_config, train_stage,
                              tps_stage, write_corpus)

__all__ = ["run_quickstart", "QuickstartSummary", "ServeReply", "MBD", "MBD_AS_SINGLEBD", "main"]

APP_NAME = "mbd-quickstart"
MARKER = ".mbd-quickstart"  # a run directory holding it was made by this command and may be rebuilt
STAGES = ("expand", "train", "eval", "serve")
MBD = "MBD-tiny"
MBD_AS_SINGLEBD = "MBD-tiny decoded SingleBD"  # diagnostic: what post-training did to SingleBD quality


# ---------------------------------------------------------------- results

class ServeReply(BaseModel):
    url: str
    prompt: str
    content: str
    usage: dict[str, Any]  # token counts, plus OpenAI's nested prompt_tokens_details
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
    comparisons: list[str] = Field(description="paired accuracy differences (95% CI, exact McNemar) vs SingleBD, "
                                               "then claim (a)'s verdict with its interval's width")
    table_markdown: str
    report_path: str
    plots: list[str]
    serve: ServeReply | None


# ---------------------------------------------------------------- stages of its own

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


def main_methods(cfg: QuickstartConfig) -> list[MethodSpec]:
    return [(SINGLEBD, "singlebd", cfg.eval.singlebd, "base"), (MULTIBD_TF, "multibd-tf", cfg.eval.multibd, "base"),
            (MBD, "mbd", cfg.eval.multibd, "mbd-tiny"),
            (MBD_AS_SINGLEBD, "mbd-singlebd", cfg.eval.singlebd, "mbd-tiny")]


def eval_stage(cfg: QuickstartConfig, run: Path, base: Path, mbd_dir: Path, progress: bool):
    from pipelines.eval_sweep import run_sweep

    methods = main_methods(cfg)
    sweep = sweep_config(cfg, run / "eval", [("base", base), ("mbd-tiny", mbd_dir)], methods)
    summary = run_sweep(sweep, progress=progress)
    return summary, tps_stage(cfg, sweep, methods, rows_of(cfg, summary.cells, methods))


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


def claim_a_line(single: Curve, mbd: Curve) -> str:
    """Claim (a) on this run's problems, its verdict beside the width of the interval that decided it: at 1,000
    problems about 5 pp, so only a large difference is decided here (`mbd reproduce` judges it on 10,000)."""
    claim, gain = judge_a(single, [mbd]), accuracy_gain(single, [mbd])
    return (f"claim (a) on {single.n} held-out problems: {claim.verdict} (95% CI width {gain.high - gain.low:.2f} pp; "
            f"`mbd reproduce` judges it on 10,000 problems, over seeds with --seeds)")


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
    curves = curves_of(cfg, run / "eval", main_methods(cfg))
    comparisons = [comparison_line(curves[SINGLEBD], curves[m]) for m in (MBD, MBD_AS_SINGLEBD)]
    comparisons.append(claim_a_line(curves[SINGLEBD], curves[MBD]))
    summary = QuickstartSummary(
        run_dir=str(run), stage_wall_s=stages.wall_s, total_wall_s=round(time.perf_counter() - t0, 1),
        rows_out=expanded.rows_out, layouts_per_sequence=expanded.layouts_per_sequence, train_final=trained.final,
        model_dir=str(mbd_dir), rows=rows, comparisons=comparisons, table_markdown=table,
        report_path=swept.report_path, plots=swept.plots, serve=reply)
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
