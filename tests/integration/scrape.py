"""Read Ray's Prometheus endpoint the way Prometheus does: every alive node's metrics export port (what Ray's
service discovery file lists), parsed with prometheus_client's text parser. Nothing here imports pytest: the
dashboard render script uses it as well."""

from __future__ import annotations

import time
from typing import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = list[tuple[str, dict[str, str], float]]


def export_ports() -> list[int]:
    """The metrics export port of every alive node of the connected cluster."""
    import ray

    return [n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]]


def scrape(ports: list[int]) -> Samples:
    """Every sample (name, labels, value) of the `ray_mbd_*` series."""
    out: Samples = []
    for port in ports:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            out += [(s.name, s.labels, s.value) for s in family.samples if s.name.startswith("ray_mbd_")]
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name` over every series whose labels include `labels`."""
    return sum(v for n, lab, v in samples if n == name and labels.items() <= lab.items())


def poll(ports: list[int], done: Callable[[Samples], bool], timeout_s: float = 60.0) -> Samples:
    """Scrape until `done` holds (Ray's metrics agent exports every few seconds), or give the last scrape."""
    deadline = time.monotonic() + timeout_s
    while not done(samples := scrape(ports)) and time.monotonic() < deadline:
        time.sleep(1.0)
    return samples
