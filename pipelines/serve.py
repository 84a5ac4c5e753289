"""`mbd serve --config configs/serve/tiny.yaml`: deploy the OpenAI-compatible app and serve until Ctrl-C.

Starts a local Ray instance (or joins `--address` / RAY_ADDRESS), binds HTTP to the config's host (loopback
by default) and tears everything down on Ctrl-C or SIGTERM. On Kubernetes the same app is deployed by the
RayService in deploy/rayservice.yaml instead.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from contextlib import contextmanager
from typing import Iterator

from mbd.config import ConfigError
from mbd.plan_check import check_serve
from serve_app.config import load_serve_config


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mbd serve", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="a configs/serve/*.yaml file")
    p.add_argument("--host", help="override http.host (0.0.0.0 exposes the server beyond this machine)")
    p.add_argument("--port", type=int, help="override http.port")
    p.add_argument("--model", "--model-path", dest="model_path",
                   help="override model.path: a checkpoint directory or a Hugging Face Hub id ORG/NAME[@REVISION]")
    p.add_argument("--cache", help="override engine.compile_cache (a folder `mbd warmup` filled)")
    p.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else start a local one)")
    p.add_argument("--name", default="mbd", help="Serve application name")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set engine.attention=flex")
    return p.parse_args(argv)


def _stop(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_serve_config(args.config, args.sets)
    except ConfigError as e:
        print(f"mbd serve: {e}", file=sys.stderr)
        return 2
    http = cfg.http.model_copy(update={k: v for k, v in (("host", args.host), ("port", args.port)) if v})
    http.api_key = http.api_key or os.environ.get("MBD_API_KEY") or None
    model = cfg.model.model_copy(update={"path": args.model_path} if args.model_path else {})
    engine = cfg.engine.model_copy(update={"compile_cache": args.cache} if args.cache else {})
    cfg = cfg.model_copy(update={"http": http, "model": model, "engine": engine})
    try:
        model_dir = cfg.model.resolved_path()
    except ConfigError as e:
        print(f"mbd serve: {e}", file=sys.stderr)
        return 2
    if not (model_dir / "config.json").is_file():
        print(f"mbd serve: model.path {cfg.model.path} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    try:  # refuse before loading (and before Ray starts) a deployment whose ranks cannot hold it
        check_serve(cfg.model.path, cfg.engine, cfg.model.tensor_parallel_size, cfg.decode)
    except ConfigError as e:
        print(f"mbd serve: {e}", file=sys.stderr)
        return 2
    if http.host not in {"127.0.0.1", "localhost", "::1"} and not http.api_key:
        print(f"mbd serve: warning: listening on {http.host} without an API key (set MBD_API_KEY)", file=sys.stderr)

    print(f"mbd serve: {cfg.engine.summary()}", flush=True)
    from ray import serve

    from pipelines.ray_session import ray_cluster
    from serve_app.app import build_app

    signal.signal(signal.SIGTERM, _stop)
    # a new local cluster unless one is named (never a leftover); on exit every process it started has ended
    with ray_cluster(args.address), _serving():
        serve.start(http_options={"host": http.host, "port": http.port})
        serve.run(build_app({"serve_config": cfg}), name=args.name, route_prefix=http.route_prefix)
        url = f"http://{http.host}:{http.port}{http.route_prefix.rstrip('/')}/v1"
        print(f"mbd serve: '{cfg.model.name}' at {url} (Ctrl-C to stop)", flush=True)
        while True:
            time.sleep(3600)
    return 0


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
