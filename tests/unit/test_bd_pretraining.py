"""The faithful BD-LM pretraining option against its formulas: eq:forward's independent masking (each maskable token
with probability t), eq:block_diffusion's 1/t weight (an unbiased estimate of the whole block's loss), and the
configs that select them (tiny_pretrain_bd.yaml; the quickstart's objective defaults to the model family's)."""

import math
from pathlib import Path

import numpy as np
import pytest

from mbd.multitf.corrupt import corrupt, sample_masked
from mbd.multitf.objectives import FAMILY_OBJECTIVE, family_objective
from mbd.multitf.rows import LayoutSection, TokenizedSequence, redraw_columns, sequence_row
from mbd.multitf.batching import rows_to_columns

B = 4


@pytest.mark.parametrize("t", [0.05, 0.3, 0.8])
def test_bernoulli_masks_each_token_with_probability_t(t):
    k = 20000
    masked = sample_masked(np.full(k, t), np.ones((k, B), dtype=bool), B, np.random.default_rng(0), "bernoulli")
    frac = masked.mean()
    assert abs(frac - t) < 4 * np.sqrt(t * (1 - t) / (k * B))  # E = t
    full = masked.all(1).mean()  # a block is fully masked with probability t^B (never under floor(B t) < B)
    assert abs(full - t**B) < 4 * np.sqrt(t**B * (1 - t**B) / k) + 1e-3
    counts = np.bincount(masked.sum(1), minlength=B + 1) / k  # Binomial(B, t) per block
    want = [math.comb(B, m) * t**m * (1 - t) ** (B - m) for m in range(B + 1)]
    assert np.allclose(counts, want, atol=0.02)


def test_bernoulli_never_masks_the_prompt_and_is_exact_at_0_and_1():
    ids = np.arange(16, dtype=np.int32)
    rng = np.random.default_rng(1)
    assert (corrupt(ids, np.ones(4), 6, B, 99, rng, "bernoulli") == np.where(np.arange(16) < 6, ids, 99)).all()
    assert (corrupt(ids, np.zeros(4), 6, B, 99, rng, "bernoulli") == ids).all()


def test_one_over_t_weight_is_an_unbiased_estimate_of_the_block_loss():
    """eq:block_diffusion: E_t,mask[(1/t) sum_{i masked} c_i] = sum_i c_i for any per-token costs c, t ~ U(eps, 1)."""
    rng = np.random.default_rng(2)
    c = np.array([0.3, 1.7, 0.2, 2.5])
    n = 200000
    t = rng.uniform(0.05, 1.0, n)
    masked = sample_masked(t, np.ones((n, B), dtype=bool), B, rng, "bernoulli")
    est = (masked * c).sum(1) / t
    assert abs(est.mean() - c.sum()) < 4 * est.std() / np.sqrt(n)


def test_masking_travels_with_the_recipe_so_a_redrawn_pass_stays_bernoulli():
    layouts = LayoutSection(mode="tf", scheduler={"name": "random_iid", "gamma_rand": 1.0, "t_low": 0.9,
                                                  "t_high": 1.0}, masking="bernoulli")
    seq = TokenizedSequence(3, np.arange(40, dtype=np.int32), 4, 36)
    row = sequence_row(seq, layouts, 0, block_size=B, mask_token_id=99, seed=0, epoch=0)
    assert '"masking":"bernoulli"' in row["recipe"]
    later = redraw_columns(rows_to_columns([row]), 1, block_size=B, mask_token_id=99)
    noisy = np.asarray(later["noisy_ids"][0]).reshape(-1, B)[1:]
    assert (noisy == 99).all(1).mean() > 0.4  # t >= 0.9: most blocks fully masked, impossible under floor_count


def test_bd_pretraining_config_selects_the_paper_rules_at_the_same_budget():
    from pipelines.pretrain_tiny import DEFAULT_CONFIG, load_pretrain_config

    bd = load_pretrain_config(Path(DEFAULT_CONFIG).with_name("tiny_pretrain_bd.yaml"), [], None, None)
    tf = load_pretrain_config(DEFAULT_CONFIG, [], None, None)
    assert bd.train.layouts.mode == "tf" and bd.train.layouts.masking == "bernoulli"
    assert bd.train.objective.name == "sdar_weighted_ce" and tf.train.layouts.masking == "floor_count"
    assert (bd.train.steps, bd.train.deepspeed, bd.corpus, bd.model) == (tf.train.steps, tf.train.deepspeed, tf.corpus,
                                                                          tf.model)


def test_quickstart_objective_defaults_to_the_model_family(tmp_path):
    from mbd.config import REPO_ROOT
    from pipelines.stages import DEFAULT_CONFIG, load_config, train_config

    assert FAMILY_OBJECTIVE == {"sdar": "sdar_weighted_ce", "llada2_moe": "multitf_ce"}
    base = REPO_ROOT / "mbd" / "assets" / "tiny"
    default = train_config(load_config(DEFAULT_CONFIG, ["train.objective=null"]), tmp_path, base, str(tmp_path))
    assert default.objective == family_objective("sdar")
    chosen = train_config(load_config(DEFAULT_CONFIG, ["train.objective.name=multitf_ce"]), tmp_path, base,
                          str(tmp_path))
    assert chosen.objective.name == "multitf_ce"
