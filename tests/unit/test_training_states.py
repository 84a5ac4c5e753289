"""benchmarks.training_states: states counted from what the model sees, against hand-counted rows and traces."""

from collections import Counter

import numpy as np

from benchmarks.training_states import (decoding_states, masked_fractions, rising_share, top_pairs,
                                        total_variation, training_states, unseen_share)
from mbd.multitf.corrupt import layout_row
from mbd.multitf.layouts import layout_specs
from mbd.multitf.schedulers import SchedulerConfig, build_scheduler

M = 99  # mask id (no clean token below uses it)


def test_fractions_count_masked_tokens_per_block():
    clean = np.array([1, 2, 3, 4, 5, 6, 7, 8])
    noisy = np.array([1, M, 3, 4, M, M, M, M])
    assert masked_fractions(noisy, clean, M, 4, 2).tolist() == [0.25, 1.0]
    # a short sequence: missing tokens count as unmasked
    assert masked_fractions(noisy[:6], clean[:6], M, 4, 2).tolist() == [0.25, 0.5]


def test_training_states_from_one_hand_made_row():
    clean = np.arange(1, 17)
    noisy = clean.copy()
    noisy[[4, 8, 9, 12, 13, 14]] = M  # blocks 1..3 masked 1, 2, 3 of 4
    row = {"block_group": [-1, 0, 0, 1], "noisy_ids": noisy, "clean_ids": clean}
    sizes, pairs, blocks = training_states([row], M, 4)
    assert sizes == Counter({2: 1, 1: 1})
    assert pairs == Counter({(0.25, 0.5): 1})  # only inside a group; the prompt block is no member
    assert blocks == Counter({0.25: 1, 0.5: 1, 0.75: 1})


def test_paper_masking_never_trains_a_fully_masked_block_at_b4():
    """floor(B t) with t <= t_eff < 1: the diagnostic's 'decoding blocks unseen' column rests on this."""
    sched = build_scheduler(SchedulerConfig())
    ids = np.arange(10, 10 + 64, dtype=np.int32)  # no 99
    rows = [layout_row(ids, 8, 56, spec, i, block_size=4, gmax=4, scheduler=sched, mask_token_id=M, seed=0,
                       seq_id=s, epoch=0) for s in range(20) for i, spec in enumerate(layout_specs(4, 2))]
    _, _, blocks = training_states(rows, M, 4)
    assert max(blocks) == 0.75 and sum(blocks.values()) > 1000


def test_decoding_states_pair_consecutive_active_slots():
    trace = [{"states": ["ACTIVE", "DUMMY"], "mask_ratio": [1.0, None]},
             {"states": ["ACTIVE", "ACTIVE", "ACTIVE"], "mask_ratio": [0.25, 1.0, 0.5]},
             {"states": ["TO_CACHE", "ACTIVE"], "mask_ratio": [None, 0.5]},
             {"states": ["TO_CACHE", "TO_CACHE"], "mask_ratio": [None, None]}]
    sizes, pairs, blocks = decoding_states([trace])
    assert sizes == Counter({1: 2, 3: 1})  # the cache-only forward is no state
    assert pairs == Counter({(0.25, 1.0): 1, (1.0, 0.5): 1})
    assert blocks == Counter({1.0: 2, 0.5: 2, 0.25: 1})
    assert rising_share(pairs) == 0.5


def test_distances():
    p, q = Counter({"a": 3, "b": 1}), Counter({"a": 1, "c": 1})
    assert total_variation(p, q) == 0.5 * (abs(0.75 - 0.5) + 0.25 + 0.5)
    assert total_variation(p, p) == 0.0
    assert unseen_share(p, q) == 0.5
    assert top_pairs(Counter({(0.25, 1.0): 3, (0.5, 0.5): 1}), 1) == "(0.25, 1) 75.0%"
