"""deploy/grafana/mbd.json charts exactly the metrics the service exports, under the names Ray's exporter gives
them (`ray_` in front, `_total` after a counter; a histogram's `_bucket` / `_sum` / `_count`), and every one of
them; the Prometheus config reads Ray's service discovery file."""

import json
import re
from pathlib import Path

import yaml

from serve_app import metrics

ROOT = Path(__file__).resolve().parents[2]


def exported(monkeypatch) -> dict[str, set[str]]:
    """Each metric's name -> the series names the scrape shows for it."""
    made: dict[str, set[str]] = {}

    def kind(suffixes):
        class Recorder:
            def __init__(self, name, description="", boundaries=None, tag_keys=()):
                assert "model_name" in tag_keys
                made[name] = {f"ray_{name}{s}" for s in suffixes}

            def set_default_tags(self, tags):
                pass
        return Recorder

    monkeypatch.setattr(metrics, "Counter", kind(["_total"]))
    monkeypatch.setattr(metrics, "Gauge", kind([""]))
    monkeypatch.setattr(metrics, "Histogram", kind(["_bucket", "_sum", "_count"]))
    metrics.IngressMetrics("m")
    metrics.DecoderMetrics("m")
    return made


def test_panels_use_exported_names_and_chart_every_metric(monkeypatch):
    made = exported(monkeypatch)
    board = json.loads((ROOT / "deploy/grafana/mbd.json").read_text())
    used = {n for p in board["panels"] for t in p["targets"] for n in re.findall(r"ray_mbd_\w+", t["expr"])}
    assert used <= set().union(*made.values()), used - set().union(*made.values())
    assert {name for name, series in made.items() if not series & used} == set()
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    assert all(t["datasource"]["uid"] == "${datasource}" for p in board["panels"] for t in p["targets"])


def test_prometheus_config_reads_rays_service_discovery_file():
    cfg = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    (job,) = cfg["scrape_configs"]
    assert job["file_sd_configs"][0]["files"] == ["/tmp/ray/prom_metrics_service_discovery.json"]
