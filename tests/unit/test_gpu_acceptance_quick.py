"""`python -m benchmarks.gpu_acceptance --device cpu --quick` runs in the default suite, so the GPU acceptance
command cannot rot before a GPU runs it: every row's code path runs here at small sizes, each in a process of its
own that leaves its JSON behind (CUDA Graphs and the flex training backward aside: skipped on CPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(2400)
def test_quick_acceptance_runs_every_row_in_its_own_process(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_acceptance", "--device", "cpu", "--quick",
                           "--out", str(tmp_path), "--budget", "2300"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=2350)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    from benchmarks.gpu_acceptance import ROWS

    rows = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ROWS}
    skipped = {"graphs": "skipped (no CUDA)", "train_flex": "skipped (no CUDA)"}
    measured = {"floor_sdar", "floor_llada2", "warmup_first", "warmup_cached", "batch_invariance"}
    assert {k: r["result"] for k, r in rows.items()} == {
        k: skipped.get(k, "MEASURED" if k in measured else "PASS") for k in ROWS}
    assert (tmp_path / "table.md").read_text().count("\n| ") == len(ROWS) + 1  # header + a line per row
    for name in ("floor_sdar", "floor_llada2"):
        cells = rows[name]["data"]["cells"]
        assert [(c["batch"], c["n_buf"]) for c in cells] == [(1, 1), (1, 2), (4, 1), (4, 2)]
        assert all(c["x_floor"] > 1 and c["tpf"] > 0 for c in cells)
    moe = rows["floor_llada2"]["data"]
    assert moe["floor_bytes"] < moe["weight_bytes"]  # a step reads only the experts its tokens chose
    assert rows["warmup_first"]["data"]["shapes"] == rows["warmup_cached"]["data"]["shapes"] == 4
    from benchmarks.acceptance_rows import compile_cache

    assert any(compile_cache(tmp_path).iterdir())  # the first warm-up left its kernels for the second
    train = rows["train_dense"]["data"]
    assert train["plan_error"] <= 0.05 and train["last_loss"] < train["first_loss"] and 0 < train["mfu"]
    tiny = rows["bf16"]["data"]["tinymath"]
    assert tiny["problems"] == 48 and 50 <= tiny["acc_fp32"] <= 100  # the embedded model solves most
    served = rows["serve"]["data"]
    assert served["status"] == 200 and served["equal"] and served["tokens"] > 0
