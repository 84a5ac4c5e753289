"""Calibration of a decoder's top-1 confidence: of the tokens predicted at confidence c, is a fraction c right?

Why: the MultiBD rules commit by confidence (M2T: confidence > tau_m2t; the fallbacks: the most confident masked
position when none passes). A threshold rule is only as good as that agreement, so whether a state's wrong tokens
are confident (miscalibration) or unconfident (the model does not know there) decides what training should fix.

- `wilson`: the 95% Wilson score interval of a proportion (sound at 0 or n successes, where Wald's collapses).
- `reliability`: the reliability curve over equal-width confidence bins, each bin's accuracy with its Wilson
  interval, and the expected calibration error ECE = sum_b n_b / N |acc_b - conf_b| (Guo et al. 2017, "On
  Calibration of Modern Neural Networks"), the gap between confidence and accuracy weighted by how many
  predictions fall in each bin.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel

from mbd.eval.stats import Z95


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval (as proportions) of k successes in n > 0 trials."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n and n > 0, got k={k}, n={n}")
    p, d = k / n, 1 + z * z / n
    mid, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, mid - half), min(1.0, mid + half)


class ReliabilityBin(BaseModel):
    low: float  # the bin holds confidences in [low, high); the last bin also holds 1.0
    high: float
    n: int
    confidence: float  # mean confidence in the bin
    accuracy: float
    ci_low: float  # Wilson 95% interval of the accuracy
    ci_high: float


class Reliability(BaseModel):
    n: int
    confidence: float  # mean confidence over all predictions
    accuracy: float
    ece: float
    bins: list[ReliabilityBin]  # the non-empty bins, in confidence order


def reliability(confidence: Sequence[float] | np.ndarray, correct: Sequence[bool] | np.ndarray,
                bins: int = 10) -> Reliability:
    """Reliability curve and ECE of predictions with top-1 `confidence` in [0, 1] and whether each was `correct`,
    over `bins` equal-width bins ([i / bins, (i + 1) / bins), the last closed)."""
    conf = np.asarray(confidence, dtype=np.float64)
    ok = np.asarray(correct, dtype=bool)
    if conf.shape != ok.shape or conf.ndim != 1 or conf.size == 0:
        raise ValueError(f"need equal, non-empty 1-D confidences and outcomes, got {conf.shape} and {ok.shape}")
    if conf.min() < 0 or conf.max() > 1:
        raise ValueError("confidences must lie in [0, 1]")
    index = np.minimum((conf * bins).astype(np.int64), bins - 1)
    out, ece = [], 0.0
    for b in range(bins):
        sel = index == b
        n = int(sel.sum())
        if n == 0:
            continue
        c, k = float(conf[sel].mean()), int(ok[sel].sum())
        ece += n * abs(k / n - c)
        lo, hi = wilson(k, n)
        out.append(ReliabilityBin(low=b / bins, high=(b + 1) / bins, n=n, confidence=c, accuracy=k / n,
                                  ci_low=lo, ci_high=hi))
    return Reliability(n=conf.size, confidence=float(conf.mean()), accuracy=float(ok.mean()), ece=ece / conf.size,
                       bins=out)
