"""Paired statistics against references worked out by hand."""

import math

import numpy as np
import pytest

from mbd.eval.stats import (bootstrap, mcnemar_exact, paired_difference, seed_interval, seed_paired_difference,
                            t_quantile_975)


def test_mcnemar_exact_against_binomial_tails():
    assert mcnemar_exact(1, 4) == pytest.approx(2 * (1 + 5) / 32)  # 2 * P(X <= 1), X ~ Bin(5, 1/2) = 0.375
    assert mcnemar_exact(4, 1) == mcnemar_exact(1, 4)
    assert mcnemar_exact(0, 10) == pytest.approx(2 / 1024)
    assert mcnemar_exact(3, 3) == 1.0  # the two tails overlap: capped at 1
    assert mcnemar_exact(0, 0) == 1.0


def test_paired_difference_counts_interval_and_test():
    # 100 problems: 70 both right, 10 only A, 5 only B, 15 both wrong
    a = [True] * 70 + [True] * 10 + [False] * 5 + [False] * 15
    b = [True] * 70 + [False] * 10 + [True] * 5 + [False] * 15
    d = paired_difference(a, b)
    assert (d.n, d.only_a, d.only_b) == (100, 10, 5)
    assert (d.acc_a, d.acc_b, d.diff_pp) == (pytest.approx(80.0), pytest.approx(75.0), pytest.approx(-5.0))
    # Var(d) = ((b + c)/n - d^2) / n = (0.15 - 0.0025) / 100; half-width 1.96 * 100 * sqrt(0.001475) = 7.527 pp
    assert d.ci_low_pp == pytest.approx(-12.5274, abs=1e-3)
    assert d.ci_high_pp == pytest.approx(2.5274, abs=1e-3)
    # two-sided exact: 2 * sum_{i<=5} C(15, i) / 2^15 = 2 * 4944 / 32768
    assert d.p_mcnemar == pytest.approx(2 * 4944 / 32768)
    assert math.isclose(sum(math.comb(15, i) for i in range(6)), 4944)


def test_paired_difference_identical_and_bad_input():
    d = paired_difference([True, False, True], [True, False, True])
    assert (d.diff_pp, d.ci_low_pp, d.ci_high_pp, d.p_mcnemar) == (0.0, 0.0, 0.0, 1.0)
    with pytest.raises(ValueError):
        paired_difference([True], [True, False])
    with pytest.raises(ValueError):
        paired_difference([], [])


def test_bootstrap_is_paired_and_seeded():
    x = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    same = bootstrap(lambda i: float(x[i].mean() - x[i].mean()), len(x), resamples=200)
    assert (same.value, same.ci_low, same.ci_high, same.se, same.share_positive) == (0.0, 0.0, 0.0, 0.0, 0.0)
    # paired: a constant shift of one side has no spread at all
    shifted = bootstrap(lambda i: float(x[i].mean() + 0.5 - x[i].mean()), len(x), resamples=200)
    assert (shifted.value, shifted.ci_low, shifted.ci_high, shifted.share_positive) == (0.5, 0.5, 0.5, 1.0)
    y = 1.0 - x
    r1 = bootstrap(lambda i: float(y[i].mean() - x[i].mean()), len(x), seed=3)
    assert r1 == bootstrap(lambda i: float(y[i].mean() - x[i].mean()), len(x), seed=3)
    assert r1.value == pytest.approx(3 / 8 - 5 / 8)
    assert r1.ci_low <= r1.value <= r1.ci_high
    with pytest.raises(ValueError):
        bootstrap(lambda i: 0.0, 0)


def test_t_quantile_against_the_table():
    """Student t's 97.5% points from a printed table (e.g. Abramowitz & Stegun, Table 26.10)."""
    table = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 10: 2.2281, 30: 2.0423, 120: 1.9799}
    for df, want in table.items():
        assert t_quantile_975(df) == pytest.approx(want, abs=1e-4), df
    with pytest.raises(ValueError):
        t_quantile_975(0)


N = 1000


def firsts(k: int) -> np.ndarray:
    return np.arange(N) < k


def test_seed_paired_difference_when_the_seeds_disagree():
    """Reference 850/1000; seeds solve the first 845, 855 and 830: -0.5, +0.5, -2.0 pp."""
    s = seed_paired_difference(firsts(850), [firsts(845), firsts(855), firsts(830)])
    assert s.per_seed == pytest.approx([-0.5, 0.5, -2.0]) and s.mean == pytest.approx(-2 / 3)
    # seed variance: squared deviations (1/6)^2 + (7/6)^2 + (4/3)^2 = 19/6 over 2 degrees of freedom
    assert s.sd_seeds == pytest.approx(math.sqrt(19 / 12))
    # per problem mean_s(B_s) - A: 15 x -1/3 (830..844), 5 x -2/3 (845..849), 5 x +1/3 (850..854), 975 x 0;
    # sum of squares 40/9, minus n * mean^2 = 1000 * (1/150)^2, over n - 1; SE in pp = 100 * sqrt(var / n)
    var = (40 / 9 - N * (1 / 150) ** 2) / (N - 1)
    assert s.se_problems == pytest.approx(100 * math.sqrt(var / N))
    # Welch-Satterthwaite: a = s^2/3 = 19/36, b = SE^2; (a + b)^2 / (a^2 / 2 + b^2 / 999) = 2.35 -> 2 -> t = 4.3027
    a, b = 19 / 36, s.se_problems ** 2
    assert s.df == 2 == math.floor((a + b) ** 2 / (a * a / 2 + b * b / (N - 1)))
    half = 4.3027 * math.sqrt(a + b)
    assert (s.ci_low, s.ci_high) == (pytest.approx(-2 / 3 - half, abs=1e-3), pytest.approx(-2 / 3 + half, abs=1e-3))
    assert s.ci_low < -3.9 and s.ci_high > 2.5  # one seed 2 pp down: the three cannot decide a 1 pp margin


def test_seed_interval_of_agreeing_seeds_is_the_one_run_interval():
    """Three identical runs: no seed variance, so the interval is the paired one over the problems (df n - 1)."""
    s = seed_paired_difference(firsts(850), [firsts(845)] * 3)
    one = paired_difference(firsts(850), firsts(845))
    assert s.sd_seeds == 0.0 and s.df == 999
    # paired SE with n - 1 in the variance vs Wald's n: equal to 3 decimals at n = 1,000
    assert (s.ci_low, s.ci_high) == (pytest.approx(one.ci_low_pp, abs=2e-3), pytest.approx(one.ci_high_pp, abs=2e-3))


def test_seed_interval_bad_input():
    with pytest.raises(ValueError, match="2 seeds"):
        seed_interval([1.0], 0.1, 100)
    with pytest.raises(ValueError, match="reference"):
        seed_paired_difference(firsts(10), [firsts(10)[:5]])
