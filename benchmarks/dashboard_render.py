"""The dashboard's panels from a real local run under load, drawn with matplotlib (no Grafana here): a local Ray
cluster serves the embedded tiny model, client threads send a mix of requests for `--seconds` (plain and
streamed, a shared prefix, structured output, some refused), a real Prometheus (Debian's `prometheus` binary)
scrapes every node's metrics export port with deploy/prometheus/prometheus.yml, and each panel of
deploy/grafana/mbd.json is its PromQL evaluated by that Prometheus over the run (`$model` = all,
`$__rate_interval` = 20 s).

The clusters `mbd` and the tests start run without Ray's dashboard, which is what writes the service discovery
file; this script writes one of the same format (targets: the nodes' export ports) and points the config at it.

    python -m benchmarks.dashboard_render --out docs/img/dashboard-tiny.png --seconds 240
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.tp_worker import free_port  # noqa: E402
from serve_app.config import load_serve_config  # noqa: E402
from tests.integration.multinode import LocalCluster  # noqa: E402
from tests.integration.scrape import export_ports  # noqa: E402

SCRAPE_S = 2
SHARED = "You are a careful assistant. Answer in one short line. " * 4


def body(rng: random.Random) -> dict:
    """One request of the mix: mostly plain, some streamed, some structured, a few refused (by field)."""
    b = {"model": "mbd-tiny", "prompt": SHARED + f"{rng.randint(1, 99)} + {rng.randint(1, 99)} =",
         "max_tokens": rng.choice([8, 16, 32, 64])}
    kind = rng.random()
    if kind < 0.2:
        b |= {"stream": True}
    elif kind < 0.35:
        b |= {"guided_choice": ["yes", "no", "maybe"]}
    elif kind < 0.37:
        b |= {"max_tokens": -1}
    elif kind < 0.38:
        b |= {"temperature": -2}
    return b


def load(url: str, until: float, seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=120) as c:
        while time.monotonic() < until:
            b = body(rng)
            if b.get("stream"):
                with c.stream("POST", url, json=b) as r:
                    for _ in r.iter_lines():
                        pass
            else:
                c.post(url, json=b)


def start_prometheus(work: Path, ports: list[int]) -> tuple[subprocess.Popen, int]:
    """Prometheus on a free port with the repository's config, its discovery file pointed at `ports`."""
    sd = work / "prom_metrics_service_discovery.json"
    sd.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": [f"127.0.0.1:{p}" for p in ports]}]))
    cfg = (ROOT / "deploy/prometheus/prometheus.yml").read_text()
    cfg = cfg.replace("/tmp/ray/prom_metrics_service_discovery.json", str(sd)).replace("10s", f"{SCRAPE_S}s")
    (work / "prometheus.yml").write_text(cfg)
    port = free_port()
    proc = subprocess.Popen(["prometheus", f"--config.file={work / 'prometheus.yml'}",
                             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, port


def query(prom: int, expr: str, start: float, end: float) -> list[tuple[str, list[float], list[float]]]:
    """(series labels, times, values) of a PromQL range query."""
    expr = expr.replace('"$model"', '".*"').replace("$__rate_interval", "20s")
    r = httpx.get(f"http://127.0.0.1:{prom}/api/v1/query_range",
                  params={"query": expr, "start": start, "end": end, "step": SCRAPE_S}, timeout=30).json()
    assert r["status"] == "success", (expr, r)
    return [(json.dumps(s["metric"]), [float(t) - start for t, _ in s["values"]],
             [float(v) for _, v in s["values"]]) for s in r["data"]["result"]]


def legend(fmt: str, labels: str) -> str:
    lab = json.loads(labels)
    for k, v in lab.items():
        fmt = fmt.replace("{{" + k + "}}", v.rsplit("#", 1)[-1][:12])
    return fmt


def render(prom: int, start: float, end: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = json.loads((ROOT / "deploy/grafana/mbd.json").read_text())["panels"]
    fig, axes = plt.subplots((len(panels) + 2) // 3, 3, figsize=(18, 3.2 * ((len(panels) + 2) // 3)))
    for ax, panel in zip(axes.flat, panels):
        for t in panel["targets"]:
            for labels, xs, ys in query(prom, t["expr"], start, end):
                ax.plot(xs, ys, label=legend(t["legendFormat"], labels))
        ax.set_title(panel["title"], fontsize=10)
        ax.set_xlabel("s into the run", fontsize=8)
        ax.tick_params(labelsize=8)
        if ax.lines:
            ax.legend(fontsize=7, loc="upper left")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("deploy/grafana/mbd.json panels, evaluated by Prometheus over a local tiny-model run and drawn "
                 "with matplotlib (not a Grafana screenshot)", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "docs/img/dashboard-tiny.png")
    ap.add_argument("--seconds", type=float, default=240)
    ap.add_argument("--clients", type=int, default=4)
    a = ap.parse_args()
    from ray import serve

    from serve_app.app import build_app

    # a busy machine can take longer than Serve's 5 s to ready its proxy
    cluster = LocalCluster(head_cpus=2, object_store_mb=300).start(env={"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"})
    prom = None
    try:
        cluster.connect()
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"serve_config": load_serve_config(ROOT / "configs/serve/tiny.yaml")}), name="tiny")
        with tempfile.TemporaryDirectory(prefix="mbd-prom-") as work:
            prom, prom_port = start_prometheus(Path(work), export_ports())
            start = time.time()
            until = time.monotonic() + a.seconds
            threads = [threading.Thread(target=load, args=(f"http://127.0.0.1:{port}/v1/completions", until, i))
                       for i in range(a.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            time.sleep(4 * SCRAPE_S + 10)  # the metrics agent's export, then a scrape
            render(prom_port, start, time.time(), a.out)
            print(f"wrote {a.out}")
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait()
        cluster.shutdown()


if __name__ == "__main__":
    main()
