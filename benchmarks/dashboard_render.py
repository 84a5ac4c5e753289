"""The dashboard's panels from a plain `mbd serve` under load, drawn with matplotlib (no Grafana here):
`mbd serve --config configs/serve/tiny.yaml` serves the embedded tiny model on a local cluster of its own (free
API and metrics ports), client threads send a mix of requests for `--seconds` (plain and streamed, a shared
prefix, structured output, some refused), a real Prometheus (Debian's `prometheus` package) runs with
deploy/prometheus/prometheus.yml as it is, finding the cluster through the service discovery file `mbd serve`
writes, and each panel of deploy/grafana/mbd.json is its PromQL evaluated by that Prometheus over the run as
Grafana would (`$model` = all, `$__rate_interval` = Grafana's for the config's scrape interval).

    python -m benchmarks.dashboard_render --out docs/img/dashboard-tiny.png --seconds 240
"""

from __future__ import annotations

import argparse
import collections
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.tp_worker import free_port  # noqa: E402
from tests.integration.prometheus import panel_targets, prometheus, query_range, scrape_interval_s  # noqa: E402

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


@contextmanager
def mbd_serve(port: int, metrics_port: int) -> Iterator[None]:
    """`mbd serve` on the tiny config as a user starts it, until it prints that it serves; SIGTERM on exit (it ends
    every process of its cluster)."""
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "serve", "--config", "configs/serve/tiny.yaml",
                             "--port", str(port), "--metrics-port", str(metrics_port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: collections.deque[str] = collections.deque(maxlen=40)
    try:
        for line in proc.stdout:
            tail.append(line)
            if line.startswith("mbd serve: "):
                print(line, end="", flush=True)
            if "Ctrl-C to stop" in line:
                break
        else:
            raise RuntimeError(f"mbd serve exited with {proc.wait()} before serving:\n{''.join(tail)}")
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain Ray's output
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(180)


def legend(fmt: str, labels: dict[str, str]) -> str:
    for k, v in labels.items():
        fmt = fmt.replace("{{" + k + "}}", v.rsplit("#", 1)[-1][:12])
    return fmt


def render(prom: str, start: float, end: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    step = scrape_interval_s()
    titles = list(dict.fromkeys(title for title, _, _ in panel_targets(".*", step)))
    fig, axes = plt.subplots((len(titles) + 2) // 3, 3, figsize=(18, 3.2 * ((len(titles) + 2) // 3)))
    axis = dict(zip(titles, axes.flat))
    for title, fmt, expr in panel_targets(".*", step):
        for series in query_range(prom, expr, start, end, step):
            xs = [float(t) - start for t, _ in series["values"]]
            axis[title].plot(xs, [float(v) for _, v in series["values"]], label=legend(fmt, series["metric"]))
    for title, ax in axis.items():
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("s into the run", fontsize=8)
        ax.tick_params(labelsize=8)
        if ax.lines:
            ax.legend(fontsize=7, loc="upper left")
    for ax in list(axes.flat)[len(titles):]:
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
    port = free_port()
    with mbd_serve(port, free_port()), tempfile.TemporaryDirectory(prefix="mbd-prom-") as work, \
            prometheus(Path(work)) as prom:
        start = time.time()
        until = time.monotonic() + a.seconds
        threads = [threading.Thread(target=load, args=(f"http://127.0.0.1:{port}/v1/completions", until, i))
                   for i in range(a.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(2 * scrape_interval_s() + 10)  # the metrics agent's export, then a scrape
        render(prom, start, time.time(), a.out)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
