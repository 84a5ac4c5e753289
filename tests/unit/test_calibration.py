"""Reliability curve, ECE and Wilson interval against references worked out by hand."""

import pytest

from mbd.eval.calibration import reliability, wilson


def test_wilson_against_hand_computed_intervals():
    # 5 of 10: centre 0.5, half-width 1.96 sqrt(0.025 + 1.96^2 / 400) / (1 + 1.96^2 / 10) = 0.2634
    assert wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    # 0 of 10: the lower end stays at 0 and the upper end is z^2 / (n + z^2) = 0.2775, not Wald's 0
    lo, hi = wilson(0, 10)
    assert lo == pytest.approx(0.0, abs=1e-12) and hi == pytest.approx(0.2775, abs=1e-4)
    with pytest.raises(ValueError):
        wilson(3, 0)


def test_reliability_bins_and_ece_by_hand():
    conf = [0.05, 0.15, 0.95, 0.95, 0.55, 1.0, 0.1]
    correct = [False, True, True, False, True, True, True]
    r = reliability(conf, correct)
    # bins: [0, .1): .05 wrong; [.1, .2): .15 and .1 right (0.1 opens bin 1); [.5, .6): .55 right;
    # [.9, 1.]: .95 right, .95 wrong, 1.0 right (the last bin is closed)
    assert [(b.low, b.n) for b in r.bins] == [(0.0, 1), (0.1, 2), (0.5, 1), (0.9, 3)]
    assert [b.accuracy for b in r.bins] == pytest.approx([0.0, 1.0, 1.0, 2 / 3])
    assert [b.confidence for b in r.bins] == pytest.approx([0.05, 0.125, 0.55, 2.9 / 3])
    # ECE = (1 * .05 + 2 * .875 + 1 * .45 + 3 * |2/3 - 2.9/3|) / 7 = (0.05 + 1.75 + 0.45 + 0.9) / 7
    assert r.ece == pytest.approx(3.15 / 7)
    assert (r.n, r.accuracy) == (7, pytest.approx(5 / 7))


def test_a_calibrated_sample_has_no_error_and_bad_input_is_refused():
    r = reliability([0.25] * 4 + [0.75] * 4, [True, False, False, False, True, True, True, False])
    assert r.ece == pytest.approx(0.0)
    with pytest.raises(ValueError):
        reliability([], [])
    with pytest.raises(ValueError):
        reliability([1.2], [True])
    with pytest.raises(ValueError):
        reliability([0.5, 0.5], [True])
