"""The suite's xdist scheduling (tests/conftest.py): every test on the session's Ray cluster in one work unit (one
worker, one cluster, collection order); each unit module, and each Ray module off the session's cluster (clusters
of its own, or no Ray), a work unit of its own; the Ray unit handed out first, then the long ones. xdist's
`loadgroup` marks were tried first and silently did nothing under pytest 9: this checks the scopes the scheduler
actually uses."""

from pathlib import Path

import pytest

from tests.conftest import (LONG_UNITS, OFF_SESSION_CLUSTER, check_work_units, collection_order,
                            pytest_collection_modifyitems, work_unit)

ROOT = Path(__file__).resolve().parents[2]

IDS = {
    "tests/e2e/test_quickstart.py::test_table_has_the_four_methods_with_finite_numbers": "ray",
    "tests/integration/test_serve_app.py::test_killed_replica_is_replaced": "ray",
    "tests/integration/test_train_multitf.py::test_zero_run_matches_single_process_and_exports[3-llada2_moe]": "ray",
    "tests/integration/test_multinode_train.py::test_training_on_two_nodes_survives_losing_one":
        "tests/integration/test_multinode_train.py",
    "tests/integration/test_serve_units.py::test_engine_process_ends_with_its_replica":
        "tests/integration/test_serve_units.py",
    "tests/unit/test_plan.py::test_weights_equal_the_allocated_model[sdar-dtype0-1]": "tests/unit/test_plan.py",
    "tests/unit/test_plan.py::test_weights_equal_the_allocated_model[sdar-dtype1-1]": "tests/unit/test_plan.py",
    "tests/unit/test_model.py::TestX::test_y[a::b]": "tests/unit/test_model.py",
    "tests/unit/test_integration_names.py::test_e2e": "tests/unit/test_integration_names.py",
}


def test_ray_tests_are_one_work_unit_and_each_unit_module_its_own():
    assert {nodeid: work_unit(nodeid) for nodeid in IDS} == IDS


def test_units_are_handed_out_ray_first_then_the_long_ones_longest_first():
    ids = ["tests/unit/test_plan.py::test_a", "tests/integration/test_serve_sigterm.py::test_b",
           "tests/integration/test_serve_app.py::test_c", "tests/integration/test_multinode_train.py::test_d",
           "tests/e2e/test_quickstart.py::test_e"]
    assert sorted(ids, key=collection_order) == [ids[2], ids[4], ids[3], ids[1], ids[0]]


class Item:
    def __init__(self, nodeid, fixturenames):
        self.nodeid, self.fixturenames = nodeid, fixturenames


def test_a_module_with_its_own_clusters_never_asks_for_the_session_cluster():
    """The collection guard: a test outside the "ray" work unit that asks for the session's cluster is refused."""
    module = sorted(OFF_SESSION_CLUSTER)[0]
    pytest_collection_modifyitems(None, [Item(f"{module}::test_x", ["multinode", "tmp_path"]),
                                         Item("tests/integration/test_serve_app.py::test_y", ["serve_url"])])
    with pytest.raises(pytest.UsageError, match="ray_cluster"):
        pytest_collection_modifyitems(None, [Item(f"{module}::test_x", ["multinode", "ray_cluster"])])


def test_a_module_in_the_ray_unit_that_never_uses_the_session_cluster_is_refused():
    """The other direction, on a whole collection (the modules on disk): a module on the session cluster's worker
    whose tests never use that cluster only lengthens the suite's longest work unit; a partial collection (a few
    modules run by hand) is not judged."""
    modules = sorted(p.relative_to(ROOT).as_posix() for d in ("e2e", "integration")
                     for p in (ROOT / "tests" / d).glob("test_*.py"))
    idle = next(m for m in modules if work_unit(m) == "ray")

    def collection(idle_module=None):
        return [Item(f"{m}::test_x", ["tmp_path"] if m in OFF_SESSION_CLUSTER or m == idle_module else ["ray_cluster"])
                for m in modules]

    check_work_units(collection())
    with pytest.raises(pytest.UsageError, match=idle):
        check_work_units(collection(idle))
    other = next(m for m in modules if m != idle)
    check_work_units([i for i in collection(idle) if not i.nodeid.startswith(other)])
    assert OFF_SESSION_CLUSTER <= set(modules) and all((ROOT / m).is_file() for m in LONG_UNITS)


def test_the_guard_judges_the_slow_tests_too(pytestconfig):
    """The guard runs before pytest deselects `-m 'not slow'`: its hook is `tryfirst`, pytest's deselecting hooks
    (its mark and main plugins) are not, so it sees the whole collection."""
    impls = {i.plugin_name: i for i in pytestconfig.pluginmanager.hook.pytest_collection_modifyitems.get_hookimpls()}
    ours = impls[str(ROOT / "tests" / "conftest.py")]
    assert ours.tryfirst
    assert not impls["mark"].tryfirst and not impls["main"].tryfirst
