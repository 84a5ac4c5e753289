"""Method rows (mbd.eval.report), paired comparisons and claim verdicts (mbd.eval.claims), on hand-built per-problem
records."""

import math

import numpy as np
import pytest

from mbd.eval.claims import (Curve, comparison_line, interval_verdict, judge_active, judge_aup, judge_main,
                             load_curve)
from mbd.eval.report import CellMetrics, Method, method_rows, method_table
from mbd.eval.stats import paired_difference
from mbd.eval.sweep import ItemRecord, ResultStore

N = 1000


def curve(label: str, correct_first: int | list[int], gen: int = 30, nfe: int = 20) -> Curve:
    """One point per entry: the first k problems right; every problem costs `gen` tokens in `nfe` forwards."""
    ks = [correct_first] if isinstance(correct_first, int) else correct_first
    c = np.array([[i < k for i in range(N)] for k in ks])
    return Curve(label, c, np.full(c.shape, gen), np.full(c.shape, nfe))


def test_interval_verdict_needs_the_whole_interval_on_one_side():
    assert interval_verdict(0.1, 2.0, 0.0) == "REPRODUCED"
    assert interval_verdict(-2.0, -0.1, 0.0) == "NOT REPRODUCED"
    assert interval_verdict(-0.1, 2.0, 0.0) == "INCONCLUSIVE"


def test_claim_a_is_non_inferiority_at_the_tpf_gain():
    single, free = curve("S", 850), curve("TF", 700, nfe=6)  # TPF 1.5 and 5.0
    ok = judge_main(single, free, [curve("MBD", 845, nfe=10)])  # TPF 3.0 = 2.0x; 5 problems lost
    # d = -0.5 pp, half-width 196 * sqrt((0.005 - 0.000025) / 1000) = 0.437 pp: the CI [-0.94, -0.06] is above -1
    assert [c.verdict for c in ok] == ["REPRODUCED", "REPRODUCED", "REPRODUCED"]
    assert "(2.00x)" in ok[0].evidence and "-0.50 pp [95% CI -0.94, -0.06]" in ok[0].evidence
    # 15 lost: -1.5 pp +- 0.75 straddles -1 pp; 50 lost: -5 pp +- 1.35 lies below it
    assert judge_main(single, free, [curve("MBD", 835, nfe=10)])[0].verdict == "INCONCLUSIVE"
    assert judge_main(single, free, [curve("MBD", 800, nfe=10)])[0].verdict == "NOT REPRODUCED"
    # accuracy kept, but 1.5 / 0.9 = 1.67x < 1.78x
    assert judge_main(single, free, [curve("MBD", 850, nfe=12)])[0].verdict == "NOT REPRODUCED"


def test_claims_b_and_c_from_the_paired_losses():
    single = curve("S", 850)
    b, c = judge_main(single, curve("TF", 700, nfe=6), [curve("MBD", 845, nfe=10)])[1:]
    assert (b.verdict, c.verdict) == ("REPRODUCED", "REPRODUCED")  # lost 15 pp; MBD wins back 14.5 > 7.5
    assert "lost 15.00 pp (half: 7.50)" in c.evidence
    # MBD wins back only 5 pp of 15: its CI (5 +- 1.35) lies below half the loss; 7 pp +- 1.58 straddles it
    assert judge_main(single, curve("TF", 700, nfe=6), [curve("MBD", 750, nfe=10)])[2].verdict == "NOT REPRODUCED"
    assert judge_main(single, curve("TF", 700, nfe=6), [curve("MBD", 770, nfe=10)])[2].verdict == "INCONCLUSIVE"
    # training-free MultiBD loses nothing: (b) fails and (c) has nothing to recover
    b, c = judge_main(single, curve("TF", 850, nfe=6), [curve("MBD", 850, nfe=10)])[1:]
    assert (b.verdict, c.verdict) == ("INCONCLUSIVE", "NOT REPRODUCED")
    assert [x.verdict for x in judge_main(None, None, None)] == ["NOT RUN"] * 3


def test_claims_d_e_bootstrap_the_aup_difference():
    # points (TPF 1.5, acc k0 / 10) and (TPF 3.0, acc k1 / 10): AUP = (a0 + a1) / 2 * 1.5
    best = Curve("best", np.array([[i < 900 for i in range(N)], [i < 800 for i in range(N)]]),
                 np.full((2, N), 30), np.array([np.full(N, 20), np.full(N, 10)]))
    assert best.aup() == pytest.approx((90.0 + 80.0) / 2 * 1.5)
    worse = Curve("worse", best.correct & (np.arange(N) < 700), best.generated, best.nfe)
    claim = judge_aup("d", [[best], [worse]], resamples=300)
    assert claim.verdict == "REPRODUCED" and "TPF 1.50-3.00" in claim.evidence
    assert judge_aup("d", [[worse], [best]], resamples=300).verdict == "NOT REPRODUCED"
    assert judge_aup("e", [[best], [best], [worse]], resamples=300).verdict == "INCONCLUSIVE"  # a tie is no win
    assert judge_aup("e", None).verdict == "NOT RUN"
    assert judge_aup("e", [[curve("one point", 900)], [curve("x", 800)]]).verdict == "NOT RUN"
    assert judge_aup("e", [[best], []]).verdict == "NOT RUN"  # a variant without a single trained seed


def test_claim_a_over_seeds_is_not_decided_by_one_run():
    single, free = curve("S", 850), curve("TF", 700, nfe=6)
    agree = judge_main(single, free, [curve("MBD", 845, nfe=10)] * 3)[0]
    assert agree.verdict == "REPRODUCED" and "(2.00x)" in agree.evidence and "over 3 seeds" in agree.evidence
    assert "Welch-Satterthwaite" in agree.test
    # two runs at parity and one 5 pp down: pooled over the 3 x 1,000 (seed, problem) pairs the mean -1.67 pp has a
    # half-width of 0.45 pp (NOT REPRODUCED), but over seeds the spread (SD 2.89) gives t(2) = 4.30 and +-7.2 pp
    runs = [curve("MBD", 850, nfe=10), curve("MBD", 850, nfe=10), curve("MBD", 800, nfe=10)]
    a = judge_main(single, free, runs)[0]
    assert a.verdict == "INCONCLUSIVE" and "-1.67 pp [95% CI -8." in a.evidence
    pooled = paired_difference(np.tile(single.correct[0], 3), np.concatenate([r.correct[0] for r in runs]))
    assert pooled.diff_pp == pytest.approx(-5 / 3) and pooled.ci_high_pp < -1.0
    assert [judge_main(single, free, [r])[0].verdict for r in runs] == ["REPRODUCED", "REPRODUCED", "NOT REPRODUCED"]
    # every seed below the margin by far: the seeds agree, so it is decided
    assert judge_main(single, free, [curve("MBD", 790, nfe=10)] * 3)[0].verdict == "NOT REPRODUCED"


def test_claims_d_e_over_seeds_pair_runs_by_seed():
    best = Curve("best", np.array([[i < 900 for i in range(N)], [i < 800 for i in range(N)]]),
                 np.full((2, N), 30), np.array([np.full(N, 20), np.full(N, 10)]))
    worse = Curve("worse", best.correct & (np.arange(N) < 700), best.generated, best.nfe)
    assert judge_aup("d", [[best] * 3, [worse] * 3], resamples=300).verdict == "REPRODUCED"
    # the first variant wins in two seeds and loses in one: the mean gain is positive, the interval is not
    mixed = judge_aup("d", [[best, worse, best], [worse, best, worse]], resamples=300)
    assert mixed.verdict == "INCONCLUSIVE" and "over 3 seeds" in mixed.evidence
    with pytest.raises(ValueError, match="pairs runs by seed"):
        judge_aup("d", [[best] * 3, [worse] * 2], resamples=50)


def _trace(counts: list[int]) -> list[dict]:
    return [{"states": ["ACTIVE"] * k + ["EMPTY"] * (4 - k)} for k in counts]


def test_claim_f_mean_band_and_share_of_three_plus():
    f = judge_active([_trace([1, 2, 2, 3])] * 10, resamples=200)
    assert f.verdict == "REPRODUCED"  # mean exactly 2.0 in every resample; 25% of forwards hold 3
    assert "mean 2.00 [95% CI 2.00, 2.00] over 40 forwards of 10 requests" in f.evidence
    assert judge_active([_trace([1, 1, 1, 1])] * 10, resamples=200).verdict == "NOT REPRODUCED"
    assert judge_active([_trace([2, 2])] * 10, resamples=200).verdict == "NOT REPRODUCED"  # never 3 or more
    assert judge_active(None).verdict == "NOT RUN"


def test_load_curve_aligns_points_on_the_problem_ids(tmp_path):
    store = ResultStore(tmp_path)
    for config, right in (("p0", {"b"}), ("p1", {"a", "b"})):
        for pid, nfe in (("b", 4), ("a", 2)):  # stored out of order
            store.append(ItemRecord(model="m", config=config, benchmark="tinymath", problem_id=pid, completion="",
                                    correct=pid in right, nfe=nfe, num_generated=8, tpf=8 / nfe, wall_time_s=0.1,
                                    step_latency_ms=1.0, finish_reason="eos"))
    c = load_curve(store, Method(label="M", model="m", configs=["p0", "p1"]), "tinymath", ["a", "b"])
    assert c.correct.tolist() == [[False, True], [True, True]]
    assert (c.accuracy(0), c.accuracy(1), c.tpf(0)) == (50.0, 100.0, 16 / 6)
    with pytest.raises(RuntimeError, match="1 problems not stored"):
        load_curve(store, Method(label="M", model="m", configs=["p0"]), "tinymath", ["a", "c"])


def test_comparison_line_and_method_rows():
    line = comparison_line(curve("SingleBD", 850), curve("MBD", 845, nfe=10))
    assert line.startswith("MBD vs SingleBD: accuracy -0.50 pp [95% CI -0.94, -0.06], exact McNemar p=0.0625")
    assert line.endswith("CI width 0.87 pp; TPF 1.50 -> 3.00 (2.00x)")  # p: 2 / 2^5 (5 discordant, all one way)
    cells = [CellMetrics(model="m", config=c, benchmark="tinymath", n=100, accuracy=a, tpf=t, tps=50.0,
                         step_latency_ms=1.0) for c, a, t in (("p0", 80.0, 3.0), ("p1", 70.0, 4.0), ("p2", 90.0, 2.0))]
    (row,) = method_rows(cells, [Method(label="M", model="m", configs=["p0", "p1", "p2"])], "tinymath")
    assert (row.accuracy, row.tpf, row.config) == (80.0, 3.0, "p0")
    assert row.aup == pytest.approx((90 + 80) / 2 * 1.0 + (80 + 70) / 2 * 1.0)
    table = method_table([row], "tiny", "tinymath")
    assert "| M | 80.00 | 3.00 | 160.00 |" in table and "tinymath Acc" in table and "TPS" not in table  # untimed
    with pytest.raises(RuntimeError, match="p3"):
        method_rows(cells, [Method(label="M", model="m", configs=["p0", "p3"])], "tinymath")
    assert math.isfinite(row.tps)
