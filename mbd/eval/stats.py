"""Paired statistics for comparing two decoders (or models) on the SAME problems.

Why paired: both methods answer the same problems, so most of the sampling noise is shared; only the
discordant problems (right under one, wrong under the other) carry information about the difference. An
unpaired comparison of two accuracies at n=1,000 has a 95% interval about twice as wide.

- `paired_difference`: accuracy difference (B - A, percentage points) with a 95% Wald interval from the
  paired variance (Agresti, Categorical Data Analysis, sec. 10.1) and the exact McNemar test (a two-sided
  binomial test of the discordant counts against 1/2).
- `bootstrap`: an interval for any statistic of per-problem records (the AUP difference of two curves, a
  mean), by resampling problem indices with a seeded generator (both sides of a difference see the same
  indices, so it stays paired).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from pydantic import BaseModel

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


class PairedDifference(BaseModel):
    n: int
    acc_a: float
    acc_b: float
    diff_pp: float
    ci_low_pp: float
    ci_high_pp: float
    only_a: int  # problems A solved and B did not
    only_b: int
    p_mcnemar: float

    def text(self) -> str:
        return (f"{self.diff_pp:+.2f} pp [95% CI {self.ci_low_pp:+.2f}, {self.ci_high_pp:+.2f}], exact McNemar "
                f"p={self.p_mcnemar:.3g} ({self.only_b} vs {self.only_a} discordant, n={self.n})")


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: P(|X - m/2| >= |b - m/2|) for X ~ Binomial(m = b + c, 1/2)."""
    m = b + c
    if m == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(m, i) for i in range(k + 1)) / 2**m
    return min(1.0, 2 * tail)


def paired_difference(a: Sequence[bool], b: Sequence[bool]) -> PairedDifference:
    """B - A over the same problems (index i of both is the same problem)."""
    if len(a) != len(b) or len(a) == 0:
        raise ValueError(f"paired samples need the same non-zero length, got {len(a)} and {len(b)}")
    n = len(a)
    only_a = sum(1 for x, y in zip(a, b) if x and not y)
    only_b = sum(1 for x, y in zip(a, b) if y and not x)
    d = (only_b - only_a) / n
    se = math.sqrt(max((only_a + only_b) / n - d * d, 0.0) / n)
    return PairedDifference(n=n, acc_a=100 * sum(map(bool, a)) / n, acc_b=100 * sum(map(bool, b)) / n,
                            diff_pp=100 * d, ci_low_pp=100 * (d - Z95 * se), ci_high_pp=100 * (d + Z95 * se),
                            only_a=only_a, only_b=only_b, p_mcnemar=mcnemar_exact(only_a, only_b))


class Bootstrap(BaseModel):
    n: int
    resamples: int
    value: float  # the statistic on the full sample
    ci_low: float
    ci_high: float
    share_positive: float  # resamples in which the statistic is > 0

    def text(self, unit: str = "") -> str:
        return (f"{self.value:+.3f}{unit} [95% CI {self.ci_low:+.3f}, {self.ci_high:+.3f}], paired bootstrap "
                f"({self.resamples} resamples of n={self.n})")


def bootstrap(stat: Callable[[np.ndarray], float], n: int, resamples: int = 2000, seed: int = 0) -> Bootstrap:
    """Percentile 95% interval of `stat` over resampled problem indices (`stat(idx)` evaluates the statistic on
    the problems `idx`; for a paired difference let it compute both sides on the same `idx`)."""
    if n <= 0 or resamples <= 0:
        raise ValueError(f"need n > 0 and resamples > 0, got n={n}, resamples={resamples}")
    rng = np.random.default_rng(seed)
    values = np.array([stat(rng.integers(0, n, size=n)) for _ in range(resamples)])
    lo, hi = np.percentile(values, [2.5, 97.5])
    return Bootstrap(n=n, resamples=resamples, value=float(stat(np.arange(n))), ci_low=float(lo), ci_high=float(hi),
                     share_positive=float(np.mean(values > 0)))
