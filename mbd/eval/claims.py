"""The paper's claims judged on per-problem records: paired comparisons of methods over the same problems, and
each claim's verdict from a stated test (`mbd quickstart` prints the comparisons, `mbd reproduce` the claims).

A 95% interval wholly on the claim's side of its threshold is REPRODUCED, wholly on the other side NOT
REPRODUCED, straddling it INCONCLUSIVE (the data cannot tell at this n); a claim without data is NOT RUN.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

from mbd.eval.metrics import AupPoint, aup
from mbd.eval.report import Method, active_counts, markdown_table
from mbd.eval.stats import bootstrap, paired_difference
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
    """`other` vs `base` at their operating points: paired accuracy difference with its 95% CI and TPF ratio."""
    d = paired_difference(base.correct[0], other.correct[0])
    return (f"{other.label} vs {base.label}: accuracy {d.text()}; TPF {base.tpf():.2f} -> {other.tpf():.2f} "
            f"({other.tpf() / base.tpf():.2f}x)")


Verdict = Literal["REPRODUCED", "NOT REPRODUCED", "INCONCLUSIVE", "NOT RUN"]
TPF_GAIN = 1.78  # tab:tps_comparison: MBD's TPF over SingleBD at equal accuracy
ACC_MARGIN_PP = 1.0  # "equal accuracy": at most this far below SingleBD (non-inferiority margin)


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


def judge_main(single: Curve | None, free: Curve | None, mbd: Curve | None) -> list[Claim]:
    """Claims (a)-(c) at the operating points, paired over the same problems."""
    if not (single and free and mbd):
        return [_not_run(c, "no stored results") for c in "abc"]
    out = []
    d = paired_difference(single.correct[0], mbd.correct[0])
    ratio = mbd.tpf() / single.tpf()
    v = interval_verdict(d.ci_low_pp, d.ci_high_pp, -ACC_MARGIN_PP)
    out.append(Claim(id="a", text=CLAIM_TEXT["a"], verdict=v if ratio >= TPF_GAIN else "NOT REPRODUCED",
                     test=f"TPF ratio >= {TPF_GAIN} and non-inferiority: 95% paired (Wald) CI of Acc(MBD) - "
                          f"Acc(SingleBD) above -{ACC_MARGIN_PP:g} pp",
                     evidence=f"TPF {single.tpf():.2f} -> {mbd.tpf():.2f} ({ratio:.2f}x); Acc {d.text()}"))
    lost = paired_difference(free.correct[0], single.correct[0])  # SingleBD - training-free
    v = interval_verdict(lost.ci_low_pp, lost.ci_high_pp, 0.0)
    out.append(Claim(id="b", text=CLAIM_TEXT["b"], verdict=v if free.tpf() > single.tpf() else "NOT REPRODUCED",
                     test="TPF(MultiBD) > TPF(SingleBD) and the 95% paired CI of Acc(SingleBD) - Acc(MultiBD) "
                          "above 0 (exact McNemar p beside it)",
                     evidence=f"TPF {single.tpf():.2f} -> {free.tpf():.2f}; accuracy lost {lost.text()}"))
    won = paired_difference(free.correct[0], mbd.correct[0])  # MBD - training-free
    half = 0.5 * lost.diff_pp
    test = "95% paired CI of Acc(MBD) - Acc(MultiBD training-free) above half the point loss of (b)"
    if lost.diff_pp <= 0:
        out.append(Claim(id="c", text=CLAIM_TEXT["c"], test=test, verdict="NOT REPRODUCED",
                         evidence=f"nothing to recover: training-free MultiBD lost {lost.diff_pp:+.2f} pp"))
    else:
        out.append(Claim(id="c", text=CLAIM_TEXT["c"], test=test,
                         verdict=interval_verdict(won.ci_low_pp, won.ci_high_pp, half),
                         evidence=f"lost {lost.diff_pp:.2f} pp (half: {half:.2f}); MBD recovers {won.text()}"))
    return out


def judge_aup(cid: str, curves: Sequence[Curve] | None, resamples: int = 2000, seed: int = 0) -> Claim:
    """Claims (d)/(e): the first curve's AUP beats every other's; paired bootstrap over problems of each AUP
    difference (every curve's points re-scored on the same resampled problems)."""
    if not curves or len(curves) < 2 or any(c.correct.shape[0] < 2 for c in curves):
        return _not_run(cid, "its variants (with >= 2 curve points each) were not run")
    first, verdicts, parts = curves[0], [], []
    for other in curves[1:]:
        b = bootstrap(lambda idx: first.aup(idx) - other.aup(idx), first.n, resamples, seed)
        verdicts.append(interval_verdict(b.ci_low, b.ci_high, 0.0))
        lo, hi = other.tpf_range()
        parts.append(f"vs {other.label} (AUP {other.aup():.2f}, TPF {lo:.2f}-{hi:.2f}): {b.text()}")
    lo, hi = first.tpf_range()
    return Claim(id=cid, text=CLAIM_TEXT[cid], verdict=_worst(verdicts),
                 test="for each rival: 95% paired-bootstrap CI of AUP(first) - AUP(rival) above 0",
                 evidence=f"{first.label} AUP {first.aup():.2f} over TPF {lo:.2f}-{hi:.2f}; " + "; ".join(parts))


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
