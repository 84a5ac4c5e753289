"""Every tab:appendix_train_hparams row's YAML against the table and the authors' mbd-lms configs of that row."""

from pathlib import Path

import pytest

from mbd.multitf.layouts import num_layouts
from mbd.train_config import load_train_config

ROOT = Path(__file__).resolve().parents[2]

# file: (Steps, Max Group, N_rand) from tab:appendix_train_hparams; (lr, weight_decay) from the authors' config;
# the authors' global_batch_size 32 counts sequences, each trained on all its layouts in the same step.
TABLE = {
    "mbd-llada2-mini-dmax-math": (15000, 2, 0, 2e-6, 0.01),
    "mbd-llada2-mini-dmax-code": (4000, 2, 2, 2e-6, 0.01),
    "mbd-llada2-mini-math": (15000, 2, 0, 1e-5, 0.1),
    "mbd-llada2-mini-code": (6500, 2, 0, 1e-5, 0.1),
    "mbd-sdar-8b-chat-b32-math": (3125, 4, 3, 1e-5, 0.1),
    "mbd-sdar-8b-chat-b32-code": (1670, 4, 3, 1e-5, 0.1),
    "mbd-sdar-8b-chat-b4-math": (1250, 4, 2, 1e-5, 0.1),
    "mbd-sdar-8b-chat-b4-code": (200, 4, 2, 1e-5, 0.1),
}


@pytest.mark.parametrize("name", sorted(TABLE))
def test_row_matches_the_table_and_the_authors_optimiser(name):
    steps, gmax, n_rand, lr, wd = TABLE[name]
    cfg = load_train_config(ROOT / "configs/train" / f"{name}.yaml")
    ds, lay = cfg.deepspeed, cfg.layouts
    assert (cfg.steps, lay.gmax, lay.n_rand) == (steps, gmax, n_rand)
    assert (lay.scheduler.t_low, lay.scheduler.t_high, lay.scheduler.rho) == (0.001, 1.0, 0.01)
    assert (ds.lr, ds.weight_decay, ds.betas, ds.grad_clip) == (lr, wd, (0.9, 0.999), 1.0)
    assert ds.global_batch(cfg.num_workers) == 32 * num_layouts(gmax, n_rand)
    assert ds.warmup_steps == round(0.03 * steps) and ds.lr * ds.min_lr_ratio == pytest.approx(1e-7)
    if "dmax" in name:  # the authors' DMax run: explicit_block{1,2}_noise_{min,max}
        assert lay.scheduler.name == "explicit_slots"
        assert lay.scheduler.slot_ranges == [(0.001, 0.2), (0.8, 1.0)]
    else:
        assert lay.scheduler.name == "chain_uniform"


def test_model_path_relative_to_the_repository_resolves_from_any_directory(tmp_path, monkeypatch):
    """A train config's `model_path: mbd/assets/tiny` resolves as every model path does (the working directory,
    then the repository root), so a job driver started elsewhere finds it; data paths stay the driver's."""
    from mbd.config import REPO_ROOT
    from mbd.train_config import load_train_config
    from pipelines.train_multitf import absolute_paths

    monkeypatch.chdir(tmp_path)
    cfg = absolute_paths(load_train_config(REPO_ROOT / "configs" / "train" / "tiny_cpu.yaml"))
    assert cfg.model_path == str((REPO_ROOT / "mbd" / "assets" / "tiny").resolve())
    assert cfg.data.jsonl is None or cfg.data.jsonl.startswith(str(tmp_path))
