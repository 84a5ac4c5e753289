"""Metrics against hand-computed values."""

import math

import pytest
from pydantic import ValidationError

from mbd.eval.metrics import AupPoint, GenerationRecord, aup, aup_d3llm, mean_aup, summarize


def test_summarize_uses_ratios_of_sums():
    records = [GenerationRecord(correct=True, generated_tokens=100, nfe=20, wall_s=2.0),
               GenerationRecord(correct=False, generated_tokens=50, nfe=30, wall_s=1.0)]
    m = summarize(records)
    assert m.n == 2 and m.accuracy == 50.0
    assert m.tpf == 150 / 50  # not the mean of 5.0 and 1.67
    assert m.tps == 150 / 3.0 and m.mean_step_latency_s == 3.0 / 50
    with pytest.raises(ValueError, match="empty"):
        summarize([])


def test_aup_is_the_trapezoid_over_tpf_sorted_points():
    pts = [AupPoint(tpf=4, accuracy=70), AupPoint(tpf=2, accuracy=80), AupPoint(tpf=3, accuracy=75)]
    # sorted: (2, 80) (3, 75) (4, 70) -> (80 + 75)/2 * 1 + (75 + 70)/2 * 1
    assert aup(pts) == pytest.approx(77.5 + 72.5)
    assert aup([AupPoint(tpf=5, accuracy=90)]) == 0.0  # one configuration spans no area
    with pytest.raises(ValueError, match="at least one"):
        aup([])


def test_aup_d3llm_weights_drops_and_starts_with_a_rectangle():
    pts = [AupPoint(tpf=1, accuracy=80), AupPoint(tpf=2, accuracy=78), AupPoint(tpf=3, accuracy=70)]
    # y_1 = 80, so 70 < 80 - 5 is dropped; y_max = 80; W(78) = exp(-3 * (1 - 78/80)) = exp(-0.075)
    expected = 1 * 80 + 0.5 * (2 - 1) * (80 * 1.0 + 78 * math.exp(-0.075))
    assert aup_d3llm(pts) == pytest.approx(expected)
    # a larger y_max penalises every point, including the best one
    y_max = 90
    w = [math.exp(-3 * (1 - y / y_max)) for y in (80, 78)]
    assert aup_d3llm(pts, y_max=y_max) == pytest.approx(80 + 0.5 * (80 * w[0] + 78 * w[1]))


def test_mean_aup_averages_benchmarks():
    per = {"a": [AupPoint(tpf=1, accuracy=50), AupPoint(tpf=3, accuracy=50)],
           "b": [AupPoint(tpf=1, accuracy=100), AupPoint(tpf=2, accuracy=80)]}
    assert mean_aup(per) == pytest.approx((100 + 90) / 2)


def test_accuracy_is_validated_as_percent():
    with pytest.raises(ValidationError):
        AupPoint(tpf=2, accuracy=120)
    with pytest.raises(ValidationError):
        AupPoint(tpf=0, accuracy=50)
