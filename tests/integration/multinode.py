"""Local multi-node Ray clusters on one machine, for tests and benchmarks.

`LocalCluster` wraps Ray's `ray.cluster_utils.Cluster`: a head and worker raylets as separate processes, each with
its own small logical resources, so that placement across nodes is forced; nodes are added and removed while work
runs. `LocalCluster.autoscaling(...)` starts the head with Ray's fake multi-node node provider, driven by the real
autoscaler (the head's monitor process), which starts and stops worker raylets on demand.

Other Ray clusters run on the same machine, so a cluster here:
- listens on ports of its own (GCS, dashboard agent; never Ray's fixed defaults 6379 / 52365 / 8265);
- leaves Ray's shared record of "the current cluster" (`ray_current_cluster` in Ray's temp dir) as it found it,
  so that a plain `ray.init()` elsewhere never joins it;
- ends only processes it started, by pid: the node processes Ray's `Node` objects hold, plus every descendant of
  them (worker processes, the dashboard and runtime-env agents, the raylets the autoscaler started), collected
  before the parents go. Ray's own `AutoscalingCluster` helper instead force-stops every Ray process of every
  user on the machine.

Nothing here imports pytest: benchmarks use it as well (`from tests.integration.multinode import LocalCluster`).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil

from actors.tp_worker import free_port
from pipelines.process_tree import descendants, end_processes
from pipelines.ray_session import environment, listen_port, serving_env

MB = 1024**2


@contextmanager
def _address_file_kept() -> Iterator[None]:
    """Puts Ray's `ray_current_cluster` record back as it was: Cluster writes (and removes) it, and any other
    user's `ray.init()` on this machine would otherwise join our cluster."""
    from ray._common.utils import get_ray_address_file

    path = Path(get_ray_address_file(None))
    before = path.read_text() if path.exists() else None
    try:
        yield
    finally:
        if before is None:
            path.unlink(missing_ok=True)
        elif not path.exists() or path.read_text() != before:
            path.write_text(before)


def _node_ip() -> str:
    from ray._private.services import get_node_ip_address

    return get_node_ip_address()


STARTUP_ATTEMPTS = 3


def _retrying_startup(start: Callable[[], Any]) -> Any:
    """`start()`, again (up to STARTUP_ATTEMPTS times) when Ray's fixed 30 s wait for a new raylet to register
    runs out, as on a heavily loaded machine; the processes of a failed attempt are ended first."""
    for attempt in range(1, STARTUP_ATTEMPTS + 1):
        before = {p.pid for p in psutil.Process().children()}
        try:
            return start()
        except Exception as e:  # Ray raises a bare Exception for it
            if "timed out during startup" not in str(e) or attempt == STARTUP_ATTEMPTS:
                raise
            end_processes(descendants([p.pid for p in psutil.Process().children() if p.pid not in before]))


class LocalCluster:
    """A Ray cluster of separate node processes on this machine. `start()` starts the head; `add_node` /
    `remove_node` change it while work runs; `connect()` makes this process its driver; `shutdown()` ends every
    process it started and nothing else."""

    def __init__(self, head_cpus: float = 1, object_store_mb: int = 150, head_resources: dict | None = None,
                 system_config: dict | None = None, autoscaling_config: str | None = None):
        self.head_cpus, self.object_store_mb = head_cpus, object_store_mb
        self.head_resources = head_resources or {}
        self.system_config = system_config or {}
        self.autoscaling_config = autoscaling_config
        self.port = free_port()
        self.cluster: Any = None
        self.env: dict[str, str] = {}

    # ------------------------------------------------------------------ lifecycle
    @property
    def address(self) -> str:
        return self.cluster.address

    def start(self, env: dict[str, str] | None = None) -> "LocalCluster":
        """Start the head (its processes inherit `env` on top of this process's environment and of Ray Serve's
        high-throughput mode, `serving_env()`, as the commands' local clusters). Every node's processes get
        RAY_ADDRESS naming this cluster: Ray code that looks a cluster up by itself (Ray Train's
        placement-group cleaner asks the State API whether the run's controller lives) would otherwise find Ray's
        machine-wide `ray_current_cluster` record, which may name another user's cluster."""
        from ray.cluster_utils import Cluster

        # no log monitor (Ray's Cluster starts none on worker nodes either): it tails every worker's log file to
        # relay it to the driver, which a test never reads (the files stay in the session's log directory); in a
        # profile of the whole suite the log monitors used 88 s of CPU
        head = dict(gcs_server_port=self.port, num_cpus=self.head_cpus, object_store_memory=self.object_store_mb * MB,
                    resources=self.head_resources, include_dashboard=False, include_log_monitor=False,
                    dashboard_port=listen_port(),
                    dashboard_agent_listen_port=listen_port(), _system_config=self.system_config,
                    autoscaling_config=self.autoscaling_config)
        self.env = {"RAY_ADDRESS": f"{_node_ip()}:{self.port}", **serving_env(), **(env or {})}
        with environment(self.env), _address_file_kept():
            self.cluster = _retrying_startup(lambda: Cluster(initialize_head=True, head_node_args=head))
        return self

    def add_node(self, num_cpus: float = 1, resources: dict | None = None, object_store_mb: int | None = None):
        """A worker node (a raylet of its own); returns Ray's Node object (`.node_id`)."""
        with environment(self.env):
            return _retrying_startup(lambda: self.cluster.add_node(
                num_cpus=num_cpus, resources=resources or {},
                object_store_memory=(object_store_mb or self.object_store_mb) * MB))

    def remove_node(self, node, graceful: bool = True) -> None:
        """End a worker node's raylet and everything under it (its workers die with it: a lost node)."""
        procs = descendants(self._pids(node))
        self.cluster.remove_node(node, allow_graceful=graceful)
        end_processes(procs)

    @property
    def worker_nodes(self) -> list:
        return list(self.cluster.worker_nodes)

    def connect(self, **init_kwargs: Any) -> None:
        import ray

        ray.init(address=self.address, **init_kwargs)

    def wait_for_nodes(self, alive: int, timeout_s: float = 120.0) -> None:
        """Wait until exactly `alive` nodes are alive (needs a connected driver)."""
        import ray

        deadline = time.monotonic() + timeout_s
        while sum(n["Alive"] for n in ray.nodes()) != alive:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{alive} alive nodes expected, have {sum(n['Alive'] for n in ray.nodes())}")
            time.sleep(0.5)

    def shutdown(self) -> None:
        """Disconnect a driver of this cluster, then end every process of every node and all their descendants
        (the autoscaler's raylets included), by pid."""
        import ray

        if self.cluster is None:
            return
        if ray.is_initialized() and ray.get_runtime_context().gcs_address == self.address:
            ray.shutdown()
        nodes = self.cluster.list_all_nodes()
        procs = descendants([pid for n in nodes for pid in self._pids(n)])
        for node in [n for n in nodes if n is not self.cluster.head_node] + [self.cluster.head_node]:
            if node is not None:
                node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
        end_processes(procs)
        self.cluster = None

    @staticmethod
    def _pids(node) -> list[int]:
        return [info.process.pid for infos in node.all_processes.values() for info in infos]

    # ------------------------------------------------------------------ autoscaling
    @classmethod
    def autoscaling(cls, worker_types: dict[str, dict], head_cpus: float = 1, object_store_mb: int = 150,
                    idle_timeout_s: float = 10.0, max_workers: int = 8) -> "LocalCluster":
        """A started head whose autoscaler (Ray's real one, in the head's monitor process) adds and removes
        worker nodes of `worker_types` through Ray's fake multi-node provider. Each type is
        {"resources": {"CPU": 1, ...}, "min_workers": 0, "max_workers": 4}."""
        cluster = cls(head_cpus=head_cpus, object_store_mb=object_store_mb)
        config = fake_provider_config(cluster, worker_types, idle_timeout_s, max_workers)
        fd, path = tempfile.mkstemp(prefix="mbd-autoscaler-", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump(config, fh)
        cluster.autoscaling_config = path
        return cluster.start(env={"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"})


def fake_provider_config(cluster: LocalCluster, worker_types: dict[str, dict], idle_timeout_s: float,
                         max_workers: int) -> dict:
    """The autoscaler's cluster config for Ray's fake multi-node provider, pointed at this cluster's GCS port
    (the provider's default is 6379, another cluster's)."""
    types = {name: {"node_config": {}, "min_workers": t.get("min_workers", 0),
                    "max_workers": t.get("max_workers", max_workers),
                    "resources": {"object_store_memory": cluster.object_store_mb * MB, **t["resources"]}}
             for name, t in worker_types.items()}
    types["ray.head.default"] = {"node_config": {}, "max_workers": 0,
                                 "resources": {"CPU": cluster.head_cpus, **cluster.head_resources}}
    return {
        "cluster_name": f"mbd-fake-{cluster.port}",
        "max_workers": max_workers,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": idle_timeout_s / 60,
        "provider": {"type": "fake_multinode", "gcs_address": f"{_node_ip()}:{cluster.port}",
                     "disable_launch_config_check": True, "disable_node_updaters": True, "use_node_id_as_ip": True},
        "auth": {"ssh_user": "ubuntu"},
        "docker": {},
        "available_node_types": types,
        "head_node_type": "ray.head.default",
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
        "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }
