"""`ray_session` / `ray_cluster`: Ray's driver-side logging and cluster messages go to <log_dir>/ray.log, not the
console, and everything is put back afterwards; a cluster it did not start is left running; a command never joins
a leftover cluster that Ray's `ray_current_cluster` record names. (SIGTERM to `mbd serve`, on a cluster of its own:
test_serve_sigterm.)"""

import inspect
import logging
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from pipelines.ray_private import HOOK, HOOK_PARAMS
from pipelines.ray_session import RAY_LOG, ray_session

ROOT = Path(__file__).resolve().parents[2]


def test_ray_output_goes_to_the_log_file_and_is_restored(ray_cluster, tmp_path, capfd):
    import ray.serve  # noqa: F401  (sets up its logger's console handler on import)
    from ray._private import worker

    serve_before = list(logging.getLogger("ray.serve").handlers)
    ray_before = list(logging.getLogger("ray").handlers)
    printer = getattr(worker, HOOK)
    with ray_session(tmp_path) as started:
        logging.getLogger("ray.serve").info("serve line 1")  # Ray Serve's logger has a console handler of its own
        logging.getLogger("ray.data").warning("data line 2")
        # what the driver's listener thread does with a message from the cluster
        getattr(worker, HOOK)({"lines": ["raylet line 3"], "pid": "raylet", "is_err": False}, False)
    out, err = capfd.readouterr()
    assert started is False and ray_cluster.is_initialized()
    assert "Ray's log: " + str(tmp_path / RAY_LOG) in out
    for line in ("serve line 1", "data line 2", "raylet line 3"):
        assert line not in out and line not in err
    logged = (tmp_path / RAY_LOG).read_text()
    assert "serve line 1" in logged and "data line 2" in logged and "(raylet) raylet line 3" in logged
    assert logging.getLogger("ray.serve").handlers == serve_before and logging.getLogger("ray").handlers == ray_before
    assert getattr(worker, HOOK) is printer


def test_ray_private_hook_is_where_the_adapter_expects_it():
    """pipelines/ray_private.py's driver hook: a Ray upgrade that renames it, changes its parameters or
    stops printing the cluster's messages through it fails here, loudly."""
    from ray._private import worker

    assert list(inspect.signature(getattr(worker, HOOK)).parameters) == HOOK_PARAMS
    assert f"{HOOK}(" in inspect.getsource(worker.listen_error_messages)


def test_a_listen_port_is_free_and_outside_what_ray_and_the_kernel_hand_out(monkeypatch):
    """Ray's fixed ports, its worker ports and the kernel's ephemeral range (where the source ports of the cluster's
    own connections land) are never picked; a port that is taken is skipped."""
    from pipelines import ray_session as module

    eph = module.ephemeral_ports()
    picks = [module.listen_port() for _ in range(200)]
    assert not [p for p in picks if p in eph or p < 20000 or p in module.RAY_DEFAULT_PORTS]
    with socket.socket() as held:
        held.bind(("", picks[0]))
        held.listen()
        assert not module.port_is_free(picks[0])
        first_the_held_one = lambda pool, k: [picks[0], *[p for p in pool if p != picks[0]][:k - 1]]  # noqa: E731
        monkeypatch.setattr(module.random, "sample", first_the_held_one)
        assert module.listen_port() != picks[0]
    # a kernel whose ephemeral range covers every port above Ray's worker ports still gets a free one
    monkeypatch.undo()
    monkeypatch.setattr(module, "ephemeral_ports", lambda: range(1024, 65536))
    assert module.listen_port() >= module.RAY_WORKER_PORTS.stop


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


SESSION = """
import sys, ray
from pathlib import Path
from pipelines.ray_session import ray_session
with ray_session(Path(sys.argv[1]), num_cpus=1) as started:
    print("STARTED", started, ray.get_runtime_context().gcs_address, flush=True)
"""


def test_a_leftover_cluster_record_is_never_joined(ray_cluster, tmp_path):
    """Ray's record of the last cluster names a live cluster that is not ours (as after a head that died
    uncleanly, or another user's): a command starts its own cluster instead of joining it, which Ray refuses
    anyway when num_cpus is given ("When connecting to an existing cluster, num_cpus ... must not be provided")."""
    leftover = ray_cluster.get_runtime_context().gcs_address
    ray_tmp = Path(tempfile.mkdtemp(prefix="mbd-rt-"))  # short: Ray's socket paths live below it
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text(leftover)
    out = subprocess.run([sys.executable, "-c", SESSION, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         env=_env(RAY_TMPDIR=str(ray_tmp)), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    started, address = out.stdout.split("STARTED ")[1].split()[:2]
    assert started == "True" and address != leftover
