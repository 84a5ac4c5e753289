"""The Ray cluster of an `mbd` command, and its console.

`ray_cluster`: a command joins the cluster that `--address` or RAY_ADDRESS names, else starts a new local cluster
of its own (its processes in `serving_env()`: Ray Serve's high-throughput mode). It never joins a leftover by
accident: a plain `ray.init()` joins whatever cluster Ray's record `ray_current_cluster` (in Ray's temp dir)
names, even one of a head that died uncleanly, so the local case asks for `address="local"`. A cluster the
command started is shut down on exit, SIGTERM included, and then every process that cluster started and that
still runs is ended by pid (Ray's DashboardAgent and RuntimeEnvAgent were seen to outlive their raylet).

`ray_session` (quickstart, reproduce, train, eval, serve) adds a quiet console: only the command's own stage lines, notes
and progress bars. Ray's driver-side output goes to `<log_dir>/ray.log`, whose path is printed: the loggers of Ray
core, Data, Train and Serve (standard logging: each Ray library attaches its own console handler to its logger when
imported, Ray Serve's does not propagate, and `ray.init` configures them again, so they are routed once before and
once after it) and the cluster's messages to the driver (`pipelines/ray_private.py`). Worker, actor and Serve
controller/proxy/replica output stays in Ray's session directory (`log_to_driver=False`).
"""

from __future__ import annotations

import importlib
import logging
import os
import random
import signal
import socket
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil

from pipelines.process_tree import descendants, end_processes
from pipelines.ray_private import route_cluster_messages

RAY_LOG = "ray.log"
LIBRARIES = ("ray.data", "ray.train", "ray.serve")  # each sets up its logger's handlers on import
# Ray's fixed default ports (GCS, dashboard, dashboard agent; Ray's "Configuring Ray: ports" documentation)
RAY_DEFAULT_PORTS = frozenset({6379, 8265, 52365})
RAY_WORKER_PORTS = range(10002, 20000)  # Ray's default min_worker_port..max_worker_port
LOG_FORMAT = "%(asctime)s\t%(levelname)s %(filename)s:%(lineno)s -- %(message)s"


def ephemeral_ports() -> range:
    """The kernel's range for the source ports of outgoing connections (Linux's default where unreadable)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def listen_port() -> int:
    """A port, free on every interface, for a listener a local cluster opens later (its disabled dashboard, Serve's
    fallback proxy, HAProxy's stats and metrics). Never one of Ray's fixed default ports (Ray refuses to start when
    two of its components would share one; 52365 is the dashboard agent's), nor one of Ray's worker ports
    (`RAY_WORKER_PORTS`), nor in the kernel's ephemeral range: the source ports of the cluster's own connections land
    there, and HAProxy, binding its metrics port half an hour after it was picked from that range, found it held by
    one ("Address already in use") and every Serve app of that cluster failed to start. Where the ephemeral range
    covers every port above Ray's worker ports (an ip_local_port_range of 1024-65535), a free port in it is taken."""
    eligible = [p for p in range(RAY_WORKER_PORTS.stop, 65536) if p not in RAY_DEFAULT_PORTS]
    ephemeral = ephemeral_ports()
    candidates = [p for p in eligible if p not in ephemeral] or eligible
    for port in random.sample(candidates, min(64, len(candidates))):
        if port_is_free(port):
            return port
    raise RuntimeError("no free port found for a cluster's listener after 64 tries")


def port_is_free(port: int, reuse_addr: bool = False) -> bool:
    """Whether `port` can be bound on every interface. `reuse_addr` (SO_REUSEADDR, as Ray's metrics exporter binds):
    connections of a previous server still in TIME_WAIT do not hold it."""
    with socket.socket() as s:
        if reuse_addr:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


@contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """`env` in os.environ (the cluster processes started meanwhile inherit it), then os.environ as it was."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def serving_env() -> dict[str, str]:
    """The environment of a cluster started here: Ray Serve's high-throughput mode (`RAY_SERVE_ENABLE_HA_PROXY`,
    Ray's "Enable High Throughput on Ray Serve" guide), HAProxy instead of Ray's Python HTTP proxy, forwarding to
    ingress replicas that serve HTTP themselves, for more HTTP throughput per CPU (docs/performance.md measures it;
    docs/serving.md says what it costs a client that goes away). The ports that mode would fix machine-wide get free ones, so
    that clusters on one machine never collide; an ingress replica stopping drains for 2 s (Ray's default, 30 s,
    waits for load balancers outside the cluster, which a local cluster has none of). A proxy gets 30 s to report
    ready, not Ray's 5 s: on a loaded 2-core node HAProxy's first start took longer, the controller killed the proxy
    as unhealthy and `serve.start`, waiting on that first proxy, failed. What the user set wins."""
    env = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
           "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30"}
    for name in ("FALLBACK_PROXY_HTTP_PORT", "FALLBACK_PROXY_GRPC_PORT", "HAPROXY_STATS_PORT", "HAPROXY_METRICS_PORT"):
        env[f"RAY_SERVE_{name}"] = str(listen_port())
    return {k: v for k, v in env.items() if k not in os.environ}


def named_address(address: str | None = None) -> str | None:
    """The cluster the user named: `address`, else RAY_ADDRESS (set by `ray job submit`), else None."""
    return address or os.environ.get("RAY_ADDRESS") or None


def init_ray(address: str | None = None, num_cpus: int | None = None, **init_kwargs: Any) -> bool:
    """`ray.init` on the named cluster, else on a new local one (never a leftover, its processes in
    `serving_env()`); returns whether it started one.
    The local cluster has no dashboard, but its address still names a port of its own: Ray Train's placement-group
    cleaner asks the State API there whether the run's controller lives, and another Ray cluster on this machine
    answering at the default port 8265 ("no such actor") would get our training workers killed."""
    import ray

    if (named := named_address(address)) is not None:
        ray.init(address=named, **init_kwargs)
        return False
    with environment(serving_env()):
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, dashboard_port=listen_port(),
                 **init_kwargs)
    return True


def _exit_on_sigterm(*_: object) -> None:
    raise SystemExit(128 + signal.SIGTERM)


@contextmanager
def ray_cluster(address: str | None = None, num_cpus: int | None = None, **init_kwargs: Any) -> Iterator[bool]:
    """Reuse a connected Ray, else `init_ray`; yields whether it started a cluster, which it alone shuts down,
    ending every process of it still alive afterwards.
    The command's SIGTERM handler is saved once, here: `ray.init` installs Ray's own (which ends the node's
    processes, but not the agents under its raylet, and exits), so the command's is put back for the session
    (none: exit through the `finally` blocks, this one included), and the handler from before on the way out."""
    import ray

    if ray.is_initialized():
        yield False
        return
    me = psutil.Process()
    before = {p.pid for p in me.children()}
    own = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    try:
        started = init_ray(address, num_cpus, **init_kwargs)
        if own is not None:
            signal.signal(signal.SIGTERM, _exit_on_sigterm if own in (signal.SIG_DFL, None) else own)
        ours = [p.pid for p in me.children() if p.pid not in before] if started else []
        try:
            yield started
        finally:
            procs = descendants(ours)  # taken before shutdown: orphans can no longer be found
            ray.shutdown()
            end_processes(procs)
    finally:
        if own is not None:
            signal.signal(signal.SIGTERM, own)


class _Routing:
    """Moves every `ray` / `ray.*` logger's output, and the cluster's messages to the driver, to one handler;
    puts them back as they were."""

    def __init__(self, handler: logging.Handler):
        self.handler = handler
        self.saved: dict[str, tuple[list[logging.Handler], bool]] = {}
        self.undo_messages: Callable[[], None] | None = None

    def apply(self) -> None:
        names = ["ray"] + [n for n in logging.root.manager.loggerDict if n.startswith("ray.")]
        for name in names:
            logger = logging.getLogger(name)
            self.saved.setdefault(name, (list(logger.handlers), logger.propagate))
            logger.handlers = [self.handler] if name == "ray" else []
            logger.propagate = name != "ray"
        if self.undo_messages is None:
            log = logging.getLogger("ray.cluster_messages")
            self.undo_messages = route_cluster_messages(lambda source, line: log.warning("(%s) %s", source, line))

    def restore(self) -> None:
        for name, (handlers, propagate) in self.saved.items():
            logger = logging.getLogger(name)
            logger.handlers, logger.propagate = handlers, propagate
        if self.undo_messages is not None:
            self.undo_messages()


@contextmanager
def ray_session(log_dir: Path, num_cpus: int | None = None, address: str | None = None,
                **init_kwargs: Any) -> Iterator[bool]:
    """`ray_cluster` (no dashboard, `log_to_driver=False`, `init_kwargs` for `ray.init`) with Ray's driver-side
    output in `<log_dir>/ray.log`; yields whether it started the cluster."""
    for lib in LIBRARIES:
        importlib.import_module(lib)
    log_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_dir / RAY_LOG)
    handler.setLevel(logging.INFO)  # Ray Data's loggers run at DEBUG
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    routing = _Routing(handler)
    routing.apply()
    print(f"    Ray's log: {log_dir / RAY_LOG} (workers: Ray's session directory, /tmp/ray/session_latest/logs "
          f"on a local cluster)", flush=True)
    try:
        with ray_cluster(address, num_cpus, log_to_driver=False, **init_kwargs) as started:
            routing.apply()
            yield started
    finally:
        routing.restore()
        handler.close()
