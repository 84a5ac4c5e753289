"""The suite's xdist scheduling (tests/conftest.py): every test on the session's Ray cluster in one work unit (one
worker, one cluster, collection order); each unit module, and each Ray module whose tests start clusters of their
own, a work unit of its own. xdist's `loadgroup` marks were tried first and silently did nothing under pytest 9:
this checks the scopes the scheduler actually uses."""

import pytest

from tests.conftest import work_unit

IDS = {
    "tests/e2e/test_quickstart.py::test_table_has_the_four_methods_with_finite_numbers": "ray",
    "tests/integration/test_serve_app.py::test_killed_replica_is_replaced": "ray",
    "tests/integration/test_train_multitf.py::test_zero_run_matches_single_process_and_exports[3]": "ray",
    "tests/integration/test_multinode_train.py::test_training_on_two_nodes_survives_losing_one":
        "tests/integration/test_multinode_train.py",
    "tests/unit/test_plan.py::test_weights_equal_the_allocated_model[sdar-dtype0-1]": "tests/unit/test_plan.py",
    "tests/unit/test_plan.py::test_weights_equal_the_allocated_model[sdar-dtype1-1]": "tests/unit/test_plan.py",
    "tests/unit/test_model.py::TestX::test_y[a::b]": "tests/unit/test_model.py",
    "tests/unit/test_integration_names.py::test_e2e": "tests/unit/test_integration_names.py",
}


def test_ray_tests_are_one_work_unit_and_each_unit_module_its_own():
    assert {nodeid: work_unit(nodeid) for nodeid in IDS} == IDS


def test_a_module_with_its_own_clusters_never_asks_for_the_session_cluster():
    """The collection guard: a test outside the "ray" work unit that asks for the session's cluster is refused."""
    from tests.conftest import OWN_CLUSTER_MODULES, pytest_collection_modifyitems

    class Item:
        def __init__(self, nodeid, fixturenames):
            self.nodeid, self.fixturenames = nodeid, fixturenames

    module = sorted(OWN_CLUSTER_MODULES)[0]
    pytest_collection_modifyitems(None, [Item(f"{module}::test_x", ["multinode", "tmp_path"]),
                                         Item("tests/integration/test_serve_app.py::test_y", ["serve_url"])])
    with pytest.raises(pytest.UsageError, match="ray_cluster"):
        pytest_collection_modifyitems(None, [Item(f"{module}::test_x", ["multinode", "ray_cluster"])])
