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

from mbd.config import ConfigError
from serve_app.config import load_serve_config


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mbd serve", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="a configs/serve/*.yaml file")
    p.add_argument("--host", help="override http.host (0.0.0.0 exposes the server beyond this machine)")
    p.add_argument("--port", type=int, help="override http.port")
    p.add_argument("--model", "--model-path", dest="model_path",
                   help="override model.path: a checkpoint directory or a Hugging Face Hub id ORG/NAME[@REVISION]")
    p.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else start a local one)")
    p.add_argument("--name", default="mbd", help="Serve application name")
    return p.parse_args(argv)


def _stop(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_serve_config(args.config)
    except ConfigError as e:
        print(f"mbd serve: {e}", file=sys.stderr)
        return 2
    http = cfg.http.model_copy(update={k: v for k, v in (("host", args.host), ("port", args.port)) if v})
    http.api_key = http.api_key or os.environ.get("MBD_API_KEY") or None
    model = cfg.model.model_copy(update={"path": args.model_path} if args.model_path else {})
    cfg = cfg.model_copy(update={"http": http, "model": model})
    try:
        model_dir = cfg.model.resolved_path()
    except ConfigError as e:
        print(f"mbd serve: {e}", file=sys.stderr)
        return 2
    if not (model_dir / "config.json").is_file():
        print(f"mbd serve: model.path {cfg.model.path} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    if http.host not in {"127.0.0.1", "localhost", "::1"} and not http.api_key:
        print(f"mbd serve: warning: listening on {http.host} without an API key (set MBD_API_KEY)", file=sys.stderr)

    import ray
    from ray import serve

    from serve_app.app import build_app

    signal.signal(signal.SIGTERM, _stop)
    # "local": a new instance; ray.init() alone would join whatever Ray instance runs on this machine
    ray.init(address=args.address or os.environ.get("RAY_ADDRESS") or "local")
    try:
        serve.start(http_options={"host": http.host, "port": http.port})
        serve.run(build_app({"serve_config": cfg}), name=args.name, route_prefix=http.route_prefix)
        url = f"http://{http.host}:{http.port}{http.route_prefix.rstrip('/')}/v1"
        print(f"mbd serve: '{cfg.model.name}' at {url} (Ctrl-C to stop)", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("mbd serve: shutting down", file=sys.stderr)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
