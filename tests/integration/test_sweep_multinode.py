"""An evaluation sweep on a 3-node cluster (1 CPU per node): a reservation the nodes can never hold is refused at
once, naming the shortfall; decoding lands on two nodes; once both decoders have stored a unit, a decoder's node
is killed mid-sweep and the units it held are redone on the nodes left, with per-problem records equal to decoding
the same units in this process, nothing stored twice; a re-run skips every finished problem."""

import threading
import time

import pytest

from mbd.eval.sweep import ResultStore, SweepConfig
from mbd.eval.sweep_work import BATCHES_PER_UNIT
from tests.integration.test_eval_sweep import model_dir  # noqa: F401 - the tiny random checkpoint fixture

FAST_DEATH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}  # a killed node is noticed in ~3s
SAME = ("completion", "correct", "nfe", "num_generated", "finish_reason")  # what decoding decides; timings vary
ROWS = 2
UNITS = 12  # of ROWS * BATCHES_PER_UNIT requests that never stop early (~0.3 s each here); a decoder keeps 2 units
PROBLEMS = UNITS * ROWS * BATCHES_PER_UNIT  # in flight while the queue holds more, so a node killed while 4 units
# are still out always takes work with it


def config(ckpt_dir, out, workers: int) -> SweepConfig:
    return SweepConfig(
        name="mn", output_dir=str(out), models=[{"name": "rand", "path": str(ckpt_dir)}],
        decoding=[{"name": "single", "config": "configs/decode/tiny_singlebd.yaml",
                   "overrides": {"max_length": 512, "max_new_tokens": 64, "max_nfe": 128, "ignore_eos": True}}],
        benchmarks=[{"name": "tinymath", "limit": PROBLEMS}], engine={"device": "cpu", "max_batch_rows": ROWS},
        trace_problems=0,
        workers=workers, cpus_per_worker=1, cpus_per_scorer=0.5, reserve_timeout_s=300)


def reference(cfg: SweepConfig) -> dict[str, dict]:
    """The sweep's units decoded and scored in this process, one engine for all (what a 1-node run stores)."""
    from mbd.eval.sweep import load_splits, score_completion
    from mbd.eval.sweep_work import EngineCache, decode_prompts, plan_units

    splits = load_splits(cfg)
    units, _ = plan_units(cfg, {k: s.scored for k, s in splits.items()}, ResultStore(cfg.output_dir + "-none"),
                          {k: s.exemplars for k, s in splits.items()})
    engines, out = EngineCache(cfg.engine), {}
    for u in units:
        decoded = decode_prompts(engines.get(u.cell.model, u.params), u.prompts(), u.params, u.keep_trace)
        for p, d in zip(u.problems, decoded.decoded):
            out[p.problem_id] = {**{k: getattr(d, k) for k in SAME if k != "correct"},
                                 "correct": score_completion("tinymath", p, d.completion).correct}
    return out


def test_sweep_across_nodes_survives_a_lost_node(multinode, model_dir, tmp_path):  # noqa: F811
    from pipelines.eval_sweep import run_sweep
    from pipelines.sweep_pool import PlacementError, read_placement_log

    cluster = multinode(workers=(1, 1), head_cpus=1, system_config=FAST_DEATH)
    with pytest.raises(PlacementError, match=r"3 decoder\(s\) x \{CPU: 1\} \+ 1 scoring slot\(s\) x \{CPU: 0.5\} "
                                             r"\(3.5 CPU in all\).*3 node\(s\)"):
        run_sweep(config(model_dir, tmp_path / "too_big", workers=3), progress=False)

    cfg = config(model_dir, tmp_path / "out", workers=2)
    store = ResultStore(cfg.output_dir)
    result: dict = {}
    run = threading.Thread(target=lambda: result.update(summary=run_sweep(cfg, progress=False)), daemon=True)
    run.start()
    deadline = time.monotonic() + 600
    while True:  # until both decoders have stored a unit: the node killed next has decoded work that must survive
        stored = store.load_prefix_cache("rand", "single", "tinymath")
        if len(decoded_on := {u.node for u in stored}) >= 2:
            break
        assert run.is_alive() and time.monotonic() < deadline, f"the sweep decoded on {len(decoded_on)} node(s) only"
        time.sleep(0.1)
    assert len(stored) <= UNITS - 4, f"{len(stored)} units back before both decoders had returned one"
    reserved = read_placement_log(cfg.output_dir)[0]
    worker_ids = {n.node_id: n for n in cluster.worker_nodes}
    victim = next(n for n in reserved["decoder_nodes"] if n in worker_ids and n in decoded_on)
    cluster.remove_node(worker_ids[victim], graceful=False)
    run.join(600)
    assert not run.is_alive() and "summary" in result, "the sweep did not finish after losing a node"

    summary = result["summary"]
    assert (summary.decoded, summary.skipped) == (PROBLEMS, 0)
    events = read_placement_log(cfg.output_dir)
    lost = [e for e in events if e["event"] == "lost"]
    assert [e["event"] for e in events] == ["reserved", "lost", "reserved"] and lost[0]["units"] >= 1
    assert lost[0]["nodes_gone"] == [victim]
    assert len(set(reserved["decoder_nodes"])) == 2  # the decoders were spread over two nodes
    after = events[2]
    assert victim not in after["decoder_nodes"] + after["scorer_nodes"]
    units = store.load_prefix_cache("rand", "single", "tinymath")
    assert victim in {u.node for u in units}  # what the lost node decoded before it went was kept
    assert sorted(i for u in units for i in u.problem_ids) == sorted(store.load("rand", "single", "tinymath"))

    lines = store.path("rand", "single", "tinymath").read_text().splitlines()
    stored = store.load("rand", "single", "tinymath")
    assert len(lines) == len(stored) == PROBLEMS  # every problem once: nothing lost, nothing stored twice
    ref = reference(cfg)
    assert {i: {k: getattr(r, k) for k in SAME} for i, r in stored.items()} == ref

    again = run_sweep(cfg, progress=False)  # a re-run finds every problem stored
    assert (again.decoded, again.skipped) == (0, PROBLEMS)
