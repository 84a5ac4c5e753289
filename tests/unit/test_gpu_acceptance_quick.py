"""`python -m benchmarks.gpu_acceptance --device cpu --quick` runs in the default suite on the rows that compile
nothing, so the acceptance command (a process per row, its JSON the moment it ends, the table, the exit status)
cannot rot before a GPU runs it. What the compiling rows check is checked fast elsewhere: compiled == eager by
tests/unit/test_compiled_forward.py, the warm-up's cache by the warm-up tests, ZeRO-2 steps and a served request by
the integration tests; the whole quick run, every row, is the `slow` test below."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_acceptance import BUDGET, ROWS, SHORT_RUN, parse

ROOT = Path(__file__).resolve().parents[2]
CORRECTNESS = {"compiled", "graphs", "hf"}  # the rows that compare the GPU path with a reference
# nothing compiled: seconds each on CPU (the autotuned floor skips there)
CHEAP = ["hf", "floor_sdar", "floor_llada2", "batch_invariance", "bf16", "floor_sdar_autotune"]


def quick_run(tmp_path: Path, rows: list[str]) -> tuple[dict, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_acceptance", "--device", "cpu", "--quick",
                           "--out", str(tmp_path), "--budget", "2300", "--rows", ",".join(rows)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=2350)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    table = (tmp_path / "table.md").read_text()
    assert table.count("\n| ") == len(rows) + 1  # header + a line per row, in the order run
    done = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in rows}
    assert [line.split(" | ")[0][2:] for line in table.splitlines()[4:]] == [done[n]["check"] for n in rows]
    return done, table


def test_the_short_run_is_correctness_first_within_its_budget():
    args = parse([])
    assert args.rows.split(",") == SHORT_RUN and args.budget == BUDGET
    first = SHORT_RUN[:len(CORRECTNESS)]
    assert set(first) == CORRECTNESS, f"the short run starts with the correctness rows, not {first}"
    assert sum(ROWS[n][1] for n in SHORT_RUN) <= BUDGET
    rest = [n for n in ROWS if n not in SHORT_RUN]
    assert rest and sum(ROWS[n][1] for n in rest) <= BUDGET  # the other rows fit a second lease
    assert parse(["--rows", "all"]).rows.split(",") == list(ROWS)
    with pytest.raises(SystemExit):
        parse(["--rows", "compiled,nope"])


def test_quick_acceptance_runs_the_rows_that_compile_nothing(tmp_path):
    rows, _ = quick_run(tmp_path, CHEAP)
    assert {k: r["result"] for k, r in rows.items()} == {
        "hf": "PASS", "bf16": "PASS", "floor_sdar": "MEASURED", "floor_llada2": "MEASURED",
        "batch_invariance": "MEASURED", "floor_sdar_autotune": "skipped (no CUDA)"}
    assert rows["hf"]["data"]["first_divergence"] == [None]  # fp32 tokens equal the transformers loop's
    for name in ("floor_sdar", "floor_llada2"):
        cells = rows[name]["data"]["cells"]
        assert [(c["batch"], c["n_buf"]) for c in cells] == [(1, 1), (1, 2), (4, 1), (4, 2)]
        assert all(c["x_floor"] > 1 and c["tpf"] > 0 for c in cells)
    moe = rows["floor_llada2"]["data"]
    assert moe["floor_bytes"] < moe["weight_bytes"]  # a step reads only the experts its tokens chose
    inv = rows["batch_invariance"]["data"]
    assert 0 <= inv["requests"] <= 16 and 0 < inv["total"] and 0 <= inv["tokens"] <= inv["total"]
    tiny = rows["bf16"]["data"]["tinymath"]
    assert tiny["problems"] == 48 and 50 <= tiny["acc_fp32"] <= 100  # the embedded model solves most


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_quick_acceptance_runs_every_row_in_its_own_process(tmp_path):
    # the warm-up first: the compiled row's shapes are the quick warm-up's, read back from the run's cache
    order = ["warmup_first", "warmup_cached", *(n for n in ROWS if not n.startswith("warmup"))]
    rows, _ = quick_run(tmp_path, order)
    skipped = {k: "skipped (no CUDA)" for k in ("graphs", "train_flex", "floor_sdar_autotune")}
    measured = {"floor_sdar", "floor_llada2", "warmup_first", "warmup_cached", "batch_invariance"}
    assert {k: r["result"] for k, r in rows.items()} == {
        k: skipped.get(k, "MEASURED" if k in measured else "PASS") for k in ROWS}
    # The cold warm-up compiles its graphs; the second, in a new process, reads every one of them back from the
    # cache the first left and compiles none; the compiled row reads them back too.
    cold, cached = rows["warmup_first"]["data"], rows["warmup_cached"]["data"]
    assert cold["shapes"] == cached["shapes"] == 4
    looked_up = cold["fx_graphs"]["compiled"] + cold["fx_graphs"]["cache_hits"]
    assert cold["fx_graphs"]["compiled"] > 0 and cold["fx_graphs"]["bypassed"] == 0
    assert cached["fx_graphs"] == {"compiled": 0, "cache_hits": looked_up, "bypassed": 0}
    compiled = rows["compiled"]["data"]["fx_graphs"]
    assert compiled["cache_hits"] >= cold["fx_graphs"]["compiled"] and compiled["bypassed"] == 0
    train = rows["train_dense"]["data"]
    assert train["plan_error"] <= 0.05 and train["last_loss"] < train["first_loss"] and 0 < train["mfu"]
    served = rows["serve"]["data"]
    assert served["status"] == 200 and served["equal"] and served["tokens"] > 0
