"""Where a served request's time goes: per-request timestamps from the client, the ingress, the decoder replica and
its engine process (actors/trace.py, switched on by MBD_TRACE_DIR), joined by request id.

For 1, 8 and 32 closed-loop clients (tiny model, configs/serve/tiny.yaml, chat, ignore_eos, --max-tokens each) it
prints medians over requests of each hop, non-streaming and streaming:
  client -> ingress      HTTP proxy to the ingress handler
  convert                validation and tokenization in the ingress
  route                  ingress call -> decoder replica handler (Serve router, Ray task)
  hand-off               replica handler -> engine admits it (replica -> engine process)
  engine                 admitted -> last block committed (waiting for a row, prefill, decoding)
  back                   last commit -> its delta reaches the ingress (Ray stream)
  respond                ingress -> response (or last SSE event) leaves the handler
  -> client              handler -> client has the whole response
and, streaming, per committed block: commit -> ingress -> SSE event out -> client. For the engine: its busy
share of the wall time, and the share of wall time in which requests waited outside the engine (called, not yet
admitted) while the engine had a free batch row. And the CPU time per request of each process on the path
(HTTP proxy, ingress replica, decoder replica, its engine process): unlike latencies, it hardly depends on the
machine's load.

    python -m benchmarks.serve_breakdown [--concurrency 1 8 32] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx
import psutil

from actors.tp_worker import free_port
from mbd.tiny.task import generate as tiny_problems
from pipelines.ray_session import init_ray
from serve_app.config import load_serve_config

REPO = Path(__file__).resolve().parents[1]
HOPS = ("client->ingress", "convert", "route", "hand-off", "engine", "back", "respond", "->client")


async def clients(url: str, model: str, messages: list, conc: int, max_tokens: int, stream: bool) -> dict:
    """Closed-loop clients; per response id: send time, end time, and (stream) (time, tokens so far) per event."""
    todo, seen = list(messages), {}

    async def one(http: httpx.AsyncClient) -> None:
        while todo:
            body = {"model": model, "messages": todo.pop(), "max_tokens": max_tokens, "ignore_eos": True,
                    "stream": stream, "return_token_ids": True}
            t, events, rid, n = time.time(), [], None, 0
            if not stream:
                r = await http.post(url, json=body)
                r.raise_for_status()
                rid = r.json()["id"]
            else:
                async with http.stream("POST", url, json=body) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            ev = json.loads(line[6:])
                            rid = ev["id"]
                            n += sum(len(c.get("token_ids") or []) for c in ev["choices"])
                            events.append((time.time(), n))
            seen[rid] = {"send": t, "end": time.time(), "events": events}

    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        await asyncio.gather(*(one(http) for _ in range(conc)))
    return seen


def load_trace(d: Path) -> tuple[dict, list]:
    """Per request id: event -> list of (time, value); and the engine's ("step"|"idle", end time, duration)."""
    per: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    engine = []
    for f in d.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            t, rid, ev, v = json.loads(line)
            if rid == "-":
                engine.append((ev, t, v))
            else:
                per[rid][ev].append((t, v))
    return per, engine


def med_ms(xs: list[float]) -> float:
    return 1e3 * statistics.median(xs) if xs else float("nan")


def breakdown(client: dict, per: dict, engine: list, slots: int) -> dict:
    hops: dict[str, list[float]] = defaultdict(list)
    block: dict[str, list[float]] = defaultdict(list)
    windows = []  # (called, admitted, finished) per engine request
    for rid, c in client.items():
        h, e = per[rid], per[f"{rid}.0"]
        if not (h["recv"] and e["admit"] and e["commit"]):
            continue
        recv, call, arrive, admit = h["recv"][0][0], h["call"][0][0], e["arrive"][0][0], e["admit"][0][0]
        last_commit, last_delta = e["commit"][-1][0], e["delta"][-1][0]
        out = (e["sent"] or e["done"])[-1][0]
        for k, v in zip(HOPS, (recv - c["send"], call - recv, arrive - call, admit - arrive, last_commit - admit,
                               last_delta - last_commit, out - last_delta, c["end"] - out)):
            hops[k].append(v)
        windows.append((call, admit, last_commit))
        for t, n in e["commit"]:
            got = next((td for td, m in e["delta"] if m >= n), None)
            out_t = next((ts for ts, m in e["sent"] if m >= n), None)
            cl = next((tc for tc, m in c["events"] if m >= n), None)
            if got and out_t and cl:
                block["commit->ingress"].append(got - t)
                block["ingress->SSE out"].append(out_t - got)
                block["SSE out->client"].append(cl - out_t)
    t0 = min(c["send"] for c in client.values())
    t1 = max(c["end"] for c in client.values())
    busy = sum(d for ev, t, d in engine if ev == "step" and t0 <= t <= t1)
    starved = 0.0  # engine time (step or idle) in which a request waited outside while a row was free
    for ev, t, d in engine:
        if not t0 <= t <= t1:
            continue
        mid = t - d / 2
        waiting = sum(1 for call, admit, _ in windows if call <= mid < admit)
        inside = sum(1 for _, admit, end in windows if admit <= mid < end)
        if waiting and inside < slots:
            starved += d
    return {"hops_ms": {k: med_ms(v) for k, v in hops.items()}, "block_ms": {k: med_ms(v) for k, v in block.items()},
            "engine_busy": busy / (t1 - t0), "rows_free_while_waiting": starved / (t1 - t0),
            "requests": len(windows)}


def service_processes(app: str) -> dict[str, list[psutil.Process]]:
    """The processes on this Serve instance's request path: the HTTP proxy (HAProxy in Ray Serve's high-throughput
    mode, which starts a new process when it reloads its config, else Serve's Python proxy), the app's ingress and
    decoder replicas (Ray titles them ray::ServeReplica:<app>:<name>) and the decoder's engine process."""
    out: dict[str, list[psutil.Process]] = {}
    for p in psutil.process_iter(["cmdline", "ppid"]):
        title = " ".join(p.info["cmdline"] or [])
        for name in ("Decoder", "OpenAIIngress"):
            if title.startswith(f"ray::ServeReplica:{app}:{name}"):
                out[name] = [p]
    decoder = out["Decoder"][0]
    out["engine"] = [c for c in decoder.children() if "actors.engine_process" in " ".join(c.cmdline())]
    node = psutil.Process(decoder.info["ppid"]).children(recursive=True)
    out["proxy"] = [p for p in node if p.name() == "haproxy"] or [
        p for p in node if " ".join(p.cmdline()).startswith("ray::ProxyActor")]
    return out


def cpu_s(app: str) -> dict[str, dict[int, float]]:
    """CPU seconds so far of every process of `service_processes`, by pid."""
    out = {}
    for name, procs in service_processes(app).items():
        out[name] = {}
        for p in procs:
            try:
                out[name][p.pid] = sum(p.cpu_times()[:2])
            except psutil.NoSuchProcess:
                pass
    return out


def cpu_ms_per_request(before: dict, after: dict, requests: int) -> dict[str, float]:
    """CPU milliseconds per request of each part between two `cpu_s` readings (a process started in between
    counts whole; one that ended in between, such as an HAProxy replaced by a reload, is lost: a small part)."""
    return {k: 1e3 * sum(t - before.get(k, {}).get(pid, 0.0) for pid, t in v.items()) / requests
            for k, v in after.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "serve" / "tiny.yaml"))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--per-client", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--cpus", type=int, default=2)
    args = p.parse_args(argv)
    trace = Path(tempfile.mkdtemp(prefix="mbd_trace_"))
    os.environ["MBD_TRACE_DIR"] = str(trace)
    cfg = load_serve_config(args.config)
    n_max = max(max(16, c * args.per_client) for c in args.concurrency)
    messages = [[{"role": "user", "content": r["question"]}] for r in tiny_problems("heldout", n_max, seed=0)]

    import ray
    from ray import serve

    from serve_app.app import build_app

    init_ray(num_cpus=args.cpus, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"MBD_TRACE_DIR": str(trace)}})
    port = free_port()
    results = {}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"serve_config": cfg}), name="breakdown", route_prefix="/")
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        asyncio.run(clients(url, cfg.model.name, messages[:2], 2, args.max_tokens, False))  # warm-up
        proxy = service_processes("breakdown")["proxy"][0].name()
        for c in args.concurrency:
            for stream in (False, True):
                load, cpu0 = os.getloadavg()[0], cpu_s("breakdown")
                seen = asyncio.run(clients(url, cfg.model.name, messages[:max(16, c * args.per_client)], c,
                                           args.max_tokens, stream))
                cpu = cpu_ms_per_request(cpu0, cpu_s("breakdown"), len(seen))
                time.sleep(0.5)  # the last trace lines reach their files
                per, engine = load_trace(trace)
                results[f"{c}/{'stream' if stream else 'json'}"] = breakdown(seen, per, engine,
                                                                            cfg.engine.max_batch_rows) | {
                    "load": load, "cpu_ms_per_request": cpu}
    finally:
        serve.shutdown()
        ray.shutdown()

    print(f"medians in ms; tiny model, max_batch_rows {cfg.engine.max_batch_rows}, max_tokens {args.max_tokens}")
    print(f"{'clients/mode':>13} {'load':>5} " + " ".join(f"{h:>9}" for h in HOPS)
          + f" {'busy':>5} {'starved':>7}")
    for k, r in results.items():
        print(f"{k:>13} {r['load']:>5.1f} " + " ".join(f"{r['hops_ms'].get(h, float('nan')):>9.1f}" for h in HOPS)
              + f" {r['engine_busy']:>5.2f} {r['rows_free_while_waiting']:>7.2f}")
    parts = ("proxy", "OpenAIIngress", "Decoder", "engine")
    print(f"CPU ms per request ({proxy} proxy / ingress / decoder replica / engine process): "
          + "; ".join(f"{k}: " + " / ".join(f"{r['cpu_ms_per_request'][p]:.1f}" for p in parts)
                      for k, r in results.items()))
    print("streaming, per committed block: " + "; ".join(
        f"{k}: " + ", ".join(f"{b} {v:.1f}" for b, v in r["block_ms"].items())
        for k, r in results.items() if k.endswith("stream")))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
