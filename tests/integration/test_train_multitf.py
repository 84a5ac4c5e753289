"""Ray Train + DeepSpeed ZeRO on 2 CPU workers (gloo): parity with a single process, and the export. Rows built on
the fly from a JSONL corpus here; the Parquet rows of `mbd expand` streaming through Ray Data into the workers (a
second pass over each worker's shard included) are the quickstart's (tests/e2e/test_quickstart.py)."""

import numpy as np
import pytest
import torch

from mbd.model import load_checkpoint
from mbd.model.attention import Masked
from mbd.multitf.objectives import compute_objective
from pipelines.train_multitf import run_train
from tests.integration.train_helpers import (make_model_and_corpus, probe_batch, reference_run, step_losses,
                                             train_config)


@pytest.mark.parametrize("stage,family", [(2, "sdar"), (3, "llada2_moe")])
def test_zero_run_matches_single_process_and_exports(ray_cluster, tmp_path, stage, family):
    """Each ZeRO stage once and each family once. LLaDA2's MoE runs every expert in training, so both data-parallel
    ranks reduce the same gradients, and under ZeRO-3 each MoE block is fetched whole (a leaf module): ranks whose
    tokens chose different experts would otherwise issue different all-gathers."""
    model_dir, corpus = make_model_and_corpus(tmp_path, family=family)
    cfg = train_config(f"zero{stage}", tmp_path / "runs", model_dir, corpus, deepspeed__zero_stage=stage)
    if family == "llada2_moe":  # its chat format opens with the authors' system turn: a 64-token record is too short
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_length": 128})})
    summary = run_train(cfg, show_progress=False)

    got = step_losses(summary.history)
    assert sorted(got) == [1, 2, 3, 4] and all(len(v) == 1 for v in got.values())
    ref_losses, ref_model = reference_run(cfg)
    np.testing.assert_allclose([got[s][0] for s in range(1, 5)], ref_losses, rtol=2e-5)
    probes = [m["probe_loss"] for m in summary.history if "probe_loss" in m]
    assert probes[-1] < probes[0] - 0.05  # the loss on the fixed probe batch went down

    # The export reloads with the foundation loader and reproduces the in-memory models.
    exported, _ = load_checkpoint(summary.export_dir)
    batch, mcfg = probe_batch(cfg)
    with torch.no_grad():
        ref_logits = ref_model(batch.input_ids, batch.position_ids, Masked(batch.mask))
        exp_logits = exported(batch.input_ids, batch.position_ids, Masked(batch.mask))
        exp_probe = compute_objective(exported, batch, cfg.objective, mcfg.mask_token_id).loss.item()
    torch.testing.assert_close(exp_logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert exp_probe == pytest.approx(probes[-1], rel=1e-6)  # the worker's (ZeRO-sharded) model, same loss
