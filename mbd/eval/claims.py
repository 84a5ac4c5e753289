"""The paper's claims judged on per-problem records: paired comparisons of methods over the same problems, and
each claim's verdict from a stated test (`mbd quickstart` prints the comparisons, `mbd reproduce` the claims).

A 95% interval wholly on the claim's side of its threshold is REPRODUCED, wholly on the other side NOT
REPRODUCED, straddling it INCONCLUSIVE (the data cannot tell at this n); a claim without data is NOT RUN.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np
from pydantic import BaseModel, Field

from mbd.eval.metrics import AupPoint, aup
from mbd.eval.report import Method, active_counts, markdown_table
from mbd.eval.stats import bootstrap, paired_difference, seed_interval, seed_paired_difference
from mbd.eval.sweep import ResultStore


class Curve:
    """Per-problem outcomes of one method's curve points on the same problems (row p = point p, column i =
    problem i; point 0 is the operating point). What paired tests and bootstrap AUPs resample."""

    def __init__(self, label: str, correct: np.ndarray, generated: np.ndarray, nfe: np.ndarray):
        if not correct.shape == generated.shape == nfe.shape or correct.ndim != 2 or correct.shape[1] == 0:
            raise ValueError(f"{label}: need equal (points, problems) arrays, got {correct.shape}, "
                             f"{generated.shape}, {nfe.shape}")
        self.label, self.correct, self.generated, self.nfe = label, correct.astype(bool), generated, nfe

    @property
    def n(self) -> int:
        return self.correct.shape[1]

    def accuracy(self, point: int = 0, idx: np.ndarray | None = None) -> float:
        c = self.correct[point] if idx is None else self.correct[point, idx]
        return 100.0 * float(c.mean())

    def tpf(self, point: int = 0, idx: np.ndarray | None = None) -> float:
        g, f = (self.generated[point], self.nfe[point]) if idx is None else \
            (self.generated[point, idx], self.nfe[point, idx])
        return float(g.sum() / f.sum()) if f.sum() else 0.0

    def aup(self, idx: np.ndarray | None = None) -> float:
        return aup([AupPoint(tpf=self.tpf(p, idx), accuracy=self.accuracy(p, idx))
                    for p in range(self.correct.shape[0])])

    def tpf_range(self) -> tuple[float, float]:
        t = [self.tpf(p) for p in range(self.correct.shape[0])]
        return min(t), max(t)


def load_curve(store: ResultStore, method: Method, benchmark: str, problem_ids: Sequence[str]) -> Curve:
    """The stored records of `method`'s points on `problem_ids`, in that order (fails naming a missing one)."""
    arrays: list[list[tuple[bool, int, int]]] = []
    for config in method.configs:
        stored = store.load(method.model, config, benchmark)
        missing = [i for i in problem_ids if i not in stored]
        if missing:
            raise RuntimeError(f"{method.model} / {config} / {benchmark}: {len(missing)} problems not stored, "
                               f"e.g. {missing[0]}")
        arrays.append([(stored[i].correct, stored[i].num_generated, stored[i].nfe) for i in problem_ids])
    a = np.array(arrays, dtype=np.int64)
    return Curve(method.label, a[..., 0], a[..., 1], a[..., 2])


def comparison_line(base: Curve, other: Curve) -> str:
    """`other` vs `base` at their operating points: paired accuracy difference with its 95% CI (and the CI's
    width, which says how small a difference this n can see) and the TPF ratio."""
    d = paired_difference(base.correct[0], other.correct[0])
    return (f"{other.label} vs {base.label}: accuracy {d.text()}, CI width {d.ci_high_pp - d.ci_low_pp:.2f} pp; "
            f"TPF {base.tpf():.2f} -> {other.tpf():.2f} ({other.tpf() / base.tpf():.2f}x)")


Verdict = Literal["REPRODUCED", "NOT REPRODUCED", "INCONCLUSIVE", "NOT RUN"]
TPF_GAIN = 1.78  # tab:tps_comparison: MBD's TPF over SingleBD at equal accuracy
ACC_MARGIN_PP = 1.0  # "equal accuracy": at most this far below SingleBD (non-inferiority margin)
SEED_TEST = ("over seeds (each a fresh training run, all on the same problems): mean of the per-seed values, "
             "95% CI mean +- t(0.975, df) sqrt(seed variance / S + problem SE^2), Welch-Satterthwaite df")


class Claim(BaseModel):
    id: str
    text: str
    test: str = Field(description="the statistical test and decision rule behind the verdict")
    verdict: Verdict
    evidence: str


def interval_verdict(low: float, high: float, threshold: float) -> Verdict:
    """The claim 'value > threshold' judged by a 95% interval: all above -> REPRODUCED, all below -> NOT
    REPRODUCED, straddling -> INCONCLUSIVE (the data cannot tell at this n)."""
    return "REPRODUCED" if low > threshold else "NOT REPRODUCED" if high < threshold else "INCONCLUSIVE"


def _worst(verdicts: Sequence[Verdict]) -> Verdict:
    order: list[Verdict] = ["NOT REPRODUCED", "INCONCLUSIVE", "REPRODUCED"]
    return min(verdicts, key=order.index)


CLAIM_TEXT = {
    "a": f"MBD reaches >= {TPF_GAIN}x SingleBD's TPF at accuracy >= SingleBD - {ACC_MARGIN_PP:g} pp",
    "b": "training-free MultiBD raises TPF but loses accuracy",
    "c": "MultiTF recovers it: MBD wins back >= half of the accuracy training-free MultiBD lost",
    "d": "chain-uniform has the best AUP among the noise-schedulers",
    "e": "systematic + random group-layouts beat each alone in AUP",
    "f": "active blocks per forward: mean about 2 (1.5-2.5), 3 or more occasionally (0 < share <= 50%)",
}


def _not_run(cid: str, why: str) -> Claim:
    return Claim(id=cid, text=CLAIM_TEXT[cid], test="–", verdict="NOT RUN", evidence=why)


class Gain(NamedTuple):
    """Acc(runs) - Acc(ref) at the operating points: its 95% interval, the evidence and the test that gave it."""

    low: float
    high: float
    text: str
    test: str


def accuracy_gain(ref: Curve, runs: Sequence[Curve]) -> Gain:
    """One run: the paired Wald interval over the problems. Several training seeds of one recipe: the seed-level
    interval (`stats.seed_paired_difference`), which a single lucky or unlucky run cannot push outside."""
    if len(runs) == 1:
        d = paired_difference(ref.correct[0], runs[0].correct[0])
        return Gain(d.ci_low_pp, d.ci_high_pp, d.text(), "95% paired (Wald) CI over problems")
    s = seed_paired_difference(ref.correct[0], [r.correct[0] for r in runs])
    return Gain(s.ci_low, s.ci_high, s.text(" pp"), SEED_TEST)


def judge_a(single: Curve, mbd: Sequence[Curve]) -> Claim:
    """Claim (a): non-inferiority at the TPF gain (the TPF ratio averaged over seeds)."""
    ratios = [m.tpf() / single.tpf() for m in mbd]
    ratio = sum(ratios) / len(ratios)
    g = accuracy_gain(single, mbd)
    verdict = interval_verdict(g.low, g.high, -ACC_MARGIN_PP) if ratio >= TPF_GAIN else "NOT REPRODUCED"
    tpf = ", ".join(f"{m.tpf():.2f}" for m in mbd)
    return Claim(id="a", text=CLAIM_TEXT["a"], verdict=verdict,
                 test=f"TPF ratio >= {TPF_GAIN} and non-inferiority, Acc(MBD) - Acc(SingleBD) above "
                      f"-{ACC_MARGIN_PP:g} pp: {g.test}",
                 evidence=f"n={single.n}; TPF {single.tpf():.2f} -> {tpf} ({ratio:.2f}x); Acc {g.text}")


def judge_main(single: Curve | None, free: Curve | None, mbd: Sequence[Curve] | None) -> list[Claim]:
    """Claims (a)-(c) at the operating points, paired over the same problems; `mbd`: one curve per training seed
    (None: not every seed the claims registered is stored, so (a) and (c) are NOT RUN while (b), which needs only
    the base, is judged)."""
    if not (single and free):
        return [_not_run(c, "no stored results") for c in "abc"]
    out = [judge_a(single, mbd) if mbd else _not_run("a", "not every registered seed is stored")]
    lost = paired_difference(free.correct[0], single.correct[0])  # SingleBD - training-free
    v = interval_verdict(lost.ci_low_pp, lost.ci_high_pp, 0.0)
    out.append(Claim(id="b", text=CLAIM_TEXT["b"], verdict=v if free.tpf() > single.tpf() else "NOT REPRODUCED",
                     test="TPF(MultiBD) > TPF(SingleBD) and the 95% paired CI of Acc(SingleBD) - Acc(MultiBD) "
                          "above 0 (exact McNemar p beside it)",
                     evidence=f"TPF {single.tpf():.2f} -> {free.tpf():.2f}; accuracy lost {lost.text()}"))
    if not mbd:
        return [*out, _not_run("c", "not every registered seed is stored")]
    won = accuracy_gain(free, mbd)  # MBD - training-free
    half = 0.5 * lost.diff_pp
    test = f"Acc(MBD) - Acc(MultiBD training-free) above half the point loss of (b): {won.test}"
    if lost.diff_pp <= 0:
        out.append(Claim(id="c", text=CLAIM_TEXT["c"], test=test, verdict="NOT REPRODUCED",
                         evidence=f"nothing to recover: training-free MultiBD lost {lost.diff_pp:+.2f} pp"))
    else:
        out.append(Claim(id="c", text=CLAIM_TEXT["c"], test=test, verdict=interval_verdict(won.low, won.high, half),
                         evidence=f"lost {lost.diff_pp:.2f} pp (half: {half:.2f}); MBD recovers {won.text}"))
    return out


def aup_gain(first: Sequence[Curve], other: Sequence[Curve], resamples: int, seed: int) -> tuple[Gain, float]:
    """AUP(first) - AUP(other) with its interval, and the rival's mean AUP: one seed each, the paired bootstrap
    over problems; several (paired by seed index), the seed-level interval with the bootstrap's SE of the
    seed-averaged difference as the problems' share."""
    rival = sum(o.aup() for o in other) / len(other)
    if len(first) == 1:
        b = bootstrap(lambda idx: first[0].aup(idx) - other[0].aup(idx), first[0].n, resamples, seed)
        return Gain(b.ci_low, b.ci_high, b.text(), "95% paired-bootstrap CI over problems"), rival
    if len(first) != len(other):
        raise ValueError(f"AUP over seeds pairs runs by seed: {len(first)} vs {len(other)} seeds")
    pairs = list(zip(first, other))
    b = bootstrap(lambda idx: float(np.mean([f.aup(idx) - o.aup(idx) for f, o in pairs])), first[0].n,
                  resamples, seed)
    s = seed_interval([f.aup() - o.aup() for f, o in pairs], b.se, first[0].n)
    return Gain(s.ci_low, s.ci_high, s.text(), SEED_TEST + " (problem SE: paired bootstrap)"), rival


def judge_aup(cid: str, variants: Sequence[Sequence[Curve]] | None, resamples: int = 2000, seed: int = 0) -> Claim:
    """Claims (d)/(e): the first variant's AUP beats every other's; `variants`: each one's curves, one per training
    seed (the same seeds for every variant)."""
    if not variants or len(variants) < 2 or not all(variants) or \
            any(c.correct.shape[0] < 2 for v in variants for c in v):
        return _not_run(cid, "its variants (with >= 2 curve points each) were not run")
    first, verdicts, parts, test = variants[0], [], [], ""
    for other in variants[1:]:
        g, rival = aup_gain(first, other, resamples, seed)
        verdicts.append(interval_verdict(g.low, g.high, 0.0))
        lo, hi = other[0].tpf_range()
        parts.append(f"vs {other[0].label} (AUP {rival:.2f}, TPF {lo:.2f}-{hi:.2f}): {g.text}")
        test = g.test
    lo, hi = first[0].tpf_range()
    mean = sum(c.aup() for c in first) / len(first)
    return Claim(id=cid, text=CLAIM_TEXT[cid], verdict=_worst(verdicts),
                 test=f"for each rival, AUP(first) - AUP(rival) above 0: {test}",
                 evidence=f"{first[0].label} AUP {mean:.2f} over TPF {lo:.2f}-{hi:.2f}; " + "; ".join(parts))


def active_block_stats(traces: Sequence[Sequence[dict]]) -> dict:
    """Active (ACTIVE-slot) blocks per forward over every traced request."""
    counts = [k for t in traces for k in active_counts(t)]
    n = len(counts)
    hist = {k: counts.count(k) / n for k in sorted(set(counts))}
    return {"requests": len(traces), "forwards": n, "mean": sum(counts) / n if n else float("nan"), "share": hist,
            "share_3plus": sum(v for k, v in hist.items() if k >= 3)}


def judge_active(traces: Sequence[Sequence[dict]] | None, resamples: int = 2000, seed: int = 0) -> Claim:
    """Claim (f): bootstrap over requests of the mean active blocks per forward (forwards pooled)."""
    traces = [t for t in (traces or []) if t]
    if not traces:
        return _not_run("f", "no traces of the MBD model")
    per = [active_counts(t) for t in traces]
    sums, lens = np.array([sum(c) for c in per], float), np.array([len(c) for c in per], float)
    b = bootstrap(lambda idx: float(sums[idx].sum() / lens[idx].sum()), len(per), resamples, seed)
    stats = active_block_stats(traces)
    band = [interval_verdict(b.ci_low, b.ci_high, 1.5), interval_verdict(-b.ci_high, -b.ci_low, -2.5)]
    share_ok: Verdict = "REPRODUCED" if 0 < stats["share_3plus"] <= 0.5 else "NOT REPRODUCED"
    return Claim(id="f", text=CLAIM_TEXT["f"], verdict=_worst(band + [share_ok]),
                 test="95% bootstrap CI (over requests) of the mean inside [1.5, 2.5]; share of >= 3 in (0, 50%]",
                 evidence=f"mean {stats['mean']:.2f} [95% CI {b.ci_low:.2f}, {b.ci_high:.2f}] over "
                          f"{stats['forwards']} forwards of {stats['requests']} requests; share by count "
                          + ", ".join(f"{k}: {v:.1%}" for k, v in stats["share"].items()))


def claims_table(claims: Sequence[Claim]) -> str:
    return markdown_table(["Claim", "Verdict", "Test", "Evidence"],
                  [[f"({c.id}) {c.text}", f"**{c.verdict}**", c.test, c.evidence] for c in claims])
