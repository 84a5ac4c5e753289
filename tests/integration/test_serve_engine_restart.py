"""A decoder replica that survives its engine process, over real HTTP: streaming chat clients keep one replica busy
and its engine process is SIGKILLed mid-load. Counted: only streams that had produced output fail, each cleanly
(finish_reason "error", an error event, [DONE]), as many as the replica says it failed; every other request
succeeds (none gets a 503); the same replica restarts its engine once and serves every request started after the
kill, within a generous bound; /health says "restarting" meanwhile and answers 200 throughout; and no engine
process outlives its replica. A request in the engine at two of its exits gets a 500 (not a retry). The
crash-loop case (restarts that fail until the replica gives up) is
tests/integration/test_serve_units.py::test_a_crash_loop_stops_and_fails_the_health_check."""

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from actors.tp_worker import free_port
from serve_app.config import ServeConfig
from tests.integration.stream_outcome import stream_outcome
from tests.integration.test_serve_units import DECODE

CLIENTS = 8
MAX_TOKENS = 24
RECOVERY_BOUND_S = 120  # generous: the engine process restarts in seconds on a quiet machine


def _config(ckpt) -> ServeConfig:
    return ServeConfig.model_validate({
        "model": {"path": str(ckpt), "name": "mbd-test", "num_cpus_per_rank": 0.1},
        "engine": {"max_batch_rows": 4, "threads": 1},
        "decode": DECODE.model_dump(),
        "decoder": {"max_ongoing_requests": 32, "max_queued_requests": 64, "health_check_period_s": 2,
                    "engine_restarts": {"limit": 3, "backoff_s": 1}},
    })


@pytest.fixture(scope="module")
def base(ray_cluster, ckpt):
    from ray import serve

    from serve_app.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"serve_config": _config(ckpt)}), name="restart", route_prefix="/restart")
    yield f"http://127.0.0.1:{port}/restart"
    serve.shutdown()


def _stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("Decoder", app_name="restart").stats.remote().result()


def _engine(replica_pid: int) -> psutil.Process:
    (engine,) = [p for p in psutil.Process(replica_pid).children() if "actors.engine_process" in " ".join(p.cmdline())]
    return engine


async def _request(http: httpx.AsyncClient, url: str, n: int) -> dict:
    """One streaming chat request: its outcome ('ok', '503', 'in-band' or 'unclean: ...') and when its first
    content arrived (None: never)."""
    body = {"model": "mbd-test", "messages": [{"role": "user", "content": f"{n}*{n}="}], "max_tokens": MAX_TOKENS,
            "stream": True}
    rec = {"start": time.monotonic(), "first": None}
    try:
        async with http.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                rec["outcome"] = "503" if r.status_code == 503 and r.headers.get("retry-after") else \
                    f"unclean: HTTP {r.status_code}"
            else:
                events = []
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        if rec["first"] is None and any(c["delta"].get("content") for c in events[-1]["choices"]):
                            rec["first"] = time.monotonic()
                    elif line == "data: [DONE]":
                        events.append("[DONE]")
                rec["outcome"] = stream_outcome(events)
    except httpx.HTTPError as e:
        rec["outcome"] = f"unclean: {type(e).__name__}"
    rec["end"] = time.monotonic()
    return rec


async def _scenario(base: str, replica_pid: int) -> tuple[list, list, float, float]:
    """Load until 2 x CLIENTS requests succeeded, SIGKILL the engine process, go on until 2 x CLIENTS requests
    started after the kill succeeded (polled, within RECOVERY_BOUND_S); /health polled every 0.1 s throughout."""
    records, health, stop = [], [], asyncio.Event()

    async def client(k: int, http: httpx.AsyncClient) -> None:
        n = 0
        while not stop.is_set():
            records.append(await _request(http, f"{base}/v1/chat/completions", k * 1000 + n))
            n += 1

    async def probe(http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            r = await http.get(f"{base}/health")
            health.append((time.monotonic(), r.status_code, r.json()["status"]))
            await asyncio.sleep(0.1)

    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as http:
        tasks = [asyncio.create_task(client(k, http)) for k in range(CLIENTS)] + [asyncio.create_task(probe(http))]
        while sum(r["outcome"] == "ok" for r in records) < 2 * CLIENTS:
            await asyncio.sleep(0.05)
        killed = time.monotonic()
        os.kill(_engine(replica_pid).pid, signal.SIGKILL)
        while sum(r["start"] > killed and r["outcome"] == "ok" for r in records) < 2 * CLIENTS:
            assert time.monotonic() - killed < RECOVERY_BOUND_S, "the service did not answer again in time"
            await asyncio.sleep(0.05)
        recovered = min(r["first"] or r["end"] for r in records if r["start"] > killed and r["outcome"] == "ok")
        stop.set()
        await asyncio.gather(*tasks)
    return records, health, killed, recovered


def test_a_request_in_the_engine_at_two_exits_gets_a_500_not_a_retry(base):
    """A non-streaming request that is in the engine process each time it is SIGKILLed: re-admitted after the
    first exit, then quarantined (`decoder.engine_restarts.quarantine_after` = 2): HTTP 500 without Retry-After,
    naming why, and not retried by the ingress (it could take the next engine down too); the replica serves the
    next request."""
    replica = _stats()["pid"]
    before = _stats()["quarantined"]
    body = {"model": "mbd-test", "prompt": "1+1=", "max_tokens": 900, "tau_m2t": 1.0, "buffer_size": 1}
    reply: dict = {}
    post = threading.Thread(target=lambda: reply.update(r=httpx.post(f"{base}/v1/completions", json=body,
                                                                     timeout=120)))
    post.start()
    engine = None
    for _ in range(2):  # kill each engine process once the request decodes in it
        deadline = time.monotonic() + RECOVERY_BOUND_S
        while engine is not None and engine.is_running() or _stats().get("in_engine") != 1:
            assert time.monotonic() < deadline, "the request did not reach a new engine process"
            time.sleep(0.02)
        engine = _engine(replica)
        os.kill(engine.pid, signal.SIGKILL)
    post.join(120)
    r = reply["r"]
    assert r.status_code == 500 and "retry-after" not in r.headers, (r.status_code, r.text)
    assert "exited 2 times while this request was in it" in r.json()["error"]["message"]
    assert _stats()["quarantined"] - before == 1
    ok = httpx.post(f"{base}/v1/completions", json={**body, "max_tokens": 8}, timeout=RECOVERY_BOUND_S)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8


def test_a_killed_engine_process_fails_only_its_streaming_requests(base):
    replica = _stats()["pid"]
    old_engine = _engine(replica)
    restarts = _stats()["engine_restarts"]
    records, health, killed, recovered = asyncio.run(_scenario(base, replica))
    stats = _stats()
    failed = [r for r in records if r["outcome"] != "ok"]
    in_flight = [r for r in records if r["start"] <= killed < r["end"]]
    print(f"requests {len(records)}, in flight at the kill {len(in_flight)}, failed {len(failed)}, answering again "
          f"{recovered - killed:.1f} s after the kill, replica stats {stats}")
    assert [r["outcome"] for r in failed if r["outcome"] != "in-band"] == []  # clean, and no 503
    # a request fails only if it was streaming (in flight at the kill, with output): the others are kept
    assert all(r in in_flight and r["first"] is not None for r in failed)
    assert len(failed) == stats["lost_mid_stream"] <= len(in_flight)
    assert sum(r["outcome"] == "ok" for r in records) == len(records) - len(failed)
    # the same replica restarted its engine process once; /health said so meanwhile, with 200 throughout
    assert stats["pid"] == replica and stats["engine_restarts"] - restarts == 1 and stats["kept"] >= 0
    assert {code for _, code, _ in health} == {200}
    assert "restarting" in {s for t, _, s in health if t > killed} and health[-1][2] == "ok"
    assert not old_engine.is_running()
    # no engine process outlives its replica
    engine = _engine(replica)
    os.kill(replica, signal.SIGKILL)
    gone, alive = psutil.wait_procs([engine], timeout=60)
    assert alive == []
