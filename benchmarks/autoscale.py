"""Autoscaled serving, measured: a load ramp against the autoscaled service and against a fixed 1-replica one.

The cluster starts with its head only (1 CPU); Ray's fake multi-node provider, driven by the real autoscaler,
adds 1-CPU worker nodes when Serve asks for replicas that do not fit (configs/serve/tiny_autoscale.yaml: each
decoder replica takes a whole CPU, so each new replica needs a new node). The same bounded ramp of closed-loop
streaming chat clients (1 -> 8 -> 32 -> 32 -> 8 -> 1 -> 0 by default) runs against the autoscaled application,
then, on the same cluster, against the same application held at one replica. A sampler records replicas and
nodes every second. Per phase: requests, p50/p99 latency and TTFT; a 503 with Retry-After is retried after the
time it names (as a client should) and counted as retried, not lost; any other failure is lost. After the ramp
the benchmark waits (at most the downscale delay plus a margin) for the replicas to fall back to the minimum.

    python -m benchmarks.autoscale                       # ~15 minutes; its last line:
    autoscale: replicas 1->N->M, nodes 1->K, lost L/T, p50 at peak X s vs fixed Y s (ratio R)

"p50 at peak" is the median latency of the requests started in the second 32-client phase (the first one is
where the autoscaler reacts). Every node runs on this one machine, so the cores it has bound the speed-up that
more replicas can give; the load average is printed beside the result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from actors.tp_worker import free_port
from mbd.tiny.task import generate as tiny_problems
from serve_app.config import ServeConfig, load_serve_config

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RAMP = "1:20,8:20,32:150,32:90,8:20,1:20"  # clients:seconds per phase; the load ends after the last


@dataclass
class Request:
    phase: int
    start: float
    latency: float = math.nan
    ttft: float = math.nan
    retries: int = 0
    error: str | None = None  # set when the request was lost


@dataclass
class Sample:
    t: float
    replicas: int  # RUNNING
    starting: int  # asked for, not yet running (waiting for a node, or starting)
    nodes: int


@dataclass
class Run:
    name: str
    t0: float = 0.0
    load_end: float = 0.0
    requests: list[Request] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    settled_s: float | None = None  # after the load ended: until the replicas were back at the minimum


def parse_ramp(text: str) -> list[tuple[int, float]]:
    phases = [(int(c), float(s)) for c, s in (p.split(":") for p in text.split(","))]
    if not phases or any(c < 0 or s <= 0 for c, s in phases):
        raise ValueError(f"--ramp: clients:seconds pairs, e.g. {DEFAULT_RAMP}")
    return phases


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else math.nan


async def _one(http: httpx.AsyncClient, url: str, body: dict, req: Request, deadline: float) -> None:
    """One streaming request; a 503 is retried after its Retry-After while the run lasts."""
    while True:
        first = None
        try:
            async with http.stream("POST", url, json=body) as r:
                if r.status_code == 503 and "retry-after" in r.headers and time.perf_counter() < deadline:
                    await r.aread()
                    req.retries += 1
                    await asyncio.sleep(float(r.headers["retry-after"]))
                    continue
                if r.status_code != 200:
                    req.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        ev = json.loads(line[6:])
                        if "error" in ev:
                            req.error = f"in-stream error: {ev['error'].get('message')}"
                            return
                        if first is None and any(c["delta"].get("content") for c in ev.get("choices", [])):
                            first = time.perf_counter()
        except httpx.HTTPError as e:
            req.error = f"{type(e).__name__}: {e}"
            return
        end = time.perf_counter()
        req.latency, req.ttft = end - req.start, (first or end) - req.start
        return


async def run_ramp(url: str, model: str, messages: list[list[dict]], ramp: list[tuple[int, float]],
                   max_tokens: int, run: Run) -> None:
    """Closed-loop clients: in phase i, clients 0..n_i-1 each send a request as soon as their last one ended."""
    n_max = max(c for c, _ in ramp)
    limits = httpx.Limits(max_connections=n_max, max_keepalive_connections=n_max)
    run.t0 = time.perf_counter()
    ends = [run.t0 + sum(s for _, s in ramp[: i + 1]) for i in range(len(ramp))]
    run.load_end = ends[-1]

    def phase_at(t: float) -> int | None:
        return next((i for i, e in enumerate(ends) if t < e), None)

    async def client(k: int, http: httpx.AsyncClient) -> None:
        n = 0
        while (i := phase_at(time.perf_counter())) is not None:
            if k >= ramp[i][0]:  # this client idles in this phase
                await asyncio.sleep(min(0.2, max(0.0, ends[i] - time.perf_counter())))
                continue
            body = {"model": model, "messages": messages[(k * 7919 + n) % len(messages)], "max_tokens": max_tokens,
                    "ignore_eos": True, "stream": True}
            req = Request(phase=i, start=time.perf_counter())
            run.requests.append(req)
            await _one(http, url, body, req, ends[-1] + 60)
            n += 1

    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30), limits=limits) as http:
        await asyncio.gather(*(client(k, http) for k in range(n_max)))


class Sampler(threading.Thread):
    """Every second: RUNNING replicas of the decoder deployment and alive nodes."""

    def __init__(self, app: str, run: Run):
        super().__init__(daemon=True)
        self.app, self.run_, self.stop = app, run, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.run_.samples.append(Sample(time.perf_counter(), *replica_counts(self.app), alive_nodes()))
            self.stop.wait(1.0)


def replica_counts(app: str) -> tuple[int, int]:
    """(RUNNING, STARTING) replicas of the application's decoder deployment."""
    from ray import serve

    st = serve.status().applications.get(app)
    states = st.deployments["Decoder"].replica_states if st is not None and "Decoder" in st.deployments else {}
    count = lambda name: sum(n for s, n in states.items() if str(s).split(".")[-1] == name)  # noqa: E731
    return count("RUNNING"), count("STARTING")


def alive_nodes() -> int:
    import ray

    return sum(1 for n in ray.nodes() if n.get("Alive"))


def phase_rows(run: Run, ramp: list[tuple[int, float]]) -> list[dict]:
    rows = []
    for i, (clients, secs) in enumerate(ramp):
        done = [r for r in run.requests if r.phase == i and r.error is None]
        lat, ttft = [r.latency for r in done], [r.ttft for r in done]
        in_phase = [s for s in run.samples if run.t0 + sum(x for _, x in ramp[:i]) <= s.t
                    < run.t0 + sum(x for _, x in ramp[: i + 1])]
        rows.append({"phase": i, "clients": clients, "seconds": secs, "requests": len(done),
                     "lost": sum(1 for r in run.requests if r.phase == i and r.error is not None),
                     "retried_503": sum(r.retries for r in run.requests if r.phase == i),
                     "p50_s": statistics.median(lat) if lat else math.nan, "p99_s": percentile(lat, 0.99),
                     "ttft_p50_s": statistics.median(ttft) if ttft else math.nan, "ttft_p99_s": percentile(ttft, 0.99),
                     "replicas_max": max((s.replicas for s in in_phase), default=0),
                     "nodes_max": max((s.nodes for s in in_phase), default=0)})
    return rows


def print_run(run: Run, ramp: list[tuple[int, float]]) -> list[dict]:
    rows = phase_rows(run, ramp)
    print(f"\n[{run.name}] per phase (latency and TTFT of requests started in the phase, seconds)")
    print(f"{'phase':>5} {'clients':>7} {'reqs':>5} {'lost':>4} {'503s':>4} {'p50':>7} {'p99':>7} {'TTFT50':>7} "
          f"{'TTFT99':>7} {'replicas':>8} {'nodes':>5}")
    for r in rows:
        print(f"{r['phase']:>5} {r['clients']:>7} {r['requests']:>5} {r['lost']:>4} {r['retried_503']:>4} "
              f"{r['p50_s']:>7.2f} {r['p99_s']:>7.2f} {r['ttft_p50_s']:>7.2f} {r['ttft_p99_s']:>7.2f} "
              f"{r['replicas_max']:>8} {r['nodes_max']:>5}")
    print(f"[{run.name}] replicas and nodes over time (t = seconds since the ramp began; a line per change):")
    last = None
    for s in run.samples:
        if (s.replicas, s.starting, s.nodes) != last:
            print(f"    t={s.t - run.t0:7.1f}s  replicas {s.replicas} running, {s.starting} starting; nodes {s.nodes}")
            last = (s.replicas, s.starting, s.nodes)
    for r in run.requests:
        if r.error is not None:
            print(f"[{run.name}] lost request (phase {r.phase}): {r.error}")
    return rows


def measure(name: str, app_cfg: ServeConfig, url_base: str, messages: list[list[dict]],
            ramp: list[tuple[int, float]], max_tokens: int) -> Run:
    """Deploy `app_cfg` as application `name`, run the ramp, wait for the scale-down, delete it."""
    from ray import serve

    from serve_app.app import build_app

    serve.run(build_app({"serve_config": app_cfg}), name=name, route_prefix=f"/{name}")
    url = f"{url_base}/{name}/v1/chat/completions"
    asyncio.run(run_ramp(url, app_cfg.model.name, messages, [(2, 3.0)], 8, Run("warm-up")))
    run = Run(name)
    sampler = Sampler(name, run)
    sampler.start()
    try:
        asyncio.run(run_ramp(url, app_cfg.model.name, messages, ramp, max_tokens, run))
        auto = app_cfg.decoder.autoscaling
        wait_s = auto.downscale_delay_s + 60 if auto.max_replicas > auto.min_replicas else 0
        deadline = time.perf_counter() + wait_s
        while time.perf_counter() < deadline:
            if run.samples and run.samples[-1].replicas <= max(1, auto.min_replicas):
                run.settled_s = run.samples[-1].t - run.load_end
                break
            time.sleep(1)
    finally:
        sampler.stop.set()
        sampler.join()
        serve.delete(name)
    return run


def summary_line(auto: Run, fixed: Run, ramp: list[tuple[int, float]]) -> str:
    peak_phase = max(i for i, (c, _) in enumerate(ramp) if c == max(c for c, _ in ramp))
    p50 = lambda run: statistics.median(  # noqa: E731
        [r.latency for r in run.requests if r.phase == peak_phase and r.error is None] or [math.nan])
    reps = [s.replicas for s in auto.samples if s.replicas > 0]
    nodes = [s.nodes for s in auto.samples]
    lost = sum(r.error is not None for r in auto.requests + fixed.requests)
    total = len(auto.requests) + len(fixed.requests)
    x, y = p50(auto), p50(fixed)
    return (f"autoscale: replicas {reps[0] if reps else 0}->{max(reps, default=0)}->{reps[-1] if reps else 0}, "
            f"nodes {nodes[0] if nodes else 0}->{max(nodes, default=0)}, lost {lost}/{total}, "
            f"p50 at peak {x:.2f} s vs fixed {y:.2f} s (ratio {x / y:.2f})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "serve" / "tiny_autoscale.yaml"))
    p.add_argument("--ramp", default=DEFAULT_RAMP, help="clients:seconds phases (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (ignore_eos)")
    p.add_argument("--idle-timeout-s", type=float, default=20, help="the autoscaler removes a node idle this long")
    args = p.parse_args(argv)
    ramp = parse_ramp(args.ramp)
    cfg = load_serve_config(args.config)
    auto = cfg.decoder.autoscaling
    fixed = cfg.model_copy(update={"decoder": cfg.decoder.model_copy(update={"autoscaling": auto.model_copy(
        update={"min_replicas": 1, "max_replicas": 1})})})
    per_replica = cfg.model.num_cpus_per_rank * cfg.model.tensor_parallel_size
    messages = [[{"role": "user", "content": r["question"]}] for r in tiny_problems("heldout", 256, seed=0)]

    import ray
    from ray import serve

    from tests.integration.multinode import LocalCluster

    # head: one replica's CPUs; each worker node the autoscaler adds: one more replica's
    cluster = LocalCluster.autoscaling({"replica": {"resources": {"CPU": per_replica},
                                                    "max_workers": auto.max_replicas - 1}},
                                       head_cpus=per_replica, idle_timeout_s=args.idle_timeout_s)
    load_before = os.getloadavg()
    try:
        cluster.connect(log_to_driver=False, logging_level="ERROR")
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}"
        # the fixed deployment first, so that the autoscaled one starts from the head alone
        fixed_run = measure("fixed", fixed, base, messages, ramp, args.max_tokens)
        auto_run = measure("autoscaled", cfg, base, messages, ramp, args.max_tokens)
    finally:
        if ray.is_initialized():
            serve.shutdown()
        cluster.shutdown()
    load_after = os.getloadavg()
    rows = {"fixed": print_run(fixed_run, ramp), "autoscaled": print_run(auto_run, ramp)}
    settled = "never" if auto_run.settled_s is None else f"{auto_run.settled_s:.0f}s"
    print(f"\nautoscaling: min {auto.min_replicas}, max {auto.max_replicas}, target_ongoing_requests "
          f"{auto.target_ongoing_requests:g}, upscale_delay_s {auto.upscale_delay_s:g}, downscale_delay_s "
          f"{auto.downscale_delay_s:g}; back to {max(1, auto.min_replicas)} replica(s) {settled} after the load "
          f"ended; {per_replica:g} CPU per replica and per node; this machine: {os.cpu_count()} cores, load "
          f"average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print(json.dumps({"ramp": ramp, "phases": rows, "settled_s": auto_run.settled_s,
                      "load_average": [load_before[0], load_after[0]]}))
    print(summary_line(auto_run, fixed_run, ramp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
