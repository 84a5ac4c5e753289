"""`GET /metrics` on the API port: one application's `ray_mbd_*` series in Prometheus' text format, what vLLM and
SGLang users scrape from their servers. The replicas record them through Ray, whose metrics agent on each node
exports the series of that node's replicas; so the route asks every alive node's metrics export port and merges
the answers, and whichever ingress replica HAProxy picks answers the same series. Ray's own series (`ray_serve_*`,
node and worker stats) stay on the export ports, which deploy/prometheus/prometheus.yml scrapes."""

from __future__ import annotations

import asyncio
import logging
from typing import Iterable

import httpx
from prometheus_client import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("ray.serve")
PREFIX = "ray_mbd_"
FETCH_TIMEOUT_S = 5.0


def export_addresses() -> list[str]:
    """host:port of every alive node's Ray metrics export endpoint (what Ray's service discovery file lists)."""
    import ray

    return [_address(n["NodeManagerAddress"], n["MetricsExportPort"]) for n in ray.nodes() if n["Alive"]]


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _ours(text: str) -> str:
    """The lines of the `ray_mbd_*` families in one node's exposition (the rest, Ray's own, is most of its
    ~300 KB and is never parsed)."""
    heads = (f"# HELP {PREFIX}", f"# TYPE {PREFIX}")
    return "\n".join(line for line in text.splitlines() if line.startswith(PREFIX) or line.startswith(heads)) + "\n"


class _Families:
    """What `generate_latest` renders: anything with `collect()`."""

    def __init__(self, families: Iterable[Metric]):
        self.families = list(families)

    def collect(self) -> list[Metric]:
        return self.families


def merge(texts: Iterable[str], application: str) -> bytes:
    """The `ray_mbd_*` samples of `application` (Serve's tag) from the nodes' expositions, one family each: the
    same family on two nodes would otherwise be declared twice, which Prometheus refuses."""
    families: dict[str, Metric] = {}
    for text in texts:
        for fam in text_string_to_metric_families(_ours(text)):
            samples = [s for s in fam.samples if s.labels.get("application") == application]
            if samples:
                families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type)).samples += samples
    return generate_latest(_Families(families.values()))  # type: ignore[arg-type]


async def gather(application: str) -> bytes | None:
    """`application`'s series from every node, or None when no node's export endpoint answered. The GCS call and
    the parsing run in threads, the fetches concurrently: the event loop serves requests meanwhile."""
    addresses = await asyncio.to_thread(export_addresses)
    async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S) as client:
        answers = await asyncio.gather(*(client.get(f"http://{a}/metrics") for a in addresses),
                                       return_exceptions=True)
    texts = []
    for address, r in zip(addresses, answers):
        if isinstance(r, httpx.Response) and r.status_code == 200:
            texts.append(r.text)
        else:  # that node's series are missing from this answer; the next scrape asks it again
            log.warning("/metrics: the metrics export endpoint %s did not answer: %r", address, r)
    return await asyncio.to_thread(merge, texts, application) if texts else None
