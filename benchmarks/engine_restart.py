"""A decoder replica whose engine process (or the replica itself) is SIGKILLed under streaming load, measured.

The tiny service (configs/serve/tiny.yaml, the embedded model) on a local Ray cluster: --clients closed-loop
streaming chat clients send --requests requests each (held-out tinymath problems); --kill-at seconds after the load
starts the benchmark SIGKILLs the decoder replica's engine process (--kill engine), the replica process itself
(--kill replica) or nothing (--kill none); several --kill-at times kill once at each (the engine of that moment).
Each request is counted once: ok; failed in-band (finish_reason "error", an error event, [DONE]); 503 (with or
without Retry-After; a client does not retry it here); or unclean (anything else). Printed: the counts, and per
kill (up to the next) the requests in flight at it, the span of its 503s and the seconds from it to the first
content after it of a request that was in flight without output (`kept_answering_s`), to the first content of a
request sent after it and to /health "ok" again (None: not before the next kill or the end); the replica's own
counts (requests re-admitted, those resumed from their clients' tokens, restarts, quarantined); a JSON line.

    python -m benchmarks.engine_restart                      # 64 clients x 24 requests, engine killed at 5 s
    python -m benchmarks.engine_restart --kill-at 5 20       # killed twice (issue 59's target: 0 x 500)
    python -m benchmarks.engine_restart --kill replica       # the whole replica instead (Serve replaces it)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import psutil

from actors.tp_worker import free_port
from mbd.tiny.task import generate as tiny_problems
from pipelines.ray_session import init_ray
from serve_app.config import ServeConfig, load_serve_config

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "serve" / "tiny.yaml"))
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=24, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kill", choices=("engine", "replica", "none"), default="engine")
    p.add_argument("--kill-at", type=float, nargs="+", default=[5.0], help="seconds after the load starts, one "
                   "kill at each")
    p.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray instance")
    return p.parse_args(argv)


async def one_request(http: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streaming chat request: outcome ('ok', 'in-band', '503', '503 without Retry-After', 'unclean: ...'),
    start, end, and when its first content arrived (None: never)."""
    rec: dict = {"start": time.monotonic(), "first": None}
    try:
        async with http.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                rec["outcome"] = ("503" if r.headers.get("retry-after") else "503 without Retry-After") \
                    if r.status_code == 503 else f"unclean: HTTP {r.status_code}"
            else:
                done, error = False, False
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: {"):
                        ev = json.loads(line[6:])
                        error = error or "error" in ev
                        if rec["first"] is None and any(c["delta"].get("content") for c in ev.get("choices", [])):
                            rec["first"] = time.monotonic()
                rec["outcome"] = "unclean: no [DONE]" if not done else "in-band" if error else "ok"
    except httpx.HTTPError as e:
        rec["outcome"] = f"unclean: {type(e).__name__}"
    rec["end"] = time.monotonic()
    return rec


def victim(kind: str) -> int:
    """The pid to SIGKILL: the decoder replica's, or its engine process's."""
    from ray import serve

    replica = serve.get_deployment_handle("Decoder", app_name="bench").stats.remote().result()["pid"]
    if kind == "replica":
        return replica
    return next(p.pid for p in psutil.Process(replica).children() if "actors.engine_process" in " ".join(p.cmdline()))


async def load(args: argparse.Namespace, base: str, model: str) -> tuple[list[dict], list[tuple], list[float]]:
    """Run the clients; kill at each --kill-at; poll /health every 0.1 s. Returns the requests, the probes and the
    kill times."""
    questions = [r["question"] for r in tiny_problems("heldout", args.clients * args.requests, seed=0)]
    records: list[dict] = []
    health: list[tuple] = []
    killed: list[float] = []
    stop = asyncio.Event()

    async def client(k: int, http: httpx.AsyncClient) -> None:
        for j in range(args.requests):
            body = {"model": model, "messages": [{"role": "user", "content": questions[k * args.requests + j]}],
                    "max_tokens": args.max_tokens, "stream": True}
            records.append(await one_request(http, f"{base}/v1/chat/completions", body))

    async def probe(http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            try:
                r = await http.get(f"{base}/health")
                health.append((time.monotonic(), r.status_code, r.json().get("status")))
            except httpx.HTTPError as e:
                health.append((time.monotonic(), type(e).__name__, None))
            await asyncio.sleep(0.1)

    async def kill() -> None:
        t0 = time.monotonic()
        for at in sorted(args.kill_at):
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            pid = await asyncio.to_thread(victim, args.kill)
            killed.append(time.monotonic())
            os.kill(pid, signal.SIGKILL)

    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        prober = asyncio.create_task(probe(http))
        killer = asyncio.create_task(kill()) if args.kill != "none" else None
        await asyncio.gather(*(client(k, http) for k in range(args.clients)))
        stop.set()
        await prober
        if killer is not None:
            killer.cancel()
    return records, health, killed


def summarize(records: list[dict], health: list[tuple], kills: list[float]) -> dict:
    """The counts, and the times the docstring lists per kill (each measured up to the next kill)."""
    count = {o: sum(r["outcome"] == o for r in records) for o in sorted({r["outcome"] for r in records})}
    out: dict = {"requests": len(records), "outcomes": count}
    out["503_without_retry_after"] = count.get("503 without Retry-After", 0)
    out["kills"] = [_after_kill(records, health, killed, until)
                    for killed, until in zip(kills, [*kills[1:], float("inf")])]
    return out


def _span_503(records: list[dict], since: float, until: float) -> float:
    t503 = sorted(r["end"] for r in records if r["outcome"].startswith("503") and since <= r["end"] < until)
    return round(t503[-1] - t503[0], 2) if t503 else 0.0


def _after_kill(records: list[dict], health: list[tuple], killed: float, until: float) -> dict:
    """One kill, up to the next: in flight at it, the 503s' span, and the seconds to answering again (None: not
    before the next kill or the end)."""
    out = {"in_flight": sum(r["start"] <= killed < r["end"] for r in records),
           "span_503_s": _span_503(records, killed, until)}
    kept = [r["first"] for r in records if r["start"] <= killed < r["end"] and r["outcome"] == "ok"
            and r["first"] is not None and killed < r["first"] < until]  # no output from the killed engine
    out["kept_answering_s"] = round(min(kept) - killed, 2) if kept else None
    after = [r["first"] for r in records if killed < r["start"] < until and r["first"] is not None]
    out["answering_new_s"] = round(min(after) - killed, 2) if after else None
    window = [(t, code, status) for t, code, status in health if killed < t < until]
    down = [t for t, code, status in window if code != 200 or status != "ok"]
    ok_again = [t for t, code, status in window if down and t > down[-1] and code == 200 and status == "ok"]
    out["health_ok_again_s"] = round(ok_again[0] - killed, 2) if ok_again else None if down else 0.0
    out["health_states"] = sorted({str(s) for _, _, s in window})
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg: ServeConfig = load_serve_config(args.config)
    import ray
    from ray import serve

    from serve_app.app import build_app

    init_ray(num_cpus=args.cpus, logging_level="ERROR", log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"serve_config": cfg}), name="bench", route_prefix="/")
        t0 = time.monotonic()
        records, health, killed = asyncio.run(load(args, f"http://127.0.0.1:{port}", cfg.model.name))
        wall = time.monotonic() - t0
        stats = serve.get_deployment_handle("Decoder", app_name="bench").stats.remote().result()
    finally:
        serve.shutdown()
        ray.shutdown()
    out = summarize(records, health, killed) | {"kill": args.kill, "wall_s": round(wall, 1), "load": os.getloadavg()[0]}
    out["replica"] = {k: stats.get(k)
                      for k in ("engine_restarts", "readmitted", "resumed", "quarantined")}
    at = ", ".join(f"{t:.0f}" for t in sorted(args.kill_at))
    print(f"{args.clients} clients x {args.requests} streaming requests (max_tokens {args.max_tokens}), kill "
          f"{args.kill} at {at} s: {out['outcomes']} ({out['503_without_retry_after']} 503s without Retry-After); replica {out['replica']}; wall {out['wall_s']} s, "
          f"load {out['load']:.1f}")
    for k, after in enumerate(out["kills"], 1):
        print(f"  kill {k}: in flight {after['in_flight']}; a kept request answering after "
              f"{after['kept_answering_s']} s, a new one after {after['answering_new_s']} s, /health ok again after "
              f"{after['health_ok_again_s']} s, 503 span {after['span_503_s']} s")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
