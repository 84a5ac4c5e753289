"""Ray Train + DeepSpeed across nodes: the two workers start on two different nodes; a worker node is removed
mid-run after a checkpoint, the run goes on from the last checkpoint on the nodes left, and its step log, losses
and exported weights are those of the uninterrupted run (the single-process reference of test_train_multitf); a
re-run with the same RunConfig(name, storage_path) and more steps continues where the run stopped, and `mbd export`
of its latest checkpoint gives the weights it exported. The run takes the pretraining path (block-diffusion TF
layouts, random scheduler, SDAR's weighted CE); test_train_multitf runs MultiTF layouts. A worker that raises
instead of being lost takes the same restart (Ray Train's failure policy): test_train_fault, `slow`. The same node
loss while training from `mbd expand`'s Parquet rows, which leaves no free CPU for Ray Data's read tasks, finishes
too."""

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mbd.model import load_checkpoint
from pipelines import train_multitf
from pipelines.expand_layouts import ExpandConfig, run_expand
from pipelines.export import main as export_main
from pipelines.train_multitf import TrainSummary, run_train
from tests.integration.multinode_jobs import loop_marking_node, steps_started, worker_nodes
from tests.integration.train_helpers import make_model_and_corpus, reference_run, step_losses, train_config

STEPS, EVERY = 6, 2


def checkpointed_steps(run_dir: Path) -> list[int]:
    """The steps of the checkpoints Ray Train has registered (all ranks reported them), from the record it keeps
    in the run directory: a checkpoint directory alone may be one a rank never finished reporting."""
    record = run_dir / "checkpoint_manager_snapshot.json"
    if not record.is_file():
        return []
    try:
        results = json.loads(record.read_text())["checkpoint_results"]
    except ValueError:  # being written
        return []
    return sorted(int(r["metrics"]["step"]) for r in results)


def run_losing_a_worker_node(multinode, cfg, monkeypatch, expand: Path | None = None) -> TrainSummary:
    """Runs `cfg` on three 1-CPU nodes (two 1-CPU workers cannot share one) and removes a worker's node once Ray
    Train has registered a checkpoint; asserts what every data path must give: two ranks on two nodes, a new group
    on the nodes left that resumed from the last registered checkpoint, every step after it logged once.
    `expand`: a corpus that `mbd expand` turns into cfg.data.parquet on this cluster first."""
    run_dir = Path(cfg.run.run_dir)
    cluster = multinode(workers=(1, 1))
    monkeypatch.setattr(train_multitf, "train_loop", loop_marking_node)
    if expand is not None:
        run_expand(ExpandConfig(inputs=[str(expand)], output_dir=str(Path(cfg.data.parquet).parent),
                                model_dir=cfg.model_path, max_length=cfg.data.max_length, gmax=2, n_rand=1))
    outcome = {}
    fit = threading.Thread(target=lambda: outcome.update(summary=run_train(cfg, show_progress=False)), daemon=True)
    t0 = time.monotonic()
    fit.start()
    deadline = time.monotonic() + 900
    while not checkpointed_steps(run_dir):
        assert fit.is_alive() and time.monotonic() < deadline, f"no checkpoint written: {outcome}"
        time.sleep(0.2)
    first = dict(worker_nodes(str(run_dir)))  # rank -> node of the first worker group
    head = cluster.cluster.head_node.node_id
    victim = next(n for n in cluster.worker_nodes if n.node_id in first.values())
    at_removal = checkpointed_steps(run_dir)
    cluster.remove_node(victim)
    removed_at = time.monotonic() - t0
    fit.join(timeout=900)
    assert not fit.is_alive(), "training did not finish after the node loss"
    summary = outcome["summary"]
    starts = worker_nodes(str(run_dir))
    log = [int(m["step"]) for m in summary.history if "loss" in m]
    print(f"\nworkers {first} (head {head[:8]}); removed {victim.node_id[:8]} at {removed_at:.1f}s with checkpoints "
          f"{at_removal}; worker starts {[(r, n[:8]) for r, n in starts]}; step log {log}; "
          f"done in {time.monotonic() - t0:.1f}s")

    assert len(set(first.values())) == 2 and len(first) == 2  # two ranks on two different nodes
    restarted = dict(starts[2:])
    assert sorted(restarted) == [0, 1] and victim.node_id not in restarted.values()  # a new group, nodes left
    # where the new group resumed: the first step its workers started (the log alone cannot tell when the node
    # went between a checkpoint and the next step's report: then no step is logged twice)
    started = steps_started(str(run_dir))
    new_pids = set(started) - {pid for pid, steps in started.items() if min(steps) == 1}
    resumed_from = min(min(started[p]) for p in new_pids) - 1
    assert resumed_from >= max(at_removal) and resumed_from % cfg.checkpoint_every == 0  # the last registered one
    tail = list(range(resumed_from + 1, cfg.steps + 1))  # the new group's steps, each logged once
    head = log[: len(log) - len(tail)]  # the first group's, some perhaps run again after the loss
    assert log[len(head):] == tail and head == list(range(1, len(head) + 1)) and len(head) >= resumed_from
    return summary


def test_training_on_two_nodes_survives_losing_one(multinode, tmp_path, monkeypatch):
    model_dir, corpus = make_model_and_corpus(tmp_path)
    cfg = train_config("nodes", tmp_path / "runs", model_dir, corpus, steps=STEPS, checkpoint_every=EVERY,
                       max_failures=1, cpus_per_worker=1, deepspeed__grad_accum=1,
                       layouts={"mode": "tf", "gmax": 2, "scheduler": {"name": "random"}},
                       objective={"name": "sdar_weighted_ce"})
    run_dir = tmp_path / "runs" / "nodes"
    summary = run_losing_a_worker_node(multinode, cfg, monkeypatch)
    losses = step_losses(summary.history)
    for step, values in losses.items():  # a step run twice: same weights, optimizer state and rows
        assert values == pytest.approx([values[0]] * len(values), rel=1e-6)

    ref_losses, ref_model = reference_run(cfg)  # the uninterrupted run
    np.testing.assert_allclose([losses[s][-1] for s in range(1, STEPS + 1)], ref_losses, rtol=2e-5)
    exported, _ = load_checkpoint(summary.export_dir)
    for (name, a), b in zip(exported.state_dict().items(), ref_model.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)

    monkeypatch.undo()  # the re-run trains as `mbd train` does, on the head and the node left
    rerun = run_train(cfg.model_copy(update={"steps": STEPS + 2}), show_progress=False)
    assert [int(m["step"]) for m in rerun.history if "loss" in m] == [STEPS + 1, STEPS + 2]
    assert rerun.last_step == STEPS + 2
    assert export_main(["--run-dir", str(run_dir), "--out", str(tmp_path / "cli")]) == 0
    cli, _ = load_checkpoint(tmp_path / "cli")
    final, _ = load_checkpoint(rerun.export_dir)
    assert all(torch.equal(a, b) for a, b in zip(cli.state_dict().values(), final.state_dict().values()))


def test_training_from_parquet_on_two_nodes_survives_losing_one(multinode, tmp_path, monkeypatch):
    """The same loss with `mbd expand`'s Parquet rows. After it the two workers hold every CPU of the cluster, and
    Ray Data's read tasks for the new group's shards take none (a read task that waited for a CPU stalled the run
    for good). The new group's workers skip the micro-batches their pass had trained on, so every step's loss and
    the exported weights are those of an uninterrupted run of the same config, here on the two nodes left (two CPUs
    where the first run had three: Ray Data's split must not depend on the cluster's size). 6 sequences x 3 layouts
    = 9 rows per worker, 4 micro-batches of 2 per pass: the run crosses into a second pass, so a resume may land in
    either."""
    model_dir, corpus = make_model_and_corpus(tmp_path, records=6)
    cfg = train_config("nodes", tmp_path / "runs", model_dir, corpus, steps=STEPS, checkpoint_every=EVERY,
                       max_failures=1, cpus_per_worker=1, deepspeed__grad_accum=1)
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"jsonl": None,
                                                                     "parquet": str(tmp_path / "expanded" / "rows")})})
    summary = run_losing_a_worker_node(multinode, cfg, monkeypatch, expand=corpus)
    losses = step_losses(summary.history)
    monkeypatch.undo()
    ref = run_train(cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": "ref"})}), show_progress=False)
    ref_losses = step_losses(ref.history)
    assert sorted(losses) == sorted(ref_losses) == list(range(1, STEPS + 1))
    for step, values in losses.items():  # a step run twice or by the uninterrupted run: the same rows
        assert values == pytest.approx([ref_losses[step][0]] * len(values), rel=1e-6), step
    initial = [[m["probe_loss"] for m in h if m["step"] == 0] for h in (summary.history, ref.history)]
    assert initial[0] == initial[1] and len(initial[0]) == 1  # the probe: the same first rows of the data
    exported, _ = load_checkpoint(summary.export_dir)
    reference, _ = load_checkpoint(ref.export_dir)
    for (name, a), b in zip(exported.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
