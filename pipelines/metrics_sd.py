"""Prometheus file-based service discovery for a cluster without Ray's dashboard, which is what writes it otherwise.

`mbd serve` starts its local cluster without the dashboard, so nothing would tell Prometheus where the metrics are.
`ServiceDiscovery` writes the file Ray's dashboard would, in the same format ({"labels": {"job": "ray"}, "targets":
every alive node's metrics export host:port}) and at the same paths: `<session dir>/prom_metrics_service_discovery
.json` (beside the session's logs) and a link to it at `<Ray temp dir>/prom_metrics_service_discovery.json`
(`/tmp/ray/...` by default), which deploy/prometheus/prometheus.yml reads. `refresh()` rewrites the file when the
nodes changed, atomically (Prometheus watches it, and a half-written file is an error there).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from serve_app.exposition import export_addresses

SD_FILE = "prom_metrics_service_discovery.json"  # Ray's name (ray_constants.PROMETHEUS_SERVICE_DISCOVERY_FILE)


def sd_content(addresses: list[str]) -> str:
    return json.dumps([{"labels": {"job": "ray"}, "targets": addresses}])


class ServiceDiscovery:
    """The discovery file of the connected cluster, written on this (its head) node."""

    def __init__(self) -> None:
        import ray

        ctx = ray.get_runtime_context()
        temp = Path(ctx.get_temp_dir())
        self.path = temp / ctx.get_session_name() / SD_FILE
        self.link = temp / SD_FILE
        self.written: str | None = None

    def refresh(self) -> None:
        content = sd_content(export_addresses())
        if content == self.written:
            return
        tmp = self.path.with_name(f"tmp_{SD_FILE}")
        tmp.write_text(content)
        os.replace(tmp, self.path)
        if self.written is None:  # the stable path names this session's file from now on
            tmp.symlink_to(self.path)
            os.replace(tmp, self.link)
        self.written = content
