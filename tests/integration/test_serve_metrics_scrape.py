"""Metrics where operators look, on the session's cluster before any request is served: `GET /metrics` on the API
port answers the app's `ray_mbd_*` series (no API key, as vLLM's), every counter and gauge already at 0; the
Prometheus service discovery file `mbd serve` writes lists every node's metrics export port; and a real Prometheus
run with deploy/prometheus/prometheus.yml as it is scrapes them, the Grafana board's model list and every panel
but the histograms' answering (skipped where Debian's `prometheus` is not installed)."""

import json
import os
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipelines.metrics_sd import ServiceDiscovery
from serve_app.exposition import export_addresses
from tests.integration import prometheus
from tests.integration.conftest import serve_apps, tiny_serve_config

MODEL = "mbd-scrape"
KEY = "scrape-test-key"
COUNTERS = ("prompt_tokens", "generation_tokens", "http_requests", "requests_refused", "num_preemptions",
            "prefix_cache_queries", "prefix_cache_hits", "engine_restarts", "requests_quarantined")
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "active_blocks_per_forward",
          "block_buffer_occupancy", "structured_output_step_share")
PROBES = ("/health", "/metrics")
EXPECTED = {f"ray_mbd_{c}_total" for c in COUNTERS} | {f"ray_mbd_{g}" for g in GAUGES}


@pytest.fixture(scope="module")
def base(serve_url, ckpt):
    for url in serve_apps(serve_url, scrape=tiny_serve_config(ckpt, MODEL, http={"api_key": KEY})):
        yield f"{url}/scrape"


def _samples(text: str) -> dict[str, list[float]]:
    """This app's samples by series name (other tests' apps on the session's cluster export theirs too), less the
    requests that readiness probes and this scrape make (`/health`, `/metrics`)."""
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model_name") == MODEL and s.labels.get("endpoint") not in PROBES:
                out.setdefault(s.name, []).append(s.value)
    return out


@pytest.fixture(scope="module")
def scraped(base) -> tuple[httpx.Response, dict[str, list[float]]]:
    """The first answer of `GET /metrics` that holds every expected series (Ray exports every few seconds)."""
    deadline = time.monotonic() + 90
    while True:
        r = httpx.get(f"{base}/metrics", timeout=30)
        samples = _samples(r.text) if r.status_code == 200 else {}
        if EXPECTED <= samples.keys() or time.monotonic() > deadline:
            return r, samples
        time.sleep(1)


def test_metrics_route_answers_every_series_at_zero_without_a_key(base, scraped):
    r, samples = scraped
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text[:300]
    assert EXPECTED <= samples.keys(), EXPECTED - samples.keys()
    assert all(v == 0 for name in EXPECTED for v in samples[name]), {n: samples[n] for n in EXPECTED if any(samples[n])}
    families = [line.split()[2] for line in r.text.splitlines() if line.startswith("# TYPE ")]
    assert len(families) == len(set(families)) and all(f.startswith("ray_mbd_") for f in families), families
    assert httpx.get(f"{base}/v1/models", timeout=30).status_code == 401  # the key guards the API, not /metrics
    spec = httpx.get(f"{base}/openapi.json", timeout=30).json()["paths"]["/metrics"]["get"]
    assert list(spec["responses"]["200"]["content"]) == ["text/plain"]


@pytest.fixture(scope="module")
def discovery(scraped):
    """The discovery file `mbd serve` writes, for the session's cluster; Ray's stable path as it was afterwards
    (another cluster on this machine may own it)."""
    sd = ServiceDiscovery()
    before = os.readlink(sd.link) if sd.link.is_symlink() else sd.link.read_bytes() if sd.link.exists() else None
    sd.refresh()
    yield sd
    sd.link.unlink(missing_ok=True)
    if isinstance(before, str):
        sd.link.symlink_to(before)
    elif before is not None:
        sd.link.write_bytes(before)


def test_discovery_file_lists_every_nodes_export_port(discovery):
    import ray

    (group,) = json.loads(discovery.link.read_text())
    ports = {n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]}
    assert group["labels"] == {"job": "ray"} and sorted(group["targets"]) == sorted(export_addresses())
    assert {int(t.rsplit(":", 1)[1]) for t in group["targets"]} == ports
    assert discovery.link.resolve() == discovery.path.resolve() and discovery.path.parent.name.startswith("session_")


@pytest.mark.skipif(not prometheus.available(), reason="Debian's prometheus is not installed")
def test_prometheus_scrapes_with_the_repository_config(discovery, tmp_path: Path):
    interval = prometheus.scrape_interval_s()
    ours = f'ray_mbd_engine_restarts_total{{model_name="{MODEL}"}}'
    with prometheus.prometheus(tmp_path) as url:
        deadline = time.monotonic() + 6 * interval
        # two scrapes: what rate() and increase() need
        while not prometheus.query(url, f"count_over_time({ours}[5m]) >= 2") and time.monotonic() < deadline:
            time.sleep(1)
        assert {t["scrapeUrl"] for t in prometheus.targets(url) if t["health"] == "up"} >= \
            {f"http://{a}/metrics" for a in export_addresses()}
        assert [float(s["value"][1]) for s in prometheus.query(url, ours)] == [0.0]
        assert MODEL in prometheus.model_choices(url)
        now = time.time()  # a range query, as Grafana draws a panel
        silent = [(title, legend) for title, legend, expr in prometheus.panel_targets(MODEL, interval)
                  if not prometheus.names_histogram(expr)
                  and not prometheus.query_range(url, expr, now - 60, now, interval)]
        assert silent == []  # "no data" before the first request: only the latency and TPF/NFE histograms
