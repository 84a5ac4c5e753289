"""`mbd serve --config configs/serve/tiny.yaml`: deploy the OpenAI-compatible app and serve until Ctrl-C.

Starts a local Ray instance (or joins `--address` / RAY_ADDRESS), binds HTTP to the config's host (loopback
by default) and tears everything down on Ctrl-C or SIGTERM. The console keeps this command's own lines (the
engine, the URLs, warnings that need the user's action); Ray's and HAProxy's start-up logging goes to
`<--log-dir>/ray.log` (pipelines/ray_session.py). On Kubernetes the same app is deployed by the
RayService in deploy/rayservice.yaml instead.

Metrics where operators look: a local cluster exports Ray's metrics on `metrics.port` (8080, as KubeRay's nodes;
`--metrics-port`), writes Prometheus' service discovery file for deploy/prometheus/prometheus.yml
(pipelines/metrics_sd.py) and, when ready, prints the scrape URLs; the app's own series are also at `GET /metrics`
on the API port.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from mbd.config import ConfigError
from mbd.plan_check import check_serve
from mbd.training_record import multibd_warning
from pipelines.ray_session import port_is_free
from serve_app.config import ServeConfig, load_serve_config

if TYPE_CHECKING:
    from pipelines.metrics_sd import ServiceDiscovery

SD_REFRESH_S = 5.0  # how often the discovery file follows nodes joining and leaving (as Ray's dashboard does)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mbd serve", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="a configs/serve/*.yaml file")
    p.add_argument("--host", help="override http.host (0.0.0.0 exposes the server beyond this machine)")
    p.add_argument("--port", type=int, help="override http.port")
    p.add_argument("--metrics-port", type=int,
                   help="override metrics.port: Ray's metrics export port of the local cluster (default 8080)")
    p.add_argument("--model", "--model-path", dest="model_path",
                   help="override model.path: a checkpoint directory or a Hugging Face Hub id ORG/NAME[@REVISION]")
    p.add_argument("--cache", help="override engine.compile_cache (a folder `mbd warmup` filled)")
    p.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else start a local one)")
    p.add_argument("--name", default="mbd", help="Serve application name")
    p.add_argument("--log-dir", default="runs/serve",
                   help="where Ray's driver-side logging goes (ray.log); the console keeps this command's lines")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set engine.attention=flex")
    return p.parse_args(argv)


def _stop(*_: object) -> None:
    raise KeyboardInterrupt


def metrics_port_clash(port: int, http_port: int) -> str | None:
    """Why the local cluster cannot export its metrics on `port`, or None. Checked before Ray starts: a taken port
    fails the node's metrics agent later, far from its cause."""
    if port == http_port:
        return f"metrics.port {port} is http.port too: give one of them another port (--metrics-port, --port)"
    if not port_is_free(port, reuse_addr=True):
        return (f"metrics.port {port} is in use (another `mbd serve` or Ray node on this machine?): free it or "
                f"pass --metrics-port PORT")
    return None


def _config(args: argparse.Namespace) -> ServeConfig:
    """The serve config with the command's overrides, checked before Ray starts (raises ConfigError naming why)."""
    sets = args.sets + ([f"metrics.port={args.metrics_port}"] if args.metrics_port is not None else [])
    cfg = load_serve_config(args.config, sets)
    http = cfg.http.model_copy(update={k: v for k, v in (("host", args.host), ("port", args.port)) if v})
    http.api_key = http.api_key or os.environ.get("MBD_API_KEY") or None
    model = cfg.model.model_copy(update={"path": args.model_path} if args.model_path else {})
    engine = cfg.engine.model_copy(update={"compile_cache": args.cache} if args.cache else {})
    cfg = cfg.model_copy(update={"http": http, "model": model, "engine": engine})
    if not (cfg.model.resolved_path() / "config.json").is_file():
        raise ConfigError(f"model.path {cfg.model.path} is not a model directory (no config.json)")
    # refuse before loading (and before Ray starts) a deployment whose ranks cannot hold it
    check_serve(cfg.model.path, cfg.engine, cfg.model.tensor_parallel_size, cfg.decode)
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = _config(args)
    except ConfigError as e:
        print(f"mbd serve: {e}", file=sys.stderr)
        return 2
    http = cfg.http
    if http.host not in {"127.0.0.1", "localhost", "::1"} and not http.api_key:
        print(f"mbd serve: warning: listening on {http.host} without an API key (set MBD_API_KEY)", file=sys.stderr)
    if warning := multibd_warning(cfg.model.resolved_path(), cfg.model.path, cfg.decode.buffer_size):
        print(f"mbd serve: warning: {warning}", file=sys.stderr)

    from pipelines.ray_session import named_address

    local = named_address(args.address) is None
    if local and (clash := metrics_port_clash(cfg.metrics.port, http.port)):
        print(f"mbd serve: {clash}", file=sys.stderr)
        return 2

    print(f"mbd serve: {cfg.engine.summary()}", flush=True)
    from ray import serve

    from pipelines.metrics_sd import ServiceDiscovery
    from pipelines.ray_session import ray_session
    from serve_app.app import build_app
    from serve_app.exposition import export_addresses

    signal.signal(signal.SIGTERM, _stop)
    # a new local cluster unless one is named (never a leftover); on exit every process it started has ended
    with ray_session(Path(args.log_dir).resolve(), address=args.address,
                     **({"_metrics_export_port": cfg.metrics.port} if local else {})) as started, _serving():
        serve.start(http_options={"host": http.host, "port": http.port})
        serve.run(build_app({"serve_config": cfg}), name=args.name, route_prefix=http.route_prefix)
        sd = ServiceDiscovery() if started else None  # a joined cluster's dashboard writes its own
        if sd is not None:
            _refresh(sd)
        base = f"http://{http.host}:{http.port}{http.route_prefix.rstrip('/')}"
        nodes = ", ".join(f"http://{a}/metrics" for a in export_addresses())
        found = f"; Prometheus file_sd: {sd.link}" if sd is not None else ""
        print(f"mbd serve: metrics at {base}/metrics (this app's series) and Ray's export {nodes}{found}", flush=True)
        print(f"mbd serve: '{cfg.model.name}' at {base}/v1 (Ctrl-C to stop)", flush=True)
        while True:
            time.sleep(SD_REFRESH_S)
            if sd is not None:
                _refresh(sd)
    return 0


def _refresh(sd: ServiceDiscovery) -> None:
    """The discovery file brought up to date; a refresh that fails (the GCS busy, the disk full) is reported and
    the next one retries, while the service goes on."""
    try:
        sd.refresh()
    except Exception as e:  # noqa: BLE001 - whatever it was, serving must not stop for it
        print(f"mbd serve: warning: {sd.path} not refreshed: {e!r}", file=sys.stderr, flush=True)


@contextmanager
def _serving() -> Iterator[None]:
    from ray import serve

    try:
        yield
    except KeyboardInterrupt:
        print("mbd serve: shutting down", file=sys.stderr)
    finally:
        serve.shutdown()


if __name__ == "__main__":
    sys.exit(main())
