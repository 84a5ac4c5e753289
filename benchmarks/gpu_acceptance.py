"""GPU acceptance in one command: every GPU path of the product against its reference or its floor, each row in
a process of its own under its own time limit, the rows in order of value, within a total budget.

    python -m benchmarks.gpu_acceptance --budget 420 --out runs/acceptance   # the short run: fits a 15-minute lease
    python -m benchmarks.gpu_acceptance --rows bf16,train_dense,train_flex,serve,floor_sdar_autotune   # a second lease
    python -m benchmarks.gpu_acceptance --device cpu --quick --rows all      # the same code on CPU (the test suite)
    python -m benchmarks.gpu_acceptance --rows floor_sdar,compiled            # a subset, in the order given

The short run (the default rows) is correctness first: compiled == eager and graph replay == no graphs (fp32 and
bf16), our fp32 tokens == the plain transformers loop; then the SDAR-8B and LLaDA2-Mini floors, the warm-up cold
and from its cache, batch invariance. Its row limits add up to at most the default budget.

Each row writes its JSON (`<out>/<row>.json`) the moment it finishes, so a row that times out or crashes loses only
itself; `<out>/table.md` and the exit status (1 if a row FAILs) come at the end. Rows: compiled forward == eager,
CUDA Graph replay == no graphs, the plain transformers loop, step vs floor (SDAR-8B and LLaDA2-Mini shapes: ms per
step, TPF, TPS, kernels per step and per layer, the weight-streaming and matrix floors from measured device rates),
warm-up (first, then from the cache the first left: graphs compiled and read back), batch invariance; then bf16
drift, ZeRO-2 training steps (dense and flex dual-stream masks: tokens/s, MFU, flex == dense), one served request,
SDAR-8B's batch-1 step compiled with max-autotune.
Every compiled engine of a run shares the run's compile cache. Only the served-request row imports Ray.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import acceptance_rows as rows_  # noqa: E402
from benchmarks import acceptance_train as train_  # noqa: E402
from benchmarks.acceptance_rows import QUICK, Row, Sizes  # noqa: E402

# name: (row function, seconds it may take on a GPU), in order of value. The H200 run of 2026-11-27 (larger sizes,
# the rows in another order) took floor_sdar 56 s cold, floor_llada2 140 s, hf 64 s, batch_invariance 37 s; compiled,
# graphs, warm-up and bf16 ran past 90, 60, 92 and 60 s. The limits share the short run's budget: graphs reads the
# compiled row's graphs from the run's compile cache; the warm-up builds the SDAR-8B serve config's 48 graphs, whose
# 24 layer shapes compile into 3-5 graphs since the layers compile with automatic dynamic shapes (static: 24 compiles,
# 17 s + 2-4 s each on that H200, past the row's limit).
ROWS = {
    "compiled": (rows_.compiled_row, 90),
    "graphs": (rows_.graphs_row, 60),
    "hf": (rows_.hf_row, 45),
    "floor_sdar": (rows_.floor_row(0), 45),
    "floor_llada2": (rows_.floor_row(1), 60),
    "warmup_first": (rows_.warmup_row(cold=True), 60),
    "warmup_cached": (rows_.warmup_row(cold=False), 25),
    "batch_invariance": (rows_.batch_invariance_row, 30),
    # not in the short run: a second lease runs them (`--rows bf16,train_dense,train_flex,serve,floor_sdar_autotune`);
    # the last one compiles SDAR-8B's batch-1 step with max-autotune (GEMMs tuned for 32-64 rows, no split-K)
    "bf16": (rows_.bf16_row, 120),
    "train_dense": (train_.train_row("dense"), 60),
    "train_flex": (train_.train_row("flex"), 60),
    "serve": (train_.serve_row, 60),
    "floor_sdar_autotune": (rows_.floor_row(0, "max-autotune"), 120),
}
SHORT_RUN = list(ROWS)[:8]
BUDGET = 420  # seconds: a 15-minute lease less the machine's start and the copy back
QUICK_LIMIT = 600  # seconds per row on CPU at the quick sizes (a loaded 2-core machine)


def run_child(name: str, device: str, quick: bool, out: Path) -> None:
    """In the row's own process: run it and write its JSON."""
    if device == "cpu":
        torch.set_num_threads(int(os.environ.get("MBD_ACCEPTANCE_THREADS", "1")))
    fn, _ = ROWS[name]
    t0 = time.perf_counter()
    try:
        row = fn(QUICK if quick else Sizes(), device, out)
    except Exception as e:  # a crashing row is a failed row; the others still run
        row = Row(name, "FAIL", f"{type(e).__name__}: {e}", data={"traceback": traceback.format_exc()})
    row.seconds = time.perf_counter() - t0
    (out / f"{name}.json").write_text(json.dumps(asdict(row), indent=1, default=str))


def run_rows(names: list[str], device: str, quick: bool, budget: float, out: Path) -> list[Row]:
    """Every row in its own process, each killed at min(its limit, the budget left)."""
    done, start = [], time.perf_counter()
    for name in names:
        left = budget - (time.perf_counter() - start)
        limit = min(QUICK_LIMIT if quick else ROWS[name][1], left)
        if limit < 10:
            done.append(Row(name, "NOT RUN", f"budget spent ({budget:.0f} s)"))
            continue
        cmd = [sys.executable, "-m", "benchmarks.gpu_acceptance", "--row", name, "--device", device, "--out",
               str(out)] + ["--quick"] * quick
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the row's process group: only what this command started
            proc.wait()
        path = out / f"{name}.json"
        row = Row(**json.loads(path.read_text())) if path.is_file() else Row(
            name, "TIMEOUT" if proc.returncode == -signal.SIGKILL else "FAIL",
            f"no result within {limit:.0f} s" if proc.returncode == -signal.SIGKILL else f"exit {proc.returncode}",
            time.perf_counter() - t0)
        print(f"  {name}: {row.result} ({row.seconds:.0f} s)", file=sys.stderr, flush=True)
        done.append(row)
    return done + flex_vs_dense(done)


def flex_vs_dense(done: list[Row]) -> list[Row]:
    """The training rows' losses: the flex mask's 5 steps against the dense mask's first 5 (bf16)."""
    by = {r.check: r for r in done}
    dense, flex = by.get("ZeRO-2 steps, dense dual-stream mask"), by.get("ZeRO-2 steps, flex dual-stream mask")
    if not (dense and flex and dense.data.get("losses") and flex.data.get("losses")):
        return []
    worst = max(abs(a - b) / abs(a) for a, b in zip(dense.data["losses"], flex.data["losses"]))
    return [Row("MultiTF training: flex == dense", "PASS" if worst <= 0.02 else "FAIL",
                f"largest relative loss difference over 5 steps {worst:.4f} (<= 0.02)")]


def table(rows: list[Row], card: str, quick: bool) -> str:
    lines = [f"GPU acceptance on {card}{' (quick sizes)' if quick else ''}, torch {torch.__version__}", "",
             "| check | result | detail | s |", "|---|---|---|---:|"]
    lines += [f"| {r.check} | {r.result} | {r.detail} | {r.seconds:.0f} |" for r in rows]
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small sizes (the CPU test suite runs this)")
    ap.add_argument("--rows", default=",".join(SHORT_RUN),
                    help=f"comma-separated rows in the order to run, or all; of {','.join(ROWS)}")
    ap.add_argument("--budget", type=float, default=BUDGET, help="seconds for all rows together")
    ap.add_argument("--out", default="runs/acceptance", help="directory for each row's JSON and the table")
    ap.add_argument("--row", help=argparse.SUPPRESS)  # internal: run this one row in this process
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu --quick)")
    if args.rows == "all":
        args.rows = ",".join(ROWS)
    unknown = set(args.rows.split(",")) - set(ROWS) - {""}
    if unknown:
        ap.error(f"unknown rows {sorted(unknown)}: choose from {', '.join(ROWS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.row:
        run_child(args.row, args.device, args.quick, out)
        return 0
    for name in ROWS:  # a fresh run: no row of an earlier one is taken for this one's
        (out / f"{name}.json").unlink(missing_ok=True)
    shutil.rmtree(rows_.compile_cache(out), ignore_errors=True)  # nothing compiled by an earlier run is read
    card = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    rows = run_rows([n for n in args.rows.split(",") if n], args.device, args.quick, args.budget, out)
    text = table(rows, card, args.quick)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 1 if any(r.result in ("FAIL", "TIMEOUT") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
