"""The suite's xdist scheduling (tests/conftest.py): every test on the session's Ray cluster in one work unit (one
worker, one cluster, collection order); each unit module, and each Ray module off the session's cluster (clusters
of its own, or no Ray), a work unit of its own; the Ray unit handed out first, then the long ones. xdist's
`loadgroup` marks were tried first and silently did nothing under pytest 9: this checks the scopes the scheduler
actually uses."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import LONG_UNITS, OFF_SESSION_CLUSTER, SESSION_CLUSTER_FIXTURES, collection_order, work_unit

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


def test_a_module_with_its_own_clusters_never_asks_for_the_session_cluster():
    """The collection guard: a test outside the "ray" work unit that asks for the session's cluster is refused."""
    from tests.conftest import pytest_collection_modifyitems

    class Item:
        def __init__(self, nodeid, fixturenames):
            self.nodeid, self.fixturenames = nodeid, fixturenames

    module = sorted(OFF_SESSION_CLUSTER)[0]
    pytest_collection_modifyitems(None, [Item(f"{module}::test_x", ["multinode", "tmp_path"]),
                                         Item("tests/integration/test_serve_app.py::test_y", ["serve_url"])])
    with pytest.raises(pytest.UsageError, match="ray_cluster"):
        pytest_collection_modifyitems(None, [Item(f"{module}::test_x", ["multinode", "ray_cluster"])])


FIXTURES_OF_EACH_TEST = """
def pytest_collection_modifyitems(items):
    for item in items:
        print("FIXTURES", item.nodeid, *item.fixturenames)
"""


def test_every_module_in_the_ray_unit_uses_the_session_cluster(tmp_path):
    """The other direction, over the whole collection (slow tests included): a module on the session cluster's
    worker whose tests never use that cluster only lengthens the suite's longest work unit; each must be listed
    in OFF_SESSION_CLUSTER, and each listed one must exist."""
    (tmp_path / "fixtures_of_each_test.py").write_text(FIXTURES_OF_EACH_TEST)
    out = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:xdist", "-p", "fixtures_of_each_test",
                          "-o", "addopts=", "tests/e2e", "tests/integration"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    uses: dict[str, bool] = {}
    for line in out.stdout.splitlines():
        if line.startswith("FIXTURES "):
            nodeid, *fixtures = line.split()[1:]
            module = nodeid.split("::", 1)[0]
            uses[module] = uses.get(module, False) or bool(SESSION_CLUSTER_FIXTURES.intersection(fixtures))
    assert OFF_SESSION_CLUSTER <= set(uses) and all((ROOT / m).is_file() for m in LONG_UNITS)
    assert sorted(m for m, used in uses.items() if work_unit(f"{m}::t") == "ray" and not used) == []
