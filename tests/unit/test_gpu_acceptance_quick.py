"""`python -m benchmarks.gpu_acceptance --device cpu --quick --rows all` runs in the default suite, so the GPU
acceptance command cannot rot before a GPU runs it: every row's code path runs here at small sizes, each in a
process of its own that leaves its JSON behind (CUDA Graphs and the flex training backward aside: skipped on CPU).
The short run's order and budget are checked without running it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_acceptance import ROWS, SHORT_RUN, parse

ROOT = Path(__file__).resolve().parents[2]
# The warm-up first: the quick compiled row's shapes are the quick warm-up's, so it reads them from the run's cache
# instead of compiling them again (the order of the GPU run is the test below's).
QUICK_ORDER = ["warmup_first", "warmup_cached", *(n for n in ROWS if not n.startswith("warmup"))]


def test_the_short_run_is_correctness_first_within_its_budget():
    args = parse([])
    assert args.rows.split(",") == SHORT_RUN == ["compiled", "graphs", "hf", "floor_sdar", "floor_llada2",
                                                 "warmup_first", "warmup_cached", "batch_invariance"]
    assert args.budget == 420 and sum(ROWS[n][1] for n in SHORT_RUN) <= args.budget
    rest = [n for n in ROWS if n not in SHORT_RUN]
    assert rest == ["bf16", "train_dense", "train_flex", "serve"] and sum(ROWS[n][1] for n in rest) <= args.budget
    assert parse(["--rows", "all"]).rows.split(",") == list(ROWS)
    with pytest.raises(SystemExit):
        parse(["--rows", "compiled,nope"])


@pytest.mark.timeout(2400)
def test_quick_acceptance_runs_every_row_in_its_own_process(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_acceptance", "--device", "cpu", "--quick",
                           "--out", str(tmp_path), "--budget", "2300", "--rows", ",".join(QUICK_ORDER)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=2350)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]

    rows = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ROWS}
    skipped = {"graphs": "skipped (no CUDA)", "train_flex": "skipped (no CUDA)"}
    measured = {"floor_sdar", "floor_llada2", "warmup_first", "warmup_cached", "batch_invariance"}
    assert {k: r["result"] for k, r in rows.items()} == {
        k: skipped.get(k, "MEASURED" if k in measured else "PASS") for k in ROWS}
    table = (tmp_path / "table.md").read_text()
    assert table.count("\n| ") == len(ROWS) + 1  # header + a line per row
    assert [line.split(" | ")[0][2:] for line in table.splitlines()[4:]] == [rows[n]["check"] for n in QUICK_ORDER]
    for name in ("floor_sdar", "floor_llada2"):
        cells = rows[name]["data"]["cells"]
        assert [(c["batch"], c["n_buf"]) for c in cells] == [(1, 1), (1, 2), (4, 1), (4, 2)]
        assert all(c["x_floor"] > 1 and c["tpf"] > 0 for c in cells)
    moe = rows["floor_llada2"]["data"]
    assert moe["floor_bytes"] < moe["weight_bytes"]  # a step reads only the experts its tokens chose

    # The cold warm-up compiles its graphs; the second, in a new process, reads every one of them back from the
    # cache the first left and compiles none; the compiled row (the same shapes: one compiled set per run) reads
    # them back too instead of compiling them again.
    cold, cached = rows["warmup_first"]["data"], rows["warmup_cached"]["data"]
    assert cold["shapes"] == cached["shapes"] == 4
    looked_up = cold["fx_graphs"]["compiled"] + cold["fx_graphs"]["cache_hits"]
    assert cold["fx_graphs"]["compiled"] > 0 and cold["fx_graphs"]["bypassed"] == 0
    assert cached["fx_graphs"] == {"compiled": 0, "cache_hits": looked_up, "bypassed": 0}
    compiled = rows["compiled"]["data"]["fx_graphs"]
    assert compiled["cache_hits"] >= cold["fx_graphs"]["compiled"] and compiled["bypassed"] == 0

    train = rows["train_dense"]["data"]
    assert train["plan_error"] <= 0.05 and train["last_loss"] < train["first_loss"] and 0 < train["mfu"]
    tiny = rows["bf16"]["data"]["tinymath"]
    assert tiny["problems"] == 48 and 50 <= tiny["acc_fp32"] <= 100  # the embedded model solves most
    served = rows["serve"]["data"]
    assert served["status"] == 200 and served["equal"] and served["tokens"] > 0
