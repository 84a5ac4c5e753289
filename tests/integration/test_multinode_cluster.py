"""The shared multi-node fixture: work lands on several nodes, a node can be removed while the cluster runs,
shutdown ends exactly the processes the cluster started and leaves Ray's shared "current cluster" record alone,
and the driver is back on the session's cluster afterwards."""

import time

import pytest

from pipelines.process_tree import descendants, still_running
from tests.integration.multinode import LocalCluster


def _record():
    from ray._common.utils import get_ray_address_file

    try:
        with open(get_ray_address_file(None)) as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def test_tasks_spread_over_nodes_a_node_leaves_and_shutdown_ends_only_its_processes(multinode):
    import ray

    cluster = multinode(workers=(1, 1))
    assert _record() != cluster.address  # other users' plain ray.init() never joins it

    @ray.remote(num_cpus=1)
    def node_of_task() -> str:
        time.sleep(1.0)  # holds its node's only CPU, so the next tasks go elsewhere
        return ray.get_runtime_context().get_node_id()

    used = set(ray.get([node_of_task.remote() for _ in range(6)]))
    expected = {cluster.cluster.head_node.node_id} | {n.node_id for n in cluster.worker_nodes}
    assert len(expected) == 3 and used == expected

    gone = cluster.worker_nodes[0]
    cluster.remove_node(gone)
    cluster.wait_for_nodes(alive=2)
    assert set(ray.get([node_of_task.remote() for _ in range(4)])) == expected - {gone.node_id}

    address = cluster.address
    ours = descendants([pid for node in cluster.cluster.list_all_nodes() for pid in cluster._pids(node)])
    assert len(ours) >= 3 * 2  # each node: a raylet and its workers/agents at least
    cluster.shutdown()
    assert not ray.is_initialized() and _record() != address
    assert still_running(ours) == []


def test_driver_is_back_on_the_session_cluster(ray_cluster):
    assert ray_cluster.is_initialized()
    alive = [n for n in ray_cluster.nodes() if n["Alive"]]
    assert len(alive) == 1 and alive[0]["Resources"]["CPU"] == 2


@pytest.mark.slow
def test_autoscaler_adds_a_worker_node_on_demand_and_removes_it_idle(ray_cluster):
    """Ray's real autoscaler with the fake multi-node provider: a task that fits no running node gets a node."""
    import ray

    previous = ray.get_runtime_context().gcs_address
    ray.shutdown()
    cluster = LocalCluster.autoscaling({"big": {"resources": {"CPU": 1, "big": 1}, "max_workers": 1}},
                                       idle_timeout_s=3)
    try:
        cluster.connect()

        @ray.remote(num_cpus=1, resources={"big": 1})
        def node_of_task() -> str:
            return ray.get_runtime_context().get_node_id()

        node = ray.get(node_of_task.remote(), timeout=180)
        head = ray.get_runtime_context().get_node_id()
        assert node != head
        deadline = time.monotonic() + 180
        while sum(n["Alive"] for n in ray.nodes()) > 1:  # idle: the autoscaler ends it
            assert time.monotonic() < deadline, "idle worker node never removed"
            time.sleep(1)
    finally:
        cluster.shutdown()
        ray.init(address=previous)
