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


def row(method: str, timed: TpsStat | None) -> MethodRow:
    return MethodRow(method=method, model="m", config="c", n=10, accuracy=80.0, tpf=2.0, tps=99.0, aup=5.0,
                     curve=[(2.0, 80.0)], tps_timed=timed)


def test_method_table_prints_tps_only_when_every_row_was_timed_side_by_side():
    t = TpsStat.of([40.0, 42.5, 41.0])
    timed = method_table([row("A", t), row("B", t)], "tiny", "tinymath")
    assert "TPS ↑ (median, min-max)" in timed and "| A | 80.00 | 2.00 | 41.0 (40.0-42.5) | 5.00 |" in timed
    mixed = method_table([row("A", t), row("B", None)], "tiny", "tinymath")
    assert "TPS" not in mixed and "99.0" not in mixed and "| B | 80.00 | 2.00 | 5.00 |" in mixed
