"""Side-by-side TPS: the interleaved call order, the per-round TPS samples and their median / spread, and the
method table printing TPS only when every row was timed side by side."""

import pytest

from mbd.eval.report import MethodRow, method_table
from mbd.eval.timing import TpsStat, interleaved_order, interleaved_tps


def test_order_rotates_the_first_method_every_round():
    assert interleaved_order(["A", "B", "C"], 4) == list("ABC" "BCA" "CAB" "ABC")
    assert interleaved_order(["A"], 2) == ["A", "A"]


def test_medians_and_spread_from_a_fake_decoder():
    calls: list[str] = []
    # (tokens, seconds) per call of each method: A's rounds run at 10, 30, 20 tok/s; B's at 5, 5, 50.
    plan = {"A": [(10, 1.0), (60, 2.0), (40, 2.0)], "B": [(5, 1.0), (10, 2.0), (100, 2.0)]}

    def fake(name):
        def run():
            calls.append(name)
            return plan[name][sum(c == name for c in calls) - 1]
        return run

    stats = interleaved_tps({"A": fake("A"), "B": fake("B")}, rounds=3)
    assert calls == ["A", "B", "B", "A", "A", "B"]
    assert stats["A"] == TpsStat(median=20.0, low=10.0, high=30.0, per_round=[10.0, 30.0, 20.0])
    assert stats["B"] == TpsStat(median=5.0, low=5.0, high=50.0, per_round=[5.0, 5.0, 50.0])
    assert interleaved_tps({"Z": lambda: (0, 0.0)}, 1)["Z"].median == 0.0
    with pytest.raises(ValueError, match="rounds=0"):
        interleaved_tps({"A": fake("A")}, 0)


def row(method: str, timed: dict[int, TpsStat]) -> MethodRow:
    return MethodRow(method=method, model="m", config="c", n=10, accuracy=80.0, tpf=2.0, tps=99.0, aup=5.0,
                     curve=[(2.0, 80.0)], tps_timed=timed)


def test_method_table_prints_tps_per_batch_only_when_every_row_was_timed_side_by_side():
    t, u = TpsStat.of([40.0, 42.5, 41.0]), TpsStat.of([90.0, 95.0])
    timed = method_table([row("A", {8: u, 1: t}), row("B", {1: t, 8: u})], "tiny", "tinymath")
    assert "| TPS ↑ at batch 1 (median, min-max) | TPS ↑ at batch 8 (median, min-max) |" in timed
    assert "| A | 80.00 | 2.00 | 41.0 (40.0-42.5) | 92.5 (90.0-95.0) | 5.00 |" in timed
    for other in ({}, {1: t}):  # a row not timed, or not at every batch: no TPS column at all
        mixed = method_table([row("A", {1: t, 8: u}), row("B", other)], "tiny", "tinymath")
        assert "TPS" not in mixed and "99.0" not in mixed and "| B | 80.00 | 2.00 | 5.00 |" in mixed
