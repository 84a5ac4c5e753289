"""A decoder replica that survives its engine process, over real HTTP: streaming chat clients keep one replica busy
and its engine process is SIGKILLed mid-load. Counted: only streams that had produced output fail, each cleanly
(finish_reason "error", an error event, [DONE]), as many as the replica says it failed; every other request
succeeds (none gets a 503); the same replica restarts its engine once and serves every request started after the
kill, within a generous bound; /health says "restarting" meanwhile and answers 200 throughout; and no engine
process outlives its replica. A request that itself crashes the engine (tests/integration/poison.py, set up for
the replica here) gets a 500 after its trial crashed it again (not a retry), while the request beside
it succeeds. The crash-loop case (restarts that fail until the replica gives up) is
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

from mbd.checkpoint_files import read_model_config
from mbd.tokenizer import Tokenizer
from serve_app.config import ServeConfig
from tests.integration.conftest import decoder_stats, serve_apps
from tests.integration.poison import POISON_ENV, SITE
from tests.integration.stream_outcome import stream_outcome
from tests.integration.test_serve_units import DECODE

CLIENTS = 8
MAX_TOKENS = 24
POISON = "7777"
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
def tok(ckpt) -> Tokenizer:
    return Tokenizer.from_dir(ckpt, read_model_config(ckpt))


@pytest.fixture(scope="module")
def base(serve_url, ckpt, tok: Tokenizer):
    from serve_app import app

    with pytest.MonkeyPatch.context() as mp:  # the replica's engine processes crash on a step running POISON
        mp.setitem(app.ONE_LOOP, "env_vars", app.ONE_LOOP["env_vars"] | {
            POISON_ENV: ",".join(map(str, tok.encode(POISON))),
            "PYTHONPATH": os.pathsep.join([SITE] + [p for p in [os.environ.get("PYTHONPATH")] if p])})
        deployed = serve_apps(serve_url, restart=app.build_app({"serve_config": _config(ckpt)}))
        url = next(deployed)
    yield f"{url}/restart"
    next(deployed, None)


def _restarted(before: dict, n: int) -> dict:
    """The replica's stats once its engine process has restarted n times since `before` (a restart counts when the
    new process is up, which is after the request that killed the old one was answered), or at RECOVERY_BOUND_S."""
    deadline = time.monotonic() + RECOVERY_BOUND_S
    while ((after := decoder_stats("restart"))["engine_restarts"] - before["engine_restarts"] < n
           and time.monotonic() < deadline):
        time.sleep(0.2)
    return after


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


def test_a_request_that_crashes_the_engine_gets_a_500_and_the_one_beside_it_succeeds(base):
    """A poisonous and an innocent non-streaming request sent together: the engine dies by itself (it raises)
    with the poisonous one in its step; the suspects are tried one at a time; the poisonous one kills the engine
    again and is failed: HTTP 500 without Retry-After, naming why, not retried by the ingress; the innocent one
    gets its 200; two restarts, one quarantined request, no stream lost."""
    before = decoder_stats("restart")
    bodies = [{"model": "mbd-test", "prompt": f"1+{POISON}=", "max_tokens": 8},
              {"model": "mbd-test", "prompt": "2+2=", "max_tokens": 8}]
    replies: dict = {}
    posts = [threading.Thread(target=lambda i=i: replies.update({i: httpx.post(
        f"{base}/v1/completions", json=bodies[i], timeout=RECOVERY_BOUND_S)})) for i in range(2)]
    for t in posts:
        t.start()
    for t in posts:
        t.join(RECOVERY_BOUND_S)
    poisonous, innocent = replies[0], replies[1]
    assert poisonous.status_code == 500 and "retry-after" not in poisonous.headers, poisonous.text
    assert "on this request's trial" in poisonous.json()["error"]["message"]
    assert innocent.status_code == 200 and innocent.json()["usage"]["completion_tokens"] == 8
    after = _restarted(before, 2)
    assert {k: after[k] - before[k] for k in ("engine_restarts", "quarantined", "lost_mid_stream")} == \
        {"engine_restarts": 2, "quarantined": 1, "lost_mid_stream": 0}
    assert after["pid"] == before["pid"] and after["streams"] == 0


def test_a_killed_engine_process_fails_only_its_streaming_requests(base):
    replica = decoder_stats("restart")["pid"]
    old_engine = _engine(replica)
    before = decoder_stats("restart")
    records, health, killed, recovered = asyncio.run(_scenario(base, replica))
    stats = decoder_stats("restart")
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
    assert stats["pid"] == replica and stats["engine_restarts"] - before["engine_restarts"] == 1
    # the kept requests (in the replica without output at the kill) were re-run and succeeded: each is a request
    # in flight at the kill that succeeded; with 8 clients on 4 batch rows some always wait for a row
    kept = stats["kept"] - before["kept"]
    assert 0 < kept <= sum(r["outcome"] == "ok" for r in in_flight)
    assert stats["quarantined"] == before["quarantined"]  # an outside kill is no evidence against a request
    assert {code for _, code, _ in health} == {200}
    assert "restarting" in {s for t, _, s in health if t > killed} and health[-1][2] == "ok"
    assert not old_engine.is_running()
    # no engine process outlives its replica
    engine = _engine(replica)
    os.kill(replica, signal.SIGKILL)
    gone, alive = psutil.wait_procs([engine], timeout=60)
    assert alive == []
