"""Group-Aware Dual-Stream Mask: mask_mod == dense reference, and the paper's visibility invariants."""

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_mask, flex_attention

from mbd.multitf.layouts import first_response_block, random_layout, systematic_layout
from mbd.multitf.masks import DualStreamIndex, dense_reference, dual_stream_position_ids


def random_batch(rng: np.random.Generator, batch: int, k_max: int, block_size: int, gmax: int):
    """Per-block group ids [batch, k_max] and real lengths for sequences of different lengths.

    Each sequence has prompt blocks, a mixed prompt/response block or not, block padding inside its last
    block, and batch-padding blocks (-1) after its own K blocks.
    """
    bg = np.full((batch, k_max), -1)
    total = []
    for i in range(batch):
        k = int(rng.integers(2, k_max + 1))
        prompt_len = int(rng.integers(0, (k - 1) * block_size))
        t = int(rng.integers(prompt_len + 1, k * block_size + 1))
        t = max(t, (k - 1) * block_size + 1)  # the sequence really uses its K blocks
        first = first_response_block(prompt_len, block_size)
        if rng.random() < 0.5:
            g = int(rng.integers(2, gmax + 1))
            bg[i, :k] = systematic_layout(k, first, g, int(rng.integers(0, g)))
        else:
            bg[i, :k] = random_layout(k, first, gmax, rng)
        total.append(t)
    return bg, total


@pytest.mark.parametrize("seed", range(6))
def test_mask_mod_equals_dense_reference(seed):
    rng = np.random.default_rng(seed)
    block_size = [1, 2, 4, 3, 4, 8][seed]
    bg, total = random_batch(rng, batch=3, k_max=9, block_size=block_size, gmax=4)
    idx = DualStreamIndex.build(bg, total, block_size)
    n = idx.length
    dense = idx.dense_mask()
    flex = create_mask(idx.mask_mod, 3, 1, n, n, device="cpu")
    assert dense.shape == flex.shape == (3, 1, n, n)
    for i in range(3):
        ref = dense_reference(bg[i], total[i], block_size)
        assert torch.equal(dense[i, 0], ref)
        assert torch.equal(flex[i, 0], ref)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_block_mask_attention_equals_sdpa_with_dense_mask():
    rng = np.random.default_rng(11)
    bg, total = random_batch(rng, batch=2, k_max=12, block_size=4, gmax=3)
    idx = DualStreamIndex.build(bg, total, 4)
    n = idx.length
    bm = idx.block_mask(flex_block_size=16)
    q, k, v = (torch.randn(2, 2, n, 8) for _ in range(3))
    out_flex = flex_attention(q, k, v, block_mask=bm)
    out_sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=idx.dense_mask())
    assert torch.allclose(out_flex, out_sdpa, atol=1e-5)


def test_hand_built_example_from_the_paper_definitions():
    # B = 1, K = 4: block 0 is prompt, groups H_0 = {1, 2}, H_1 = {3}; token index = block index.
    ref = dense_reference(np.array([-1, 0, 0, 1]), total_len=4, block_size=1).int()
    gd_goc = [
        # noisy 0..3      clean 0..3
        [1, 0, 0, 0,     1, 0, 0, 0],  # noisy prompt block: clean blocks <= 0 (+ itself)
        [0, 1, 0, 0,     1, 0, 0, 0],  # H_0 slot 1: itself; clean prefix before alpha=1
        [0, 1, 1, 0,     1, 0, 0, 0],  # H_0 slot 2: H_0 blocks <= 2; clean prefix before alpha=1
        [0, 0, 0, 1,     1, 1, 1, 0],  # H_1: itself; clean blocks 0..2
    ]
    bc = [[0] * 4 + [1 if j <= i else 0 for j in range(4)] for i in range(4)]
    assert ref.tolist() == gd_goc + bc


def _token_tables(bg: np.ndarray, total: int, block_size: int):
    length = bg.size * block_size
    beta = np.arange(length) // block_size
    gid = bg[beta]
    alpha = np.array([np.flatnonzero(bg == g)[0] if g >= 0 else -1 for g in gid])
    return length, beta, gid, alpha, np.arange(length) < total


@pytest.mark.parametrize("seed", range(4))
def test_visibility_invariants(seed):
    rng = np.random.default_rng(100 + seed)
    bg, total = random_batch(rng, batch=2, k_max=10, block_size=2, gmax=4)
    dense = DualStreamIndex.build(bg, total, 2).dense_mask()[:, 0].numpy()
    for i in range(2):
        length, beta, gid, alpha, real = _token_tables(bg[i], total[i], 2)
        m = dense[i]
        noisy_to_noisy, noisy_to_clean, clean_to_noisy = m[:length, :length], m[:length, length:], m[length:, :length]
        assert not (clean_to_noisy & ~np.eye(length, dtype=bool)).any()  # clean never sees noisy
        assert not clean_to_noisy.any()
        for q in np.flatnonzero((gid >= 0) & real):
            # no noisy token sees a clean token of its own group or later
            assert not noisy_to_clean[q, beta >= alpha[q]].any()
            seen = np.flatnonzero(noisy_to_noisy[q])
            assert (gid[seen] == gid[q]).all() and (beta[seen] <= beta[q]).all()
            assert noisy_to_clean[q, (beta < alpha[q]) & real].all()
        pad = ~np.concatenate([real, real])
        off_diag = ~np.eye(2 * length, dtype=bool)
        assert not (m[:, pad] & off_diag[:, pad]).any()  # nothing attends padding (except itself)
        assert not (m[pad] & off_diag[pad]).any()  # padding attends nothing real
        assert m.any(axis=1).all()  # no empty softmax row


def test_position_ids_are_shared_between_streams():
    pos = dual_stream_position_ids(6, batch=2)
    assert pos.shape == (2, 12) and torch.equal(pos[:, :6], pos[:, 6:]) and pos[0, :6].tolist() == list(range(6))


def test_build_rejects_bad_shapes():
    with pytest.raises(ValueError, match="block_group"):
        DualStreamIndex.build(np.zeros(4), [4], 1)
    with pytest.raises(ValueError, match="total_len"):
        DualStreamIndex.build(np.zeros((1, 4)), [9], 2)
