"""A reduced `mbd quickstart` end to end, through its CLI: Ray Data expansion, Ray Train + DeepSpeed ZeRO on two
CPU workers, the evaluation sweep and one OpenAI-style request to Ray Serve, on the shipped tiny base.

Runs on the session's Ray cluster (`ray_cluster`, shared with the integration tests): the command joins a connected
Ray instead of starting and stopping a cluster of its own (which it does when run alone).
"""

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from mbd.config import ConfigError, read_json, resolve_path
from mbd.multitf.layouts import num_layouts
from pipelines.quickstart import MBD, MBD_AS_SINGLEBD, QuickstartSummary, main
from pipelines.stages import DEFAULT_CONFIG, MULTIBD_TF, SINGLEBD, load_config

# 3 problems x |Lambda| = 11 layouts = 33 rows: each worker's shard holds one 16-row micro-batch, so step 2 starts a
# second pass over the shard (Ray Data reads the Parquet rows again, their noise redrawn)
STEPS, PROBLEMS, CORPUS = 2, 6, 3
SETS = ["eval.tps_problems=4", "eval.tps_rounds=2", "eval.trace_problems=4"]  # the side-by-side timing, shrunk
EXTRA_ARGS: list[str] = []  # e.g. ["--base-model", DIR] to try the test against another checkpoint


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("quickstart") / "run"
    argv = ["--run-dir", str(run_dir), "--steps", str(STEPS), "--problems", str(PROBLEMS), "--corpus", str(CORPUS),
            "--no-progress", *(a for kv in SETS for a in ("--set", kv)), *EXTRA_ARGS]
    assert main(argv) == 0
    return run_dir, QuickstartSummary.model_validate_json((run_dir / "quickstart.json").read_text())


def test_table_has_the_four_methods_with_finite_numbers(run):
    _, s = run
    assert [r.method for r in s.rows] == [SINGLEBD, MULTIBD_TF, MBD, MBD_AS_SINGLEBD]
    ev = load_config(DEFAULT_CONFIG, SETS).eval
    single, multi = len(ev.curve), len(ev.curve) + len(ev.multibd_curve)
    for r, curve_points in zip(s.rows, (single, multi, multi, single)):
        assert r.n == PROBLEMS
        assert 0.0 <= r.accuracy <= 100.0
        assert math.isfinite(r.tpf) and r.tpf > 0 and math.isfinite(r.tps) and r.tps > 0
        assert len(r.curve) == curve_points and r.aup is not None and math.isfinite(r.aup)
        assert f"| {r.method} |" in s.table_markdown
        # TPS side by side: one sample per interleaved round, the median inside its spread, in the table
        assert sorted(r.tps_timed) == sorted(ev.tps_batches)
        for t in r.tps_timed.values():
            assert len(t.per_round) == ev.tps_rounds and t.low <= t.median <= t.high and t.low > 0
            assert f"| {t.median:.1f} ({t.low:.1f}-{t.high:.1f}) |" in s.table_markdown
    # SingleBD and training-free MultiBD decode the shipped base, MBD (and its SingleBD diagnostic) the export
    assert [r.model for r in s.rows] == ["base", "base", "mbd-tiny", "mbd-tiny"]
    pairs, claim_a = s.comparisons[:2], s.comparisons[2:]
    assert [c.split(" vs ")[0] for c in pairs] == [MBD, MBD_AS_SINGLEBD]
    assert all(f"vs {SINGLEBD}: accuracy" in c and "95% CI" in c and f"n={PROBLEMS}" in c and "CI width" in c
               for c in pairs)
    # claim (a)'s verdict with the width of the interval behind it
    assert len(claim_a) == 1 and claim_a[0].startswith(f"claim (a) on {PROBLEMS} held-out problems: ")
    assert "95% CI width" in claim_a[0]


def test_expansion_writes_lambda_rows_per_sequence(run):
    _, s = run
    cfg = load_config(DEFAULT_CONFIG).expand
    assert s.layouts_per_sequence == num_layouts(cfg.gmax, cfg.n_rand)
    assert s.rows_out == CORPUS * s.layouts_per_sequence
    rows_dir = Path(s.run_dir) / "layouts" / "rows"
    assert sum(pq.ParquetFile(f).metadata.num_rows for f in rows_dir.glob("*.parquet")) == s.rows_out


def test_training_streams_the_parquet_rows_and_exports_the_mbd_model_with_the_base_architecture(run):
    run_dir, s = run
    train = load_config(DEFAULT_CONFIG).train
    per_worker = s.rows_out // train.num_workers
    assert per_worker // train.micro_batch_size < STEPS  # the shard ran out: the last step is on a second pass
    steps = [m for m in map(json.loads, (run_dir / "train" / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    assert [int(m["step"]) for m in steps] == list(range(1, STEPS + 1)) and steps[-1] == s.train_final
    assert all(math.isfinite(m["loss"]) and m["masked_tokens"] > 0 for m in steps)
    # rows reach the workers through a seeded shuffle buffer: both kinds of layout and both slots are trained on
    assert {"ce/systematic", "ce/random", "ce/slot0", "ce/slot1"} <= set().union(*steps)
    exported = read_json(Path(s.model_dir) / "config.json")
    base = read_json(resolve_path(load_config(DEFAULT_CONFIG).base_model) / "config.json")
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "block_size", "mask_token_id"):
        assert exported[key] == base[key]
    assert (Path(s.model_dir) / "tokenizer.json").is_file()


def test_serve_answered_one_openai_request(run):
    _, s = run
    assert s.serve is not None and s.serve.url.startswith("http://127.0.0.1:")
    usage, stats = s.serve.usage, s.serve.mbd
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert stats["nfe"] >= 1  # the server rounds TPF to 4 decimals
    assert stats["tpf"] == pytest.approx(stats["num_generated"] / stats["nfe"], abs=1e-3)
    assert isinstance(s.serve.content, str)


def test_artefacts_and_stage_timings(run):
    run_dir, s = run
    assert list(s.stage_wall_s) == ["expand", "train", "eval", "serve"]
    assert Path(s.report_path).is_file() and all(Path(p).is_file() for p in s.plots)
    assert any(p.endswith("noise_activity.png") for p in s.plots)
    assert json.loads((run_dir / "quickstart.json").read_text())["table_markdown"] == s.table_markdown


# ---------------------------------------------------------------- fast checks (no Ray)

def test_bad_config_values_name_the_field():
    with pytest.raises(ConfigError, match=r"eval curve point 1"):
        load_config(DEFAULT_CONFIG, ["eval.curve=[{}, {tau_m2t: 1.5}]"])
    with pytest.raises(ConfigError, match="stepz"):
        load_config(DEFAULT_CONFIG, ["train.stepz=3"])
    with pytest.raises(ConfigError, match="corpus.problems"):
        load_config(DEFAULT_CONFIG, ["corpus.problems=1000000000"])


def test_corpus_is_the_posttrain_part_drawn_with_the_seed(tmp_path):
    """The quickstart's corpus comes from the posttrain hash part, never the base's pretrain part
    (tests/unit/test_corpus_disjoint.py counts the shared problems: 0)."""
    from mbd.tiny.task import generate
    from pipelines.stages import write_corpus

    as_line = lambda r: {"prompt": r["question"], "response": r["solution"], "answer": r["answer"]}  # noqa: E731
    for seed in (0, 1):
        lines = write_corpus(tmp_path / f"s{seed}.jsonl", 200, seed).read_text().splitlines()
        assert lines == [json.dumps(as_line(r)) for r in generate("posttrain", 200, seed)]


def test_reproduce_judges_from_stored_records_and_marks_missing_parts_not_run(tmp_path):
    from mbd.eval.benchmarks import get_benchmark
    from mbd.eval.sweep import ItemRecord, ResultStore
    from pipelines.reproduce import claim_methods, judge_all, methods_for, runs_of

    cfg = load_config(DEFAULT_CONFIG, ["eval.problems=4", "eval.claim_problems=6", "claim_seeds.a=1",
                                       "claim_seeds.c=1"])
    runs = runs_of(cfg, ["core"])
    methods = methods_for(cfg, runs)
    stored, claim_stored = set(), set()
    for where, n, kept, points in (("eval", 4, methods, None), ("claims", 6, claim_methods(cfg, methods, runs), 1)):
        store = ResultStore(tmp_path / where)
        ids = [p.problem_id for p in get_benchmark("tinymath").load(limit=n)]
        for label, key, path, model in kept:
            for o in cfg.eval.overrides(path)[:points]:
                config = f"{key}" + "".join(f".{k}={v}" for k, v in o.items())
                (stored if where == "eval" else claim_stored).add((model, config))
                for i, pid in enumerate(ids):
                    store.append(ItemRecord(model=model, config=config, benchmark="tinymath", problem_id=pid,
                                            completion="", correct=i < 3, nfe=4, num_generated=8, tpf=2.0,
                                            wall_time_s=0.1, step_latency_ms=1.0, finish_reason="eos"))
    assert claim_stored == {("base", "singlebd"), ("base", "multibd-tf"), ("mbd-chain", "mbd-chain")}
    claims = judge_all(cfg, tmp_path, runs, stored, claim_stored)
    assert [c.id for c in claims] == list("abcdef")
    verdicts = {c.id: c.verdict for c in claims}
    assert verdicts["a"] == "NOT REPRODUCED"  # every method has the same TPF: a 1.00x gain
    assert verdicts["b"] == "NOT REPRODUCED" and verdicts["c"] == "NOT REPRODUCED"  # no TPF gain, nothing lost
    assert (verdicts["d"], verdicts["e"], verdicts["f"]) == ("NOT RUN", "NOT RUN", "NOT RUN")
    assert "1.00x" in claims[0].evidence and "n=6" in claims[0].evidence  # (a) on the claim problems
    missing = claim_stored - {("mbd-chain", "mbd-chain")}  # the MBD operating point on the claim problems
    assert {c.id: c.verdict for c in judge_all(cfg, tmp_path, runs, stored, missing)}["a"] == "NOT RUN"
