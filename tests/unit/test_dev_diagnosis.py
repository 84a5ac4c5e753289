"""The dev-split tools' arithmetic: the first wrong character of a tinymath answer (either operand order of a
commutative step is right) and the seed count a registration needs for a +-1 pp interval."""

from benchmarks.multibd_diagnosis import first_wrong, valid_solutions
from benchmarks.tiny_dev_ab import POINTS, point, seeds_for_halfwidth
from mbd.decoding.policy import passes

FIELDS = {"a": 3, "b": 4, "c": 2, "d": 7, "op_mid": "+", "op_last": "-", "e": 5}  # 3*4+2*7-5 = 21


def test_first_wrong_accepts_either_operand_order_and_flags_an_early_end():
    valid = valid_solutions(FIELDS)
    assert len(valid) == 8  # three commutative steps (two products and the +), each in two orders
    assert first_wrong("4*3=12;2*7=14;14+12=26;26-5=21;#### 21", valid) is None
    assert first_wrong("3*4=12;7*2=14;12+14=26;26-5=21;#### 21", valid) is None
    assert first_wrong("3*4=13;", valid) == 5  # the 3 of 13
    assert first_wrong("3*4=12;2*7=14", valid) == 13  # the end of text where ';' was due
    assert first_wrong("3*4=12;2*7=14;12+14=26;26-5=21;#### 219", valid) == 38  # the 9 after the answer


def test_seed_count_for_a_one_point_interval_grows_with_the_seed_spread():
    assert seeds_for_halfwidth(0.0, 0.25) == 4  # df = S - 1 (conservative): t(3) * 0.25 < 1
    assert seeds_for_halfwidth(0.5, 0.25) == 5 and seeds_for_halfwidth(1.0, 0.25) == 9
    assert seeds_for_halfwidth(5.0, 0.25, most=10) is None


def test_the_former_greater_or_equal_thresholds_are_a_strict_point_at_block_4():
    ge = point("multibd_ge")
    assert (ge.tau_add, ge.tau_semi) == (0.49, 0.49) and ge.block_size == 4
    # the fewest of B = 4 tokens that activate the next block / make the predecessor semi-complete, per point
    fewest = {k: tuple(min(n for n in range(5) if passes(n / 4, tau)) for tau in (p.tau_add, p.tau_semi))
              for k, p in ((k, point(k)) for k in POINTS if k.startswith("multibd"))}
    assert fewest == {"multibd_ge": (2, 2), "multibd_strict_05": (3, 3), "multibd_paper_b4": (1, 2),
                      "multibd_add2_semi3": (2, 3)}
