"""The suite's xdist scheduling (tests/conftest.py): every test on the session's Ray cluster in one work unit (one
worker, one cluster, collection order), each unit module a work unit of its own. xdist's `loadgroup` marks were
tried first and silently did nothing under pytest 9: this checks the scopes the scheduler actually uses."""

from tests.conftest import work_unit

IDS = {
    "tests/e2e/test_quickstart.py::test_table_has_the_four_methods_with_finite_numbers": "ray",
    "tests/integration/test_serve_app.py::test_killed_replica_is_replaced": "ray",
    "tests/integration/test_train_multitf.py::test_zero_run_matches_single_process_and_exports[3]": "ray",
    "tests/unit/test_plan.py::test_weights_equal_the_allocated_model[sdar-dtype0-1]": "tests/unit/test_plan.py",
    "tests/unit/test_plan.py::test_weights_equal_the_allocated_model[sdar-dtype1-1]": "tests/unit/test_plan.py",
    "tests/unit/test_model.py::TestX::test_y[a::b]": "tests/unit/test_model.py",
    "tests/unit/test_integration_names.py::test_e2e": "tests/unit/test_integration_names.py",
}


def test_ray_tests_are_one_work_unit_and_each_unit_module_its_own():
    assert {nodeid: work_unit(nodeid) for nodeid in IDS} == IDS
