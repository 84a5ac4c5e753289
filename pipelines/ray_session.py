"""The Ray session of an `mbd` command (quickstart, reproduce, train, eval): the console shows only the command's
own stage lines, notes and progress bars.

Ray's driver-side output goes to `<log_dir>/ray.log`, whose path is printed: the loggers of Ray core, Ray Data,
Ray Train and Ray Serve, and the messages the cluster sends the driver (raylet warnings, errors of tasks nobody
waits on), which Ray prints straight to stdout. Worker, actor and Serve controller/proxy/replica output stays in
Ray's session directory (`log_to_driver=False`). Each Ray library attaches its own console handler to its logger
when imported (Ray Serve's `ray.serve` does not propagate), so the libraries the commands drive are imported
first and every `ray*` logger is then routed, once before and once after `ray.init`, which configures them again.
On exit everything is put back and only a cluster the session started is shut down.
"""

from __future__ import annotations

import importlib
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from actors.tp_worker import free_port

RAY_LOG = "ray.log"
LIBRARIES = ("ray.data", "ray.train", "ray.serve")  # each sets up its logger's handlers on import


class _Routing:
    """Moves every `ray` / `ray.*` logger's output, and the driver's cluster messages, to one handler; puts
    them back as they were."""

    def __init__(self, handler: logging.Handler):
        self.handler = handler
        self.saved: dict[str, tuple[list[logging.Handler], bool]] = {}
        self.printer: Any = None

    def apply(self) -> None:
        from ray._private import worker

        names = ["ray"] + [n for n in logging.root.manager.loggerDict if n.startswith("ray.")]
        for name in names:
            logger = logging.getLogger(name)
            self.saved.setdefault(name, (list(logger.handlers), logger.propagate))
            logger.handlers = [self.handler] if name == "ray" else []
            logger.propagate = name != "ray"
        if self.printer is None:
            # the driver's listener thread prints cluster messages with this function, looked up at each call
            self.printer, worker.print_to_stdstream = worker.print_to_stdstream, _log_cluster_message

    def restore(self) -> None:
        from ray._private import worker

        for name, (handlers, propagate) in self.saved.items():
            logger = logging.getLogger(name)
            logger.handlers, logger.propagate = handlers, propagate
        if self.printer is not None:
            worker.print_to_stdstream = self.printer


def dashboard_port() -> int:
    """A free port for a local cluster's (disabled) dashboard address that none of Ray's fixed default ports take:
    Ray refuses to start when two of its components would share one (52365 is the dashboard agent's)."""
    from ray._private import ray_constants as rc

    taken = {rc.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT, rc.DEFAULT_DASHBOARD_PORT, rc.DEFAULT_PORT}
    while (port := free_port()) in taken:
        pass
    return port


def _log_cluster_message(data: dict[str, Any], ignore_prefix: bool = False) -> None:
    log = logging.getLogger("ray.cluster_messages")
    for line in data.get("lines", []):
        log.warning("(%s) %s", data.get("pid"), line)


@contextmanager
def ray_session(log_dir: Path, num_cpus: int | None = None) -> Iterator[bool]:
    """Reuse a connected Ray, else join RAY_ADDRESS, else start a local cluster (`num_cpus`, no dashboard);
    yields whether it started one, which it alone shuts down."""
    import ray
    from ray._private import ray_constants

    for lib in LIBRARIES:
        importlib.import_module(lib)
    log_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_dir / RAY_LOG)
    handler.setLevel(logging.INFO)  # Ray Data's loggers run at DEBUG
    handler.setFormatter(logging.Formatter(ray_constants.LOGGER_FORMAT))  # the format ray.init gives it anyway
    routing = _Routing(handler)
    routing.apply()
    print(f"    Ray's log: {log_dir / RAY_LOG} (workers: Ray's session directory, /tmp/ray/session_latest/logs "
          f"on a local cluster)", flush=True)
    started = not ray.is_initialized()
    try:
        if started:
            if os.environ.get("RAY_ADDRESS"):
                ray.init(log_to_driver=False)
            else:
                # No dashboard, but its address still names a port of its own: Ray Train's placement-group
                # cleaner asks the State API there whether the run's controller lives, and another Ray cluster
                # on this machine answering at the default port 8265 ("no such actor") would get our training
                # workers killed.
                ray.init(num_cpus=num_cpus, include_dashboard=False, dashboard_port=dashboard_port(),
                         log_to_driver=False)
        routing.apply()
        yield started
    finally:
        if started:
            ray.shutdown()
        routing.restore()
        handler.close()
