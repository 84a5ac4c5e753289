"""The sweep's reservation plan (no Ray cluster needed): what is asked for, what shrinks, and the refusal text."""

import pytest

from mbd.eval.sweep import SweepConfig
from pipelines.sweep_pool import PlacementError, fits, plan_shape

ONE_CPU = {"CPU": 1.0, "memory": 1e9}


def cfg(**kw) -> SweepConfig:
    base = dict(output_dir="/tmp/x", models=[{"name": "m", "path": "mbd/assets/tiny"}],
                decoding=[{"name": "s", "config": "configs/decode/tiny_singlebd.yaml"}],
                benchmarks=[{"name": "tinymath", "limit": 4}], engine={"device": "cpu"}, cpus_per_worker=1, cpus_per_scorer=0.5)
    return SweepConfig(**(base | kw))


def test_fits_packs_per_node_not_in_total():
    assert fits([{"CPU": 1}] * 2 + [{"CPU": 0.5}] * 2, [ONE_CPU] * 3)
    assert not fits([{"CPU": 1}] * 3 + [{"CPU": 0.5}], [ONE_CPU] * 3)  # 3.5 CPU on 3 x 1
    assert not fits([{"CPU": 1.5}], [ONE_CPU] * 3)  # 3 CPU in all, but no node holds 1.5
    assert not fits([{"CPU": 1, "GPU": 1}], [ONE_CPU])


def test_default_scoring_slots_take_what_decoders_leave():
    shape = plan_shape(cfg(), "cpu", 2, 2, [ONE_CPU] * 3, shrink=False)
    assert (shape.decoders, shape.scorers) == (2, 2)
    shape = plan_shape(cfg(), "cpu", 2, 5, [ONE_CPU] * 3, shrink=False)  # more free CPU was reported than fits
    assert (shape.decoders, shape.scorers) == (2, 2)


def test_too_many_decoders_are_refused_naming_the_shortfall():
    with pytest.raises(PlacementError) as e:
        plan_shape(cfg(workers=3), "cpu", 3, 1, [ONE_CPU] * 3, shrink=False)
    assert str(e.value).startswith("the sweep needs 3 decoder(s) x {CPU: 1} + 1 scoring slot(s) x {CPU: 0.5} "
                                   "(3.5 CPU in all) but the cluster's 3 node(s) can never hold that (nodes: "
                                   "{CPU: 1}, {CPU: 1}, {CPU: 1})")


def test_explicit_scorers_are_kept_or_refused_but_shrink_after_a_loss():
    with pytest.raises(PlacementError, match=r"2 decoder\(s\) .* \+ 3 scoring slot\(s\)"):
        plan_shape(cfg(scorers=3), "cpu", 2, 3, [ONE_CPU] * 3, shrink=False)
    shape = plan_shape(cfg(scorers=3), "cpu", 2, 3, [ONE_CPU] * 2, shrink=True)
    assert (shape.decoders, shape.scorers) == (1, 2)
    with pytest.raises(PlacementError, match=r"1 decoder\(s\) x \{CPU: 1\} \+ 1 scoring slot"):
        plan_shape(cfg(), "cpu", 2, 2, [{"CPU": 0.5}], shrink=True)


def test_gpu_decoders_reserve_a_gpu_each():
    shape = plan_shape(cfg(), "cuda", 2, 1, [{"CPU": 8, "GPU": 2}], shrink=False)
    assert shape.bundles() == [{"CPU": 1, "GPU": 1.0}] * 2 + [{"CPU": 0.5}]
