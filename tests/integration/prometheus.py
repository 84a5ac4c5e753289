"""A real Prometheus (Debian's `prometheus` package) run with deploy/prometheus/prometheus.yml as it is, and the
Grafana board's PromQL evaluated by it as Grafana would (`$model`, `$__rate_interval` filled in). Nothing here
imports pytest: benchmarks/dashboard_render.py uses it as well."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import yaml

from actors.tp_worker import free_port

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy/prometheus/prometheus.yml"
BOARD = ROOT / "deploy/grafana/mbd.json"
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def available() -> bool:
    return shutil.which("prometheus") is not None


def scrape_interval_s() -> float:
    return float(yaml.safe_load(CONFIG.read_text())["global"]["scrape_interval"].removesuffix("s"))


@contextmanager
def prometheus(work: Path) -> Iterator[str]:
    """Prometheus on a free loopback port with the repository's config, its data and log in `work`; yields its
    URL once it is ready and ends it (by its pid) on exit."""
    port = free_port()
    log = (work / "prometheus.log").open("w")
    proc = subprocess.Popen(["prometheus", f"--config.file={CONFIG}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _ready(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start: {(work / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def query(url: str, expr: str) -> list[dict]:
    """An instant PromQL query's result (each {"metric": labels, "value": [t, "v"]})."""
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=30).json()
    assert r["status"] == "success", (expr, r)
    return r["data"]["result"]


def query_range(url: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    """A range query's result (each {"metric": labels, "values": [[t, "v"], ...]})."""
    r = httpx.get(f"{url}/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": step},
                  timeout=30).json()
    assert r["status"] == "success", (expr, r)
    return r["data"]["result"]


def targets(url: str) -> list[dict]:
    return httpx.get(f"{url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]


def model_choices(url: str) -> list[str]:
    """What the board's `model` variable lists: its label_values() query, as Grafana asks it."""
    var = next(v for v in json.loads(BOARD.read_text())["templating"]["list"] if v["name"] == "model")
    series, label = var["definition"].removeprefix("label_values(").removesuffix(")").split(", ")
    r = httpx.get(f"{url}/api/v1/label/{label}/values", params={"match[]": series}, timeout=10).json()
    return r["data"]


def panel_targets(model: str, step_s: float) -> list[tuple[str, str, str]]:
    """(panel title, legend format, PromQL) of every target of the board, `$model` set to `model` (".*": all) and
    `$__rate_interval` to Grafana's: max(4 scrape intervals, step + 1 scrape interval)."""
    rate = max(4 * scrape_interval_s(), step_s + scrape_interval_s())
    return [(p["title"], t["legendFormat"],
             t["expr"].replace("$model", model).replace("$__rate_interval", f"{rate:g}s"))
            for p in json.loads(BOARD.read_text())["panels"] for t in p["targets"]]


def names_histogram(expr: str) -> bool:
    """Whether a target reads a histogram: those have no series before the first observation."""
    return any(s in expr for s in HISTOGRAM_SERIES)
