"""The one place mbd reaches into Ray's private API: where the driver prints the cluster's messages.

Why: a Ray driver prints the messages the cluster sends it (raylet warnings such as an unschedulable task, errors
of tasks nobody waits on) straight to stdout from a listener thread, through
`ray._private.worker.print_to_stdstream`, looked up at each call. No `ray.init` option, logger or environment
variable routes them (`log_to_driver` covers worker and actor output only; the `ray` loggers do not see these).
`tests/integration/test_ray_session.py` checks the hook's name, signature and caller, so that a Ray upgrade
that moves it fails that test loudly instead of silently printing to the console again.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

HOOK = "print_to_stdstream"
HOOK_PARAMS = ["data", "ignore_prefix"]

__all__ = ["HOOK", "HOOK_PARAMS", "route_cluster_messages"]


def _worker_module() -> Any:
    import ray
    from ray._private import worker

    params = list(inspect.signature(getattr(worker, HOOK, lambda: None)).parameters)
    if params != HOOK_PARAMS:
        raise RuntimeError(f"Ray {ray.__version__} changed ray._private.worker.{HOOK} (parameters {params}, "
                           f"expected {HOOK_PARAMS}): update pipelines/ray_private.py")
    return worker


def route_cluster_messages(sink: Callable[[str, str], None]) -> Callable[[], None]:
    """Send each line of the cluster's messages to the driver to `sink(source, line)` instead of stdout;
    returns the function that puts Ray's printer back."""
    worker = _worker_module()
    original = getattr(worker, HOOK)

    def printer(data: dict[str, Any], ignore_prefix: bool = False) -> None:
        for line in data.get("lines", []):
            sink(str(data.get("pid")), line)

    setattr(worker, HOOK, printer)
    return lambda: setattr(worker, HOOK, original)
