"""SIGTERM to `mbd serve` on a local cluster of its own leaves no process of that cluster behind. The command
starts its cluster itself, so the module never joins the session's (conftest's OFF_SESSION_CLUSTER: it runs beside
the session cluster's tests)."""

import signal
import subprocess
import sys
import time

import psutil

from actors.tp_worker import free_port
from pipelines.process_tree import end_processes, still_running
from tests.integration.test_ray_session import ROOT, _env


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def test_sigterm_to_mbd_serve_leaves_no_process_behind(ckpt, tmp_path):
    """`mbd serve` on a local cluster of its own, stopped with SIGTERM: every process it started (Ray's agents
    included) has ended when it has."""
    cmd = [sys.executable, "-m", "pipelines.cli", "serve", "--config", str(ROOT / "configs/serve/tiny.yaml"),
           "--model-path", str(ckpt), "--port", str(free_port()), "--metrics-port", str(free_port())]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    started: dict[int, psutil.Process] = {}
    try:
        for line in proc.stdout:
            if "Ctrl-C to stop" in line:
                break
        else:
            raise AssertionError(f"mbd serve exited with {proc.wait()} before serving")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("DashboardAgent" in _cmd(p) for p in started.values()):
            started.update((p.pid, p) for p in psutil.Process(proc.pid).children(recursive=True))
            time.sleep(1)
        names = " ".join(_cmd(p) for p in started.values())
        assert "raylet" in names and "DashboardAgent" in names and "RuntimeEnvAgent" in names
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=180)
        time.sleep(2)
        assert [_cmd(p)[:80] for p in still_running(list(started.values()))] == []
    finally:
        proc.kill()
        end_processes(list(started.values()))
