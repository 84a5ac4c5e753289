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
- `seed_interval`: a statistic measured once per training seed (each seed a fresh training run of the same
  recipe, judged on the same problems): the mean over seeds with a Student-t interval whose variance adds the
  seed-to-seed spread (s^2 / S, the part a single run cannot see: the tiny recipe's runs spread over 4 pp) and
  the sampling variance of the problems every seed shares (se_problems^2), at Welch-Satterthwaite's degrees of
  freedom: about S - 1 when the seeds disagree (t = 4.30 for 3 seeds, so one lucky or unlucky run cannot decide
  a claim), up to n - 1 when they agree (the interval of one run over the problems).
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


def t_quantile_975(df: int) -> float:
    """Student t's 97.5% quantile for `df` >= 1 degrees of freedom (bisection on the exact CDF of integer df,
    Abramowitz & Stegun 26.7.3-4: P(|T| <= t) is a finite trigonometric sum in theta = atan(t / sqrt(df)))."""
    if df < 1:
        raise ValueError(f"df={df} must be >= 1")

    def central(t: float) -> float:  # P(|T| <= t)
        theta = math.atan(t / math.sqrt(df))
        c2, term = math.cos(theta) ** 2, 1.0
        if df % 2 == 0:
            total = 1.0
            for k in range(1, df // 2):
                term *= c2 * (2 * k - 1) / (2 * k)
                total += term
            return math.sin(theta) * total
        total = 0.0 if df == 1 else 1.0
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        return (2 / math.pi) * (theta + math.sin(theta) * math.cos(theta) * total)

    lo, hi = 0.0, 1000.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if central(mid) < 0.95 else (lo, mid)
    return (lo + hi) / 2


class SeedInterval(BaseModel):
    per_seed: list[float]
    mean: float
    sd_seeds: float  # sample SD of the per-seed values
    se_problems: float  # standard error of the seed mean from the shared problems alone
    ci_low: float
    ci_high: float
    df: int  # Welch-Satterthwaite degrees of freedom, rounded down (at most MAX_DF)

    def text(self, unit: str = "") -> str:
        seeds = ", ".join(f"{v:+.2f}" for v in self.per_seed)
        return (f"{self.mean:+.2f}{unit} [95% CI {self.ci_low:+.2f}, {self.ci_high:+.2f}] over {len(self.per_seed)} "
                f"seeds ({seeds}; seed SD {self.sd_seeds:.2f}, problem SE {self.se_problems:.2f}, df {self.df})")


MAX_DF = 1000  # t(0.975, 1000) = 1.962: more degrees of freedom change nothing that a verdict could see


def seed_interval(per_seed: Sequence[float], se_problems: float, n_problems: int) -> SeedInterval:
    """Mean of one statistic per training seed, 95% CI mean +- t(0.975, df) sqrt(s^2 / S + se_problems^2), df from
    Welch-Satterthwaite: (a + b)^2 / (a^2 / (S - 1) + b^2 / (n - 1)) with a = s^2 / S, b = se_problems^2."""
    s = len(per_seed)
    if s < 2 or n_problems < 2:
        raise ValueError(f"a seed-level interval needs >= 2 seeds and problems, got {s} and {n_problems}")
    values = np.asarray(per_seed, dtype=np.float64)
    sd = float(values.std(ddof=1))
    a, b = sd * sd / s, se_problems * se_problems
    denom = a * a / (s - 1) + b * b / (n_problems - 1)
    df = MAX_DF if denom == 0 else min(MAX_DF, max(1, math.floor((a + b) ** 2 / denom)))
    half = t_quantile_975(df) * math.sqrt(a + b)
    mean = float(values.mean())
    return SeedInterval(per_seed=values.tolist(), mean=mean, sd_seeds=sd, se_problems=se_problems,
                        ci_low=mean - half, ci_high=mean + half, df=df)


def seed_paired_difference(a: Sequence[bool], bs: Sequence[Sequence[bool]]) -> SeedInterval:
    """Acc(B_s) - Acc(A) in pp over seeds: B_s is seed s's model, A one reference (the base under SingleBD) on the
    same problems. The problems' share of the variance is the paired SE of the seed-averaged difference."""
    ref = np.asarray(a, dtype=np.float64)
    runs = np.asarray(bs, dtype=np.float64)
    if runs.ndim != 2 or runs.shape[1] != ref.size or ref.size < 2:
        raise ValueError(f"need [seeds, n] outcomes against n >= 2 reference outcomes, got {runs.shape}, {ref.shape}")
    per_problem = runs.mean(axis=0) - ref
    se = 100 * float(per_problem.std(ddof=1)) / math.sqrt(ref.size)
    return seed_interval((100 * (runs.mean(axis=1) - ref.mean())).tolist(), se, ref.size)


class Bootstrap(BaseModel):
    n: int
    resamples: int
    value: float  # the statistic on the full sample
    ci_low: float
    ci_high: float
    se: float  # standard deviation of the statistic over the resamples
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
                     se=float(values.std(ddof=1)) if resamples > 1 else 0.0, share_positive=float(np.mean(values > 0)))
