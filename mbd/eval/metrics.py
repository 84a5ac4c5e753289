"""Evaluation metrics: accuracy, TPF, TPS, mean step latency, and AUP.

Accuracy is reported in percent (0-100), as in the paper's tables and as AUP expects.

TPF (tokens per forward) = generated tokens / NFE, both summed over the problems of a benchmark
(a ratio of sums, so long generations weigh in proportion to their length).

AUP (experiments section, after d3LLM): sort the decoding configurations by TPF and take the
trapezoidal area under the accuracy-TPF curve,
    AUP = sum_{i=1}^{|C|-1} (A_i + A_{i+1}) / 2 * (P_{i+1} - P_i).
A single configuration therefore has AUP 0. For several benchmarks the paper averages the
per-benchmark AUPs (`mean_aup`).

`aup_d3llm` is d3LLM's weighted variant, as in its reference implementation
(d3LLM `aup_utils.get_aup`): points whose accuracy is below y_1 - y_min_offset are dropped (y_1 is
the accuracy at the lowest TPF), the curve starts with the rectangle P_1 * y_1, and every
trapezoid uses weighted accuracies W(y) * y with W(y) = min(exp(-alpha * (1 - y / y_max)), 1).
y_max defaults to the best accuracy among the points (d3LLM passes the best accuracy across all
compared methods). d3LLM additionally asserts that the last point lies within y_min_offset of the
first; here such points are filtered instead, which is what its filter step implies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, Field


class GenerationRecord(BaseModel):
    """What decoding one problem cost, and whether the answer was right."""

    correct: bool
    generated_tokens: int = Field(ge=0)
    nfe: int = Field(ge=0, description="forward passes (network function evaluations)")
    wall_s: float = Field(ge=0.0, description="decoding wall time of this problem")


class BenchmarkMetrics(BaseModel):
    n: int
    accuracy: float = Field(description="percent of problems answered correctly")
    tpf: float = Field(description="generated tokens / forward passes, summed over problems")
    tps: float = Field(description="generated tokens / decoding seconds, summed over problems")
    mean_step_latency_s: float = Field(description="decoding seconds / forward passes, summed over problems")


class AupPoint(BaseModel):
    tpf: float = Field(gt=0.0)
    accuracy: float = Field(ge=0.0, le=100.0, description="percent")


def summarize(records: Sequence[GenerationRecord]) -> BenchmarkMetrics:
    if not records:
        raise ValueError("records is empty: nothing to summarize")
    tokens = sum(r.generated_tokens for r in records)
    nfe = sum(r.nfe for r in records)
    wall = sum(r.wall_s for r in records)
    return BenchmarkMetrics(
        n=len(records),
        accuracy=100.0 * sum(r.correct for r in records) / len(records),
        tpf=tokens / nfe if nfe else 0.0,
        tps=tokens / wall if wall else 0.0,
        mean_step_latency_s=wall / nfe if nfe else 0.0,
    )


def aup(points: Sequence[AupPoint]) -> float:
    """The paper's AUP: trapezoids under the TPF-sorted (TPF, accuracy) curve."""
    if not points:
        raise ValueError("points is empty: AUP needs at least one decoding configuration")
    pts = sorted(points, key=lambda p: p.tpf)
    return sum((a.accuracy + b.accuracy) / 2 * (b.tpf - a.tpf) for a, b in zip(pts, pts[1:]))


def aup_d3llm(points: Sequence[AupPoint], y_max: float | None = None, alpha: float = 3.0,
              y_min_offset: float = 5.0) -> float:
    """d3LLM's quality-weighted AUP (see the module docstring for the exact rules)."""
    if not points:
        raise ValueError("points is empty: AUP needs at least one decoding configuration")
    pts = sorted(points, key=lambda p: p.tpf)
    y_max = max(p.accuracy for p in pts) if y_max is None else y_max
    if y_max <= 0:
        raise ValueError(f"y_max must be > 0, got {y_max}")
    floor = pts[0].accuracy - y_min_offset
    pts = [p for p in pts if p.accuracy >= floor]

    def weighted(y: float) -> float:
        return min(math.exp(-alpha * (1.0 - y / y_max)), 1.0) * y

    total = pts[0].tpf * pts[0].accuracy
    return total + sum((weighted(a.accuracy) + weighted(b.accuracy)) / 2 * (b.tpf - a.tpf)
                       for a, b in zip(pts, pts[1:]))


def mean_aup(per_benchmark: Mapping[str, Sequence[AupPoint]]) -> float:
    """The multi-benchmark AUP of the paper: the mean of the per-benchmark AUPs."""
    if not per_benchmark:
        raise ValueError("per_benchmark is empty")
    return sum(aup(p) for p in per_benchmark.values()) / len(per_benchmark)
