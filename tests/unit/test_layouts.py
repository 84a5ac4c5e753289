"""Group-layouts (sec:appendix_layout_construction) and the expansion of one sequence into rows."""

import numpy as np
import pytest

from mbd.multitf.corrupt import ROW_SCHEMA, expand_sequence
from mbd.multitf.layouts import (
    first_response_block,
    groups,
    layout_specs,
    num_layouts,
    random_layout,
    systematic_layout,
)
from mbd.multitf.schedulers import SchedulerConfig, build_scheduler


def group_sizes(block_group: np.ndarray) -> np.ndarray:
    """Sizes of noise-groups 0..n-1 (clean blocks, id -1, are not counted)."""
    ids = np.asarray(block_group)
    return np.bincount(ids[ids >= 0]).astype(np.int64)


def boundary_set_layout(k_resp: int, g: int, h: int) -> list[list[int]]:
    """The paper's definition literally: B_{g,h} = sort({1, K+1} U {1+h+qg : 1 < 1+h+qg < K+1}), 1-based."""
    interior = {1 + h + q * g for q in range(-k_resp, k_resp + 1) if 1 < 1 + h + q * g < k_resp + 1}
    r = sorted({1, k_resp + 1} | interior)
    return [list(range(r[q], r[q + 1])) for q in range(len(r) - 1)]


@pytest.mark.parametrize("gmax", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("n_rand", [0, 1, 3])
def test_layout_count_matches_formula(gmax, n_rand):
    specs = layout_specs(gmax, n_rand)
    assert len(specs) == num_layouts(gmax, n_rand) == (gmax + 2) * (gmax - 1) // 2 + n_rand
    sys_specs = [(s.g, s.h) for s in specs if s.kind == "systematic"]
    assert sys_specs == [(g, h) for g in range(2, gmax + 1) for h in range(g)]
    assert sum(s.kind == "random" for s in specs) == n_rand


@pytest.mark.parametrize("k_total,prompt_blocks,gmax,n_rand",
                         [(1, 0, 2, 0), (5, 2, 3, 2), (12, 3, 4, 3), (40, 7, 5, 1)])
def test_expand_sequence_emits_one_row_per_layout(k_total, prompt_blocks, gmax, n_rand):
    b = 4
    ids = np.arange(k_total * b, dtype=np.int32) + 10
    prompt_len = prompt_blocks * b + (1 if prompt_blocks < k_total - 1 else 0)
    rows = expand_sequence(ids, prompt_len, k_total * b - prompt_len, block_size=b, gmax=gmax, n_rand=n_rand,
                           scheduler=build_scheduler(SchedulerConfig()), mask_token_id=1, seed=0, seq_id=3, epoch=0)
    assert len(rows) == (gmax + 2) * (gmax - 1) // 2 + n_rand
    assert [r["layout_index"] for r in rows] == list(range(len(rows)))
    assert all(set(r) == set(ROW_SCHEMA) - {"recipe"} for r in rows)  # `rows.sequence_rows` adds the recipe


@pytest.mark.parametrize("k_resp", list(range(1, 14)))
def test_systematic_layout_equals_boundary_set_definition(k_resp):
    for g in range(2, 6):
        for h in range(g):
            for first in (0, 3):
                ids = systematic_layout(first + k_resp, first, g, h)
                assert (ids[:first] == -1).all()
                got = [list(m - first + 1) for m in groups(ids)]
                assert got == boundary_set_layout(k_resp, g, h), (k_resp, g, h)
                sizes = group_sizes(ids)
                assert sizes.max() <= g and sizes.sum() == k_resp


def test_coverage_theorem_every_running_set_once_among_shifts():
    k, gmax = 30, 6
    for g in range(2, gmax + 1):
        layouts = {h: [tuple(m + 1) for m in groups(systematic_layout(k, 0, g, h))] for h in range(g)}
        for a in range(1, k - g + 2):
            running_set = tuple(range(a, a + g))
            hits = [h for h in range(g) if running_set in layouts[h]]
            assert hits == [(a - 1) % g], (g, a, hits)


def test_every_interior_block_takes_every_slot_once_across_shifts():
    k, gmax = 25, 5
    for g in range(2, gmax + 1):
        slot = np.full((g, k), -1)
        full = np.ones(k, dtype=bool)
        for h in range(g):
            for members in groups(systematic_layout(k, 0, g, h)):
                slot[h, members] = np.arange(members.size)
                full[members] &= members.size == g
        for blk in np.flatnonzero(full):
            assert sorted(slot[:, blk]) == list(range(g))
        assert full.sum() >= k - 2 * (g - 1)


def test_clipped_single_block_groups_are_kept():
    # K_r = 5, g = 2: h=0 -> {1,2},{3,4},{5}; h=1 -> {1},{2,3},{4,5}
    assert [m.size for m in groups(systematic_layout(5, 0, 2, 0))] == [2, 2, 1]
    assert [m.size for m in groups(systematic_layout(5, 0, 2, 1))] == [1, 2, 2]


def test_prompt_blocks_stay_clean_and_mixed_block_is_response():
    b = 4
    assert first_response_block(8, b) == 2  # prompt fills blocks 0, 1 exactly
    assert first_response_block(9, b) == 2  # block 2 holds the prompt tail and the response start
    ids = systematic_layout(6, first_response_block(9, b), 2, 0)
    assert ids.tolist() == [-1, -1, 0, 0, 1, 1]


def test_random_layouts_cover_response_with_sizes_in_range():
    rng = np.random.default_rng(0)
    gmax, first, k = 4, 3, 40
    seen = []
    for _ in range(300):
        ids = random_layout(k, first, gmax, rng)
        assert (ids[:first] == -1).all() and (ids[first:] >= 0).all()
        assert (np.diff(ids[first:]) >= 0).all() and (np.diff(ids[first:]) <= 1).all() and ids[first] == 0
        sizes = group_sizes(ids)
        assert sizes.sum() == k - first
        assert ((sizes[:-1] >= 2) & (sizes[:-1] <= gmax)).all() and 1 <= sizes[-1] <= gmax
        seen += sizes[:-1].tolist()
    counts = np.bincount(seen, minlength=gmax + 1)[2:]
    expected = len(seen) / (gmax - 1)
    assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected))  # Uniform{2..Gmax}


def test_bad_layout_parameters_name_the_field():
    with pytest.raises(ValueError, match="gmax"):
        num_layouts(1, 0)
    with pytest.raises(ValueError, match="n_rand"):
        layout_specs(3, -1)
    with pytest.raises(ValueError, match="shift h"):
        systematic_layout(5, 0, 2, 2)


def _rows(seed=7, epoch=0, name="chain_uniform"):
    b, k = 4, 10
    ids = (np.arange(k * b) % 13 + 20).astype(np.int32)
    prompt_len, response_len = 9, 27  # block 2 mixed, last block has 4 pad tokens
    return expand_sequence(ids, prompt_len, response_len, block_size=b, gmax=3, n_rand=3,
                           scheduler=build_scheduler(SchedulerConfig(name=name, t_low=0.2, t_high=0.9)),
                           mask_token_id=99, seed=seed, seq_id=11, epoch=epoch)


def test_rows_mask_exactly_floor_b_t_response_positions():
    for r in _rows():
        pos = np.arange(r["clean_ids"].size)
        masked = r["noisy_ids"] != r["clean_ids"]
        assert (r["noisy_ids"][masked] == 99).all()
        assert not masked[(pos < r["prompt_len"]) | (pos >= r["total_len"])].any()
        maskable = ((pos >= r["prompt_len"]) & (pos < r["total_len"])).reshape(-1, 4).sum(1)
        want = np.minimum(np.floor(4 * r["block_ratio"].astype(np.float64)).astype(int), maskable)
        assert masked.reshape(-1, 4).sum(1).tolist() == want.tolist()
        assert (r["block_ratio"][r["block_group"] < 0] == 0).all()
        assert r["block_group"][:2].tolist() == [-1, -1] and (r["block_group"][2:] >= 0).all()


def test_trailing_block_pads_are_maskable_targets():
    """Issue 13: the 4 block-alignment pads after the answer (positions 36..39) are real tokens and
    maskable targets, so the final block's trailing positions get trained; before, they never were."""
    rows = _rows()
    assert all(r["total_len"] == 40 and r["response_len"] == 27 for r in rows)
    last_block_masks = [(r["noisy_ids"][36:] == 99).sum() for r in rows]
    assert any(last_block_masks)
    for r in rows:  # the last block masks floor(4 t) of its 4 positions: none is left out
        assert (r["noisy_ids"][36:] == 99).sum() == np.floor(4 * r["block_ratio"][-1].astype(np.float64))


def test_rows_are_reproducible_and_epoch_changes_noise():
    a, b, c = _rows(), _rows(), _rows(epoch=1)
    for x, y in zip(a, b):
        for key in set(ROW_SCHEMA) - {"recipe"}:
            assert np.array_equal(x[key], y[key]), key
    assert any(not np.array_equal(x["noisy_ids"], z["noisy_ids"]) for x, z in zip(a, c))
    assert all(np.array_equal(x["clean_ids"], z["clean_ids"]) for x, z in zip(a, c))


def test_scheduler_ablation_keeps_random_layouts():
    a, d = _rows(name="chain_uniform"), _rows(name="sorted_uniform")
    assert all(np.array_equal(x["block_group"], y["block_group"]) for x, y in zip(a, d))
    assert any(not np.array_equal(x["block_ratio"], y["block_ratio"]) for x, y in zip(a, d))
