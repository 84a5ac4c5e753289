"""A decoder replica that survives its engine process, over real HTTP.

- Outside kill: streaming chat clients keep one replica busy and its engine process is SIGKILLed mid-load: no
  request fails (streams resume on the new engine process, from the tokens their clients have), none gets a 503;
  the same replica restarts its engine once; /health says "restarting" meanwhile and answers 200 throughout; no
  engine process outlives its replica.
- A culprit among innocents: 1 poisonous request (tests/integration/poison.py: it crashes the engine on its 6th
  forward, after the innocents streamed tokens) and 8 innocent ones sent together, half streaming: every
  innocent's text equals its uninterrupted run, the poison gets a 500 naming its trial, /health answers 200
  throughout, and the metrics count the restarts and the one quarantined request.
The crash-loop case (restarts that fail until the replica gives up) is
tests/integration/test_serve_units.py::test_a_crash_loop_stops_and_fails_the_health_check."""

import asyncio
import json
import os
import signal
import time

import httpx
import psutil
import pytest

from mbd.checkpoint_files import read_model_config
from mbd.tokenizer import Tokenizer
from serve_app.config import ServeConfig
from tests.integration.conftest import decoder_stats, serve_apps
from tests.integration.poison import INNOCENT, POISON, POISON_ENV, SITE, STEP_ENV
from tests.integration.scrape import export_ports, poll, total
from tests.integration.stream_outcome import stream_outcome
from tests.integration.test_serve_units import DECODE

CLIENTS = 8
MAX_TOKENS = 24
POISON_STEP = 6  # the poison crashes the engine on its 6th forward: late, after the innocents streamed
RECOVERY_BOUND_S = 120  # generous: the engine process restarts in seconds on a quiet machine


def _config(ckpt) -> ServeConfig:
    return ServeConfig.model_validate({
        "model": {"path": str(ckpt), "name": "mbd-test", "num_cpus_per_rank": 0.1},
        "engine": {"max_batch_rows": 9, "threads": 1},
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
            POISON_ENV: ",".join(map(str, tok.encode(POISON))), STEP_ENV: str(POISON_STEP),
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


async def _request(http: httpx.AsyncClient, url: str, n: int, records: list[dict]) -> None:
    """One streaming chat request, in `records` from its start: its outcome ('ok', '503', 'in-band' or
    'unclean: ...'; absent while it runs) and when its first content arrived (None: not yet, or never)."""
    body = {"model": "mbd-test", "messages": [{"role": "user", "content": f"{n}*{n}="}], "max_tokens": MAX_TOKENS,
            "stream": True}
    rec = {"start": time.monotonic(), "first": None}
    records.append(rec)
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


async def _scenario(base: str, replica_pid: int) -> tuple[list, list, float, float]:
    """Load until 2 x CLIENTS requests succeeded and a stream in flight has output, SIGKILL the engine process, go
    on until 2 x CLIENTS requests started after the kill succeeded (polled, within RECOVERY_BOUND_S); /health
    polled every 0.1 s throughout."""
    records, health, stop = [], [], asyncio.Event()

    async def client(k: int, http: httpx.AsyncClient) -> None:
        n = 0
        while not stop.is_set():
            await _request(http, f"{base}/v1/chat/completions", k * 1000 + n, records)
            n += 1

    async def probe(http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            r = await http.get(f"{base}/health")
            health.append((time.monotonic(), r.status_code, r.json()["status"]))
            await asyncio.sleep(0.1)

    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as http:
        tasks = [asyncio.create_task(client(k, http)) for k in range(CLIENTS)] + [asyncio.create_task(probe(http))]
        # then a moment when a stream in flight has output (what the kill must resume, not restart)
        while sum(r.get("outcome") == "ok" for r in records) < 2 * CLIENTS or \
                not any("outcome" not in r and r["first"] is not None for r in records):
            await asyncio.sleep(0.01)
        killed = time.monotonic()
        os.kill(_engine(replica_pid).pid, signal.SIGKILL)
        while sum(r["start"] > killed and r.get("outcome") == "ok" for r in records) < 2 * CLIENTS:
            assert time.monotonic() - killed < RECOVERY_BOUND_S, "the service did not answer again in time"
            await asyncio.sleep(0.05)
        recovered = min(r["first"] or r["end"] for r in records if r["start"] > killed and r.get("outcome") == "ok")
        stop.set()
        await asyncio.gather(*tasks)
    return records, health, killed, recovered


async def _completion(http: httpx.AsyncClient, url: str, prompt: str, stream: bool) -> tuple[int, str]:
    """One completion: (status, its whole text or the error message); a stream's text is its pieces joined, and
    a stream that ends with an error event counts as a 500 with that event's message."""
    body = {"model": "mbd-test", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": stream}
    if not stream:
        r = await http.post(url, json=body)
        return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.json()["error"]["message"]
    async with http.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            return r.status_code, json.loads(await r.aread())["error"]["message"]
        events = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: {")]
    errors = [e["error"]["message"] for e in events if "error" in e]  # in-band, after the status line
    return (500, errors[0]) if errors else (200, "".join(c["text"] for e in events for c in e["choices"]))


def test_one_culprit_among_eight_innocents_crashing_late(base):
    """1 poisonous + 8 innocent requests at once, the poison crashing the engine on its 6th step: innocents 8/8
    complete with exactly their uninterrupted text (half of them streams resumed mid-way), the poison gets a 500
    naming its trial, /health answers 200 throughout, the replica does not give up, and the metrics count it."""
    url = f"{base}/v1/completions"
    m = {"model_name": "mbd-test"}
    before = decoder_stats("restart")
    counted = poll(export_ports(), lambda s: total(s, "ray_mbd_engine_restarts_total", **m)
                   >= before["engine_restarts"], timeout_s=60)  # the counters so far (other tests' restarts)

    async def scenario() -> tuple[list, list, list]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(RECOVERY_BOUND_S)) as http:
            alone = [await _completion(http, url, p, stream=False) for p in INNOCENT]
            health, done = [], asyncio.Event()

            async def probe() -> None:
                while not done.is_set():
                    r = await http.get(f"{base}/health")
                    health.append((r.status_code, r.json()["status"]))
                    await asyncio.sleep(0.1)

            watch = asyncio.create_task(probe())
            got = await asyncio.gather(*(_completion(http, url, p, stream=i % 2 == 0) for i, p in
                                         enumerate(INNOCENT[:4] + [f"1+{POISON}="] + INNOCENT[4:])))
            done.set()
            await watch
            return alone, got, health

    alone, got, health = asyncio.run(scenario())
    status, message = got.pop(4)
    assert status == 500 and "trial" in message, message
    assert got == alone and all(s == 200 for s, _ in alone)
    assert {code for code, _ in health} == {200} and "failed" not in {s for _, s in health}
    after = decoder_stats("restart")
    assert after["quarantined"] - before["quarantined"] == 1 and after["pid"] == before["pid"]
    assert after["resumed"] - before["resumed"] >= 8 and after["streams"] == 0
    restarts = after["engine_restarts"] - before["engine_restarts"]
    q0, r0 = (total(counted, f"ray_mbd_{k}_total", **m) for k in ("requests_quarantined", "engine_restarts"))
    s = poll(export_ports(), lambda s: total(s, "ray_mbd_requests_quarantined_total", **m) >= q0 + 1
             and total(s, "ray_mbd_engine_restarts_total", **m) >= r0 + restarts, timeout_s=60)
    assert total(s, "ray_mbd_requests_quarantined_total", **m) - q0 == 1
    assert total(s, "ray_mbd_engine_restarts_total", **m) - r0 == restarts >= 2


def test_a_killed_engine_process_fails_no_request(base):
    replica = decoder_stats("restart")["pid"]
    old_engine = _engine(replica)
    before = decoder_stats("restart")
    records, health, killed, recovered = asyncio.run(_scenario(base, replica))
    stats = decoder_stats("restart")
    in_flight = [r for r in records if r["start"] <= killed < r["end"]]
    print(f"requests {len(records)}, in flight at the kill {len(in_flight)}, answering again "
          f"{recovered - killed:.1f} s after the kill, replica stats {stats}")
    assert [r["outcome"] for r in records if r["outcome"] != "ok"] == []  # every stream resumed, no 503
    # the same replica restarted its engine process once; the streams with output were resumed from their tokens
    assert stats["pid"] == replica and stats["engine_restarts"] - before["engine_restarts"] == 1
    assert 0 < stats["resumed"] - before["resumed"] <= stats["readmitted"] - before["readmitted"] <= len(in_flight)
    assert stats["quarantined"] == before["quarantined"]  # an outside kill is no evidence against a request
    assert {code for _, code, _ in health} == {200}
    assert "restarting" in {s for t, _, s in health if t > killed} and health[-1][2] == "ok"
    assert not old_engine.is_running()
    # no engine process outlives its replica
    engine = _engine(replica)
    os.kill(replica, signal.SIGKILL)
    gone, alive = psutil.wait_procs([engine], timeout=60)
    assert alive == []
