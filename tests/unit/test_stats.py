"""Paired statistics against references worked out by hand."""

import math

import numpy as np
import pytest

from mbd.eval.stats import bootstrap, mcnemar_exact, paired_difference


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
    assert (same.value, same.ci_low, same.ci_high, same.share_positive) == (0.0, 0.0, 0.0, 0.0)
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
