"""The pieces that put the metrics where operators look, without Ray: `GET /metrics`' merge of the nodes'
expositions, the 0 every counter and gauge is declared at, the service discovery file, and `mbd serve` refusing a
metrics port it cannot have, by name. Against a real cluster and a real Prometheus:
tests/integration/test_serve_metrics_scrape.py."""

import json
import socket
import time
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from pipelines import metrics_sd, serve as serve_cmd
from serve_app import exposition, metrics
from serve_app.errors import ENDPOINTS

NODE_A = """# HELP ray_mbd_engine_restarts_total engine processes restarted
# TYPE ray_mbd_engine_restarts_total counter
ray_mbd_engine_restarts_total{application="app",model_name="m",replica="a"} 0.0
ray_mbd_engine_restarts_total{application="other",model_name="o",replica="x"} 2.0
# HELP ray_node_cpu_utilization Ray's own
# TYPE ray_node_cpu_utilization gauge
ray_node_cpu_utilization{ip="a"} 12.0
# HELP ray_mbd_tokens_per_forward TPF
# TYPE ray_mbd_tokens_per_forward histogram
ray_mbd_tokens_per_forward_bucket{application="app",le="1.0"} 1.0
ray_mbd_tokens_per_forward_bucket{application="app",le="+Inf"} 2.0
ray_mbd_tokens_per_forward_count{application="app"} 2.0
ray_mbd_tokens_per_forward_sum{application="app"} 3.5
"""
NODE_B = """# HELP ray_mbd_engine_restarts_total engine processes restarted
# TYPE ray_mbd_engine_restarts_total counter
ray_mbd_engine_restarts_total{application="app",model_name="m",replica="b"} 1.0
# HELP ray_mbd_num_requests_running rows
# TYPE ray_mbd_num_requests_running gauge
ray_mbd_num_requests_running{application="app",model_name="m \\"q\\""} 0.0
"""


def test_merge_keeps_one_apps_series_one_family_each():
    text = exposition.merge([NODE_A, NODE_B], "app").decode()
    samples = {(s.name, s.labels.get("replica")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("ray_mbd_engine_restarts_total", "a")] == 0 and samples[("ray_mbd_engine_restarts_total", "b")] == 1
    assert samples[("ray_mbd_tokens_per_forward_count", None)] == 2
    assert samples[("ray_mbd_num_requests_running", None)] == 0
    assert "other" not in text and "ray_node_" not in text
    families = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert sorted(families) == ["ray_mbd_engine_restarts_total", "ray_mbd_num_requests_running",
                                "ray_mbd_tokens_per_forward"]


def test_merge_of_nothing_is_an_empty_exposition():
    assert exposition.merge([NODE_A], "absent") == b""


class Recorded:
    """A stand-in for Ray's metric classes (they need a Ray worker): what each series was recorded at."""

    made: dict[str, "Recorded"] = {}

    def __init__(self, name, description="", boundaries=None, tag_keys=()):
        self.name, self.values = name, {}
        Recorded.made[name] = self

    def set_default_tags(self, tags):
        return self

    def _record(self, value, tags=None):
        self.values[tuple(sorted((tags or {}).items()))] = value

    set = _record


def test_every_counter_and_gauge_is_declared_at_zero(monkeypatch):
    Recorded.made = {}
    for kind in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics, kind, type(kind, (Recorded,), {}))
    metrics.IngressMetrics("m").declare(ENDPOINTS)
    metrics.DecoderMetrics("m").declare()
    plain = {n: m for n, m in Recorded.made.items() if type(m).__name__ != "Histogram"}
    assert {n for n, m in plain.items() if not m.values} == set()
    assert all(v == 0 for m in plain.values() for v in m.values.values())
    assert {dict(k)["endpoint"] for k in plain["mbd_http_requests"].values} == set(ENDPOINTS)
    assert {"mbd_engine_restarts", "mbd_requests_quarantined"} <= plain.keys()
    assert all(not m.values for m in Recorded.made.values() if type(m).__name__ == "Histogram")  # no observation


def test_decoder_gauges_are_recorded_again_while_idle(monkeypatch):
    """Ray's agent drops a gauge that is not recorded again within 2 export intervals: an idle engine's 0 stays."""
    Recorded.made = {}
    for kind in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics, kind, type(kind, (Recorded,), {}))
    monkeypatch.setattr(metrics, "GAUGE_REFRESH_S", 0.01)
    m = metrics.DecoderMetrics("m")
    m.declare()
    m.update({"running": 3, "waiting": 0, "kv_pages_used": 0, "kv_pages": 8, "steps": 0, "engine_pid": 1,
              **dict.fromkeys(("step_s", "grammar_s", "decode_rows", "active_blocks", "resident_blocks",
                               "buffer_size", "preemptions", "prefix_query_tokens", "prefix_hit_tokens"), 0)})
    running = Recorded.made["mbd_num_requests_running"]
    running.values.clear()
    deadline = time.monotonic() + 10  # polled: a loaded machine may run the refresh thread late
    while not running.values and time.monotonic() < deadline:
        time.sleep(0.01)
    assert running.values == {(): 3}


def test_discovery_file_is_rays_format_at_rays_paths(tmp_path, monkeypatch):
    import ray

    (tmp_path / "session_1").mkdir()
    ctx = SimpleNamespace(get_temp_dir=lambda: str(tmp_path), get_session_name=lambda: "session_1")
    monkeypatch.setattr(ray, "get_runtime_context", lambda: ctx)
    nodes = ["10.0.0.1:8080"]
    monkeypatch.setattr(metrics_sd, "export_addresses", lambda: list(nodes))
    sd = metrics_sd.ServiceDiscovery()
    sd.refresh()
    assert sd.link == tmp_path / metrics_sd.SD_FILE and sd.link.resolve() == tmp_path / "session_1" / metrics_sd.SD_FILE
    assert json.loads(sd.link.read_text()) == [{"labels": {"job": "ray"}, "targets": ["10.0.0.1:8080"]}]
    nodes.append("10.0.0.2:8080")  # a node joined
    sd.refresh()
    assert json.loads(sd.link.read_text())[0]["targets"] == nodes
    assert sorted(p.name for p in (tmp_path / "session_1").iterdir()) == [metrics_sd.SD_FILE]  # no temporary left


def test_metrics_port_clash_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert f"metrics.port {taken} is in use" in serve_cmd.metrics_port_clash(taken, 8000)
    assert "is http.port too" in serve_cmd.metrics_port_clash(8000, 8000)


def test_mbd_serve_refuses_a_taken_metrics_port_before_starting_ray(capsys):
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert serve_cmd.main(["--config", "configs/serve/tiny.yaml", "--metrics-port", str(taken)]) == 2
    assert f"mbd serve: metrics.port {taken} is in use" in capsys.readouterr().err


def test_metrics_port_defaults_to_kuberays():
    from serve_app.config import ServeConfig

    assert ServeConfig.model_validate({"model": {"path": "x"}}).metrics.port == 8080
