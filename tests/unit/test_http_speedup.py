"""`benchmarks.http_speedup` compares decode points, not models: both apps serve the same weights with the same
engine, and differ only in the decode point their `decode.base` names; a ratio is the median of per-round ratios."""

from benchmarks.http_speedup import POINTS, parse_args, point_configs, ratio
from mbd.config import load_decode


def test_both_points_serve_the_same_weights_and_engine_at_their_own_decode_point():
    cfgs = point_configs(parse_args([]))
    single, multi = cfgs["SingleBD"], cfgs["MultiBD"]
    assert single.model == multi.model and single.model.path == "mbd/assets/mbd-tiny"
    assert single.engine == multi.engine and single.limits == multi.limits
    for name, cfg in cfgs.items():
        point = load_decode(POINTS[name])[0]
        assert (cfg.decode.buffer_size, cfg.decode.tau_add, cfg.decode.tau_semi, cfg.decode.tau_m2t) == \
            (point.buffer_size, point.tau_add, point.tau_semi, point.tau_m2t)
    assert (single.decode.buffer_size, multi.decode.buffer_size) == (1, 4)


def test_a_ratio_is_the_median_of_the_rounds_ratios_with_their_range():
    runs = {"SingleBD": [{"r": 10.0}, {"r": 20.0}, {"r": 10.0}], "MultiBD": [{"r": 15.0}, {"r": 20.0}, {"r": 20.0}]}
    assert ratio({"runs": runs}, "r") == "1.50x (1.00-2.00)"
