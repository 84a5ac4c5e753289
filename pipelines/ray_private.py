"""The one place mbd reaches into Ray's private API; each use says why no public one serves, and a test that fails
loudly on a Ray upgrade that moves it.

- The driver's printer of the cluster's messages: a Ray driver prints the messages the cluster sends it (raylet
  warnings such as an unschedulable task, errors of tasks nobody waits on) straight to stdout from a listener
  thread, through `ray._private.worker.print_to_stdstream`, looked up at each call. No `ray.init` option, logger or
  environment variable routes them (`log_to_driver` covers worker and actor output only; the `ray` loggers do not
  see these). `tests/integration/test_ray_session.py` checks the hook's name, signature and caller.
- A metric's series at 0: `Counter.inc` refuses 0, so `zero` records through `Metric._record`, the call `inc`
  makes once it has checked its value (Ray's exporter then shows the series at 0.0; Ray 2.60). Checked by the
  metrics tests that read every series from a real scrape.
- Serve's replica-to-replica gRPC path for a handle (`_by_reference=False`, what Serve's throughput-optimized mode
  makes the default) instead of a Ray actor task per request (docs/performance.md measures it). Checked by every
  Serve test: the ingress calls its decoder through such a handle.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

HOOK = "print_to_stdstream"
HOOK_PARAMS = ["data", "ignore_prefix"]



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


def zero(counter: Any, tags: dict[str, str] | None = None) -> None:
    """`counter`'s series (with `tags`) exported at 0 before anything counted."""
    counter._record(0, tags=tags)


def by_grpc(handle: Any) -> Any:
    """`handle` calling its deployment over Serve's replica-to-replica gRPC path, streaming its results."""
    return handle.options(stream=True, _by_reference=False)
