"""Node loss while serving: on a cluster of a head (the HTTP proxy and the ingress, no CPU) and three 1-CPU worker
nodes, two decoder replicas (one per node) serve streaming clients over real HTTP; the node of one replica is
killed mid-stream. Counted: a request may fail only if it was in flight when the node died, and only cleanly
(a 503 with Retry-After before the stream starts, or an in-band error event that ends the stream; a request
whose replica died before its first block is sent again by the ingress and does not fail); every
request started after Serve has replaced the replica succeeds; /health answers 200 throughout; the replica is
replaced on the spare node."""

import asyncio
import json
import time

import httpx

from actors.tp_worker import free_port
from serve_app.config import ServeConfig
from tests.integration.stream_outcome import stream_outcome
from tests.integration.test_serve_units import DECODE

FAST_DEATH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
CLIENTS = 6
MAX_TOKENS = 24


def _config(ckpt) -> ServeConfig:
    return ServeConfig.model_validate({
        "model": {"path": str(ckpt), "name": "mbd-test", "num_cpus_per_rank": 1},
        "engine": {"device": "cpu", "threads": 1, "max_batch_rows": 4},
        "decode": DECODE.model_dump(),
        "decoder": {"max_ongoing_requests": 8, "max_queued_requests": 64, "retry_after_s": 1,
                    "autoscaling": {"min_replicas": 2, "max_replicas": 2},
                    "health_check_period_s": 2, "health_check_timeout_s": 30},
    })


def _replica_nodes(deployment: str = "Decoder") -> dict[str, str]:
    """Actor id -> node id of the deployment's replicas that are alive."""
    from ray._private.state import actors

    return {a: info["Address"]["NodeID"] for a, info in actors().items()
            if info["State"] == "ALIVE" and info.get("ActorClassName", "").endswith(f":{deployment}")}


async def _request(http: httpx.AsyncClient, url: str, n: int) -> dict:
    """One streaming chat request: 'ok', or how it failed ('503', 'in-band' or 'unclean: ...')."""
    body = {"model": "mbd-test", "messages": [{"role": "user", "content": f"q{n}"}], "max_tokens": MAX_TOKENS,
            "stream": True}
    rec = {"start": time.monotonic()}
    try:
        async with http.stream("POST", url, json=body) as r:
            if r.status_code == 503:
                await r.aread()
                rec["outcome"] = "503" if r.headers.get("retry-after") else "unclean: 503 without Retry-After"
            elif r.status_code != 200:
                rec["outcome"] = f"unclean: HTTP {r.status_code}"
            else:
                events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
                rec["outcome"] = stream_outcome([e if e == "[DONE]" else json.loads(e) for e in events])
    except httpx.HTTPError as e:
        rec["outcome"] = f"unclean: {type(e).__name__}"
    rec["end"] = time.monotonic()
    return rec


async def _load(url: str, stop: asyncio.Event, records: list) -> None:
    async def client(k: int, http: httpx.AsyncClient) -> None:
        n = 0
        while not stop.is_set():
            records.append(await _request(http, url, k * 1000 + n))
            n += 1

    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as http:
        await asyncio.gather(*(client(k, http) for k in range(CLIENTS)))


async def _health(url: str, stop: asyncio.Event, codes: list) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as http:
        while not stop.is_set():
            try:
                codes.append((await http.get(url)).status_code)
            except httpx.HTTPError as e:
                codes.append(type(e).__name__)
            await asyncio.sleep(0.5)


def test_a_lost_replica_node_fails_only_its_requests_cleanly(multinode, ckpt):
    from ray import serve

    from serve_app.app import build_app

    cluster = multinode(workers=(1, 1, 1), head_cpus=0, system_config=FAST_DEATH)
    port = free_port()
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"serve_config": _config(ckpt)}), name="mbd", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        before = _replica_nodes()
        assert len(before) == 2 and len(set(before.values())) == 2  # one replica per node
        workers = {n.node_id: n for n in cluster.worker_nodes}
        ingress = set(_replica_nodes("OpenAIIngress").values())
        victim = next(n for n in before.values() if n not in ingress)  # the HTTP path itself stays up
        spare = (set(workers) - set(before.values())).pop()

        async def scenario() -> tuple[list, list, float, float]:
            records, codes = [], []
            stop_load, stop_health = asyncio.Event(), asyncio.Event()
            load = asyncio.create_task(_load(f"{base}/v1/chat/completions", stop_load, records))
            health = asyncio.create_task(_health(f"{base}/health", stop_health, codes))
            while sum(r["outcome"] == "ok" for r in records) < 2 * CLIENTS:  # streaming through both replicas
                await asyncio.sleep(0.2)
            killed = time.monotonic()
            await asyncio.to_thread(cluster.remove_node, workers[victim], False)
            deadline = time.monotonic() + 300
            while True:  # until Serve runs two replicas again, the new one on the spare node
                nodes = await asyncio.to_thread(_replica_nodes)
                if sorted(nodes.values()) == sorted([spare, *(n for n in before.values() if n != victim)]):
                    break
                assert time.monotonic() < deadline, f"the lost replica was never replaced: {nodes}"
                await asyncio.sleep(1)
            replaced = time.monotonic()
            await asyncio.sleep(0)
            while sum(r["start"] > replaced and r["outcome"] == "ok" for r in records) < 2 * CLIENTS:
                await asyncio.sleep(0.2)
            stop_load.set()
            stop_health.set()
            await asyncio.gather(load, health)
            return records, codes, killed, replaced

        records, codes, killed, replaced = asyncio.run(scenario())
        failed = [r for r in records if r["outcome"] != "ok"]
        assert [r["outcome"] for r in failed if r["outcome"].startswith("unclean")] == []
        in_flight = [r for r in records if r["start"] <= killed < r["end"]]
        print(f"requests {len(records)}, in flight at the kill {len(in_flight)}, failed {len(failed)} "
              f"({sorted(r['outcome'] for r in failed)}), replaced after {replaced - killed:.1f}s, "
              f"health checks {len(codes)}")
        # only requests on the lost replica may fail: those in flight at the kill, and those sent to it before
        # Serve noticed (each answered with a clean 503 and Retry-After); never one started after the replacement
        assert len([r for r in failed if r["start"] <= killed]) <= len(in_flight)
        assert [r for r in failed if r["start"] > replaced] == []
        assert len(failed) <= len(in_flight) + CLIENTS  # at most one quick 503 per client in the window
        assert codes and set(codes) == {200}
        assert sum(r["outcome"] == "ok" for r in records) == len(records) - len(failed)
    finally:
        serve.shutdown()  # the driver process keeps a Serve client per cluster
