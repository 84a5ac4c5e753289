"""Noise-schedulers (chain-uniform, D2F-style, random power-law chain, random iid, sorted-uniform) and the masking rule."""

import numpy as np
import pytest
from pydantic import ValidationError

from mbd.multitf.corrupt import mask_counts, sample_masked
from mbd.multitf.rng import Purpose, generator
from mbd.multitf.schedulers import SchedulerConfig, build_scheduler

# one prompt block, then groups of sizes 3, 1, 4, 2
LAYOUT = np.array([-1, 0, 0, 0, 1, 2, 2, 2, 2, 3, 3])
N = 8000


def draws(name: str, layout=LAYOUT, n=N, **params) -> np.ndarray:
    sched = build_scheduler(SchedulerConfig(name=name, **params))
    rng = np.random.default_rng(1234)
    return np.stack([sched.sample(layout, rng) for _ in range(n)])


def within_sigma(samples: np.ndarray, expected: float, k: float = 5.0) -> bool:
    return abs(samples.mean() - expected) < k * samples.std() / np.sqrt(samples.size) + 1e-12


def group_slices(layout):
    return [np.flatnonzero(layout == m) for m in range(layout.max() + 1)]


def test_chain_uniform_monotone_in_group_and_within_bounds():
    cfg = SchedulerConfig(t_low=0.1, t_high=0.9, rho=0.25)
    assert cfg.t_eff == pytest.approx(0.9 - 0.25 * 0.8)
    t = draws("chain_uniform", t_low=0.1, t_high=0.9, rho=0.25)
    assert (t[:, 0] == 0).all()
    member = t[:, 1:]
    assert (member >= 0.1).all() and (member <= cfg.t_eff).all()
    for blocks in group_slices(LAYOUT):
        assert (np.diff(t[:, blocks], axis=1) >= 0).all()


def test_chain_uniform_slot_means_match_closed_form():
    # l ~ U(a, b), t1 ~ U(l, b) => E[t1] = ((a+b)/2 + b)/2 = (a+3b)/4; t2 ~ U(t1, b) => E[t2] = (a+7b)/8.
    a, t_high, rho = 0.05, 0.95, 0.1
    b = t_high - rho * (t_high - a)
    t = draws("chain_uniform", t_low=a, t_high=t_high, rho=rho)
    first_slots = t[:, [1, 4, 5, 9]]
    second_slots = t[:, [2, 6, 10]]
    assert within_sigma(first_slots, (a + 3 * b) / 4)
    assert within_sigma(second_slots, (a + 7 * b) / 8)
    assert within_sigma(t[:, 3], (a + 15 * b) / 16)


def test_d2f_monotone_with_bounded_steps():
    lo, hi = 0.2, 0.7
    t = draws("d2f", t_low=lo, t_high=hi)
    for blocks in group_slices(LAYOUT):
        g = t[:, blocks]
        assert (g[:, 0] >= lo).all() and (g[:, 0] <= hi).all() and (g[:, -1] <= hi + 1e-12).all()
        steps = np.diff(g, axis=1)
        assert (steps >= 0).all()
        if blocks.size > 1:
            assert (steps <= (hi - g[:, :1]) / (blocks.size - 1) + 1e-12).all()
            # E[step | t1] = (hi - t1) / (2 (n-1)), E[t1] = (lo+hi)/2
            assert within_sigma(steps[:, 0], (hi - (lo + hi) / 2) / (2 * (blocks.size - 1)))
        assert within_sigma(g[:, 0], (lo + hi) / 2)


@pytest.mark.parametrize("gamma", [1.0, 2.0, 3.0])
def test_random_is_the_authors_power_law_chain(gamma):
    """Issue 13: the authors' random scheduler is an increasing chain from t_low with power-law steps
    t_i = c + (t_eff - c)(1 - (1 - u)^gamma): the room left, t_eff - t_i, shrinks by (1 - u)^gamma per slot,
    so E[t_eff - t_{j_i}] = (t_eff - t_low) / (gamma + 1)^i (independent draws). The old scheduler drew
    each block independently (no order, biased to t_low), which fails all three checks."""
    lo, hi, rho = 0.1, 0.9, 0.25
    b = hi - rho * (hi - lo)
    t = draws("random", t_low=lo, t_high=hi, rho=rho, gamma_rand=gamma)
    for blocks in group_slices(LAYOUT):
        g = t[:, blocks]
        assert (np.diff(g, axis=1) >= 0).all() and (g >= lo).all() and (g <= b + 1e-12).all()
    for slot, cols in enumerate(([1, 4, 5, 9], [2, 6, 10], [3, 7], [8]), start=1):
        assert within_sigma(b - t[:, cols], (b - lo) / (gamma + 1) ** slot)
    if gamma > 1:  # biased toward high noise: the first slot is already past the middle on average
        assert t[:, [1, 4, 5, 9]].mean() > (lo + b) / 2


@pytest.mark.parametrize("gamma", [0.5, 1.0, 3.0])
def test_random_iid_power_law_mean_and_no_order(gamma):
    lo, hi = 0.1, 0.8
    t = draws("random_iid", t_low=lo, t_high=hi, gamma_rand=gamma)[:, 1:]
    assert (t >= lo).all() and (t <= hi).all()
    assert within_sigma(t, lo + (hi - lo) / (gamma + 1))  # E[u^gamma] = 1/(gamma+1)
    assert (np.diff(t[:, :3], axis=1) < 0).any()  # not monotone inside a group


def test_sorted_uniform_is_order_statistics():
    lo, hi = 0.0, 1.0
    t = draws("sorted_uniform", t_low=lo, t_high=hi)
    for blocks in group_slices(LAYOUT):
        g = t[:, blocks]
        assert (np.diff(g, axis=1) >= 0).all()
        n = blocks.size
        for i in range(n):  # E[u_(i)] = (i+1)/(n+1) for U(0,1)
            assert within_sigma(g[:, i], (i + 1) / (n + 1))


@pytest.mark.parametrize("name", ["chain_uniform", "d2f", "random", "sorted_uniform"])
def test_interface_and_validation(name):
    sched = build_scheduler(SchedulerConfig(name=name))
    t = sched.sample(np.array([-1, -1, 0, 1, 1]), np.random.default_rng(0))
    assert t.shape == (5,) and (t[:2] == 0).all() and (t[2:] > 0).all()
    assert (sched.sample(np.array([-1, -1]), np.random.default_rng(0)) == 0).all()
    with pytest.raises(ValueError, match="block_group"):
        sched.sample(np.array([0, 2, 2]), np.random.default_rng(0))


def test_config_errors_name_the_field():
    with pytest.raises(ValidationError, match="t_low"):
        SchedulerConfig(t_low=0.9, t_high=0.1)
    with pytest.raises(ValidationError, match="rho"):
        SchedulerConfig(rho=1.5)
    with pytest.raises(ValidationError, match="name"):
        SchedulerConfig(name="cosine")


def test_mask_counts_floor_and_clamp():
    maskable = np.ones((4, 8), dtype=bool)
    maskable[0, :6] = False  # boundary block: 2 response positions
    ratio = np.array([0.9, 0.5, 0.124, 1.0])
    assert mask_counts(ratio, maskable, 8).tolist() == [2, 4, 0, 8]


def test_masked_positions_are_uniform_over_maskable():
    maskable = np.zeros((1, 16), dtype=bool)
    maskable[0, 5:] = True
    rng = np.random.default_rng(5)
    hits = np.zeros(16)
    for _ in range(4000):
        m = sample_masked(np.array([0.25]), maskable, 16, rng)[0]
        assert m.sum() == 4 and not m[:5].any()
        hits += m
    expected = 4000 * 4 / 11
    assert np.all(np.abs(hits[5:] - expected) < 5 * np.sqrt(expected))


def test_generator_keys():
    def draw(*key):
        return generator(*key).random(4)

    assert np.array_equal(draw(1, 2, 3, 4, Purpose.RATIOS), draw(1, 2, 3, 4, Purpose.RATIOS))
    variants = [(2, 2, 3, 4, Purpose.RATIOS), (1, 3, 3, 4, Purpose.RATIOS), (1, 2, 4, 4, Purpose.RATIOS),
                (1, 2, 3, 5, Purpose.RATIOS), (1, 2, 3, 4, Purpose.LAYOUT)]
    base = draw(1, 2, 3, 4, Purpose.RATIOS)
    assert all(not np.array_equal(base, draw(*v)) for v in variants)
    with pytest.raises(ValueError, match="epoch"):
        generator(0, 0, -1, 0, Purpose.LAYOUT)


def test_defaults_are_the_authors():
    """Issue 13: rho (the paper's unreported rho_cfg) is the authors' noise_transition_margin_ratio 0.01, and the
    random scheduler's gamma their noise_transition_gamma 2."""
    cfg = SchedulerConfig()
    assert (cfg.rho, cfg.gamma_rand) == (0.01, 2.0)
    assert cfg.t_eff == pytest.approx(1.0 - 0.01 * (1.0 - 0.001))


# ---------------------------------------------------------------- the authors' DMax slots and D2F ramp

DMAX_SLOTS = [(0.001, 0.2), (0.8, 1.0)]  # explicit_block{1,2}_noise_{min,max} of the authors' DMax OPUT configs


def authors_explicit_slots(layout: np.ndarray, ranges, rng: np.random.Generator) -> np.ndarray:
    """Reference: mbd-lms `multi_bd_sft_noise_transition` with explicit ranges, one uniform per block in order,
    slot i of each buffer drawn from ranges[i] (here with numpy uniforms in block order)."""
    out = np.zeros(layout.size)
    for blocks in group_slices(layout):
        for slot, k in enumerate(blocks):
            lo, hi = ranges[slot]
            out[k] = lo + (hi - lo) * rng.random()
    return out


def test_explicit_slots_equal_the_authors_per_slot_ranges():
    layout = np.array([-1, -1, 0, 0, 1, 1, 2])  # groups of 2, 2 and a clipped last group of 1
    sched = build_scheduler(SchedulerConfig(name="explicit_slots", slot_ranges=DMAX_SLOTS))
    for seed in range(20):
        got = sched.sample(layout, np.random.default_rng(seed))
        assert np.allclose(got, authors_explicit_slots(layout, DMAX_SLOTS, np.random.default_rng(seed)))
    t = draws("explicit_slots", layout=layout, n=4000, slot_ranges=DMAX_SLOTS)
    first, second = t[:, [2, 4, 6]], t[:, [3, 5]]
    assert (first >= 0.001).all() and (first <= 0.2).all() and (second >= 0.8).all() and (second <= 1.0).all()
    assert within_sigma(first, 0.1005) and within_sigma(second, 0.9)  # no t_eff margin: slot 2 reaches 1.0
    with pytest.raises(ValueError, match="slot_ranges gives 2"):
        sched.sample(np.array([0, 0, 0]), np.random.default_rng(0))


def test_explicit_slots_config_names_the_field():
    with pytest.raises(ValidationError, match="slot_ranges"):
        SchedulerConfig(name="explicit_slots")
    with pytest.raises(ValidationError, match="slot_ranges"):
        SchedulerConfig(slot_ranges=DMAX_SLOTS)  # ranges given to another scheduler
    with pytest.raises(ValidationError, match=r"slot_ranges\[1\]"):
        SchedulerConfig(name="explicit_slots", slot_ranges=[(0.1, 0.2), (0.9, 0.8)])
    from mbd.multitf.rows import LayoutSection

    with pytest.raises(ValidationError, match="gmax=3"):
        LayoutSection(gmax=3, scheduler=SchedulerConfig(name="explicit_slots", slot_ranges=DMAX_SLOTS))


def test_linear_ramp_is_the_authors_deterministic_ramp():
    """Reference: the authors' `buffer_internal_ramp: linear`, low + (t_eff - low) * linspace(0, 1, n), with
    t_eff = 1.0 - 0.01 * (1.0 - 0.001) = 0.99001 for their (0.001, 1.0, rho 0.01)."""
    sched = build_scheduler(SchedulerConfig(name="linear", t_low=0.001, t_high=1.0, rho=0.01))
    got = sched.sample(np.array([-1, 0, 0, 0, 0, 1, 1]), np.random.default_rng(0))
    step = (0.99001 - 0.001) / 3
    assert np.allclose(got, [0.0, 0.001, 0.001 + step, 0.001 + 2 * step, 0.99001, 0.001, 0.99001])
    single = draws("linear", layout=np.array([0]), n=2000)[:, 0]  # one block: t ~ U(t_low, t_eff)
    assert single.min() >= 0.001 and single.max() <= 0.99001 and within_sigma(single, (0.001 + 0.99001) / 2)
