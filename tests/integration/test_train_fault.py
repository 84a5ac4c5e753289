"""Fault tolerance: a worker that raises is restarted from the last checkpoint, and a re-run with the same
RunConfig(name, storage_path) resumes where the run stopped.

The fault is injected by the test alone (`loop_with_fault`): no production config field or code path knows of it.
`slow`: test_multinode_train covers the same restart (a lost node's workers instead of a raising one, the same
failure policy and checkpoint resume), the re-run and `mbd export` on the same pretraining path, on a multi-node
cluster; this one adds only the raising worker, three worker groups for it."""

import pytest
import torch

from mbd.model import load_checkpoint
from pipelines import train_multitf
from pipelines.export import main as export_main
from pipelines.train_multitf import run_train
from tests.integration.train_helpers import (FAIL_AT, FAULT_MARKER, loop_with_fault, make_model_and_corpus,
                                             step_losses, train_config)


@pytest.mark.slow
def test_worker_failure_resumes_from_last_checkpoint_then_rerun_continues(ray_cluster, tmp_path, monkeypatch):
    model_dir, corpus = make_model_and_corpus(tmp_path)
    every, fail_at = 2, FAIL_AT
    # block-diffusion TF layouts + SDAR weighting: the pretraining path, exercised here too
    cfg = train_config("fault", tmp_path / "runs", model_dir, corpus, steps=5, checkpoint_every=every,
                       max_failures=1, layouts={"mode": "tf", "gmax": 2, "scheduler": {"name": "random"}},
                       objective={"name": "sdar_weighted_ce"}, deepspeed__grad_accum=1)
    monkeypatch.setattr(train_multitf, "train_loop", loop_with_fault)
    summary = run_train(cfg, show_progress=False)
    monkeypatch.undo()

    log = [int(m["step"]) for m in summary.history if "loss" in m]
    print("step log (with restart):", log)
    last_ckpt = (fail_at - 1) // every * every
    # steps 1..fail_at-1 ran, the failure hit at fail_at, the restart resumed after the last checkpoint
    assert log == list(range(1, fail_at)) + list(range(last_ckpt + 1, cfg.steps + 1))
    repeated = [s for s, v in step_losses(summary.history).items() if len(v) > 1]
    assert set(repeated) == set(range(last_ckpt + 1, fail_at)) and len(repeated) <= every
    for s in repeated:  # exact resume: same weights, optimizer state and rows -> the same loss
        first, again = step_losses(summary.history)[s]
        assert again == pytest.approx(first, rel=1e-6)
    assert (tmp_path / "runs" / "fault" / FAULT_MARKER).exists()

    rerun = run_train(cfg.model_copy(update={"steps": 7}), show_progress=False)
    log2 = [int(m["step"]) for m in rerun.history if "loss" in m]
    print("step log (re-run):", log2)
    assert log2 == [6, 7] and rerun.last_step == 7

    # `mbd export` of the run's latest checkpoint gives the weights the run exported at its end
    assert export_main(["--run-dir", str(tmp_path / "runs" / "fault"), "--out", str(tmp_path / "cli")]) == 0
    a, _ = load_checkpoint(tmp_path / "cli")
    b, _ = load_checkpoint(rerun.export_dir)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
