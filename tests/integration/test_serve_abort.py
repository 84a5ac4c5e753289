"""A client that goes away costs at most one block, wherever its request is (issue 65), over real HTTP.

The queued cases talk to the ingress replica's own HTTP port, the one HAProxy forwards to: HAProxy 2.8 (Ray
Serve's high-throughput proxy) does not pass on a client's close of a request it has already forwarded while no
response byte has come back (its `abortonclose` covers requests still queued or connecting), so through it the
ingress cannot know; docs/serving.md has the measurement and Serve's Python proxy, which does.

The tiny random checkpoint never emits a stop token, so every request generates exactly its `max_tokens` unless it is
aborted. The decoder replica counts every token its engine emits (`generated`, aborted requests' included); the
tokens generated for nobody are that count's growth less what the clients that stayed received. Three ways to go:
- running streams closed after two events (tokens received counted from their per-token logprobs);
- streaming requests closed 0.3 s after sending, queued behind requests that fill every batch row;
- non-streaming requests whose clients time out after 1 s, queued the same way.
And a request deadline (`timeout`, seconds) ends a request that outlives it with finish_reason "timeout", its
partial output kept, counted as aborted by reason."""

import asyncio
import json
import time

import httpx
import pytest

from benchmarks.client_disconnect import ingress_url
from tests.integration.conftest import SERVE_SLOTS, decoder_stats, serve_apps, tiny_serve_config
from tests.integration.scrape import export_ports, poll, scrape, total
from tests.integration.test_serve_units import DECODE

MODEL = "mbd-abort"
APP = "abort"
LONG = 600  # tokens of a request that would run long if nobody aborted it
BLOCK = 4  # the random checkpoint's block size
STEP = DECODE.buffer_size * BLOCK  # the most tokens one engine step commits for a request
FILL = 4 * SERVE_SLOTS  # background requests: every batch row busy, more waiting
SETTLE_S = 60


@pytest.fixture(scope="module")
def base(serve_url, ckpt):
    cfg = tiny_serve_config(ckpt, MODEL, decoder={"max_ongoing_requests": 128, "max_queued_requests": 256,
                                                  "health_check_period_s": 2})
    for url in serve_apps(serve_url, **{APP: cfg}):
        yield f"{url}/{APP}"


@pytest.fixture(scope="module")
def direct(base) -> str:
    """The app on its ingress replica's own HTTP port (where HAProxy forwards it)."""
    url = ingress_url(APP, f"/{APP}")
    assert url is not None, "the ingress replica serves HTTP on no port of its own"
    return url


def _body(i: int, stream: bool, max_tokens: int = LONG, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"{i}+{i}="}], "max_tokens": max_tokens,
            "stream": stream, **kw}


def _idle() -> dict:
    """The replica's stats once it holds no stream and its engine no request (or at SETTLE_S)."""
    deadline = time.monotonic() + SETTLE_S
    while (s := decoder_stats(APP))["streams"] or s.get("in_engine", 0):
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return s


async def _background(client: httpx.AsyncClient, url: str, n: int, max_tokens: int) -> list[int]:
    """n non-streaming requests that fill the rows; each one's completion tokens (they are all delivered)."""
    async def one(i: int) -> int:
        r = await client.post(f"{url}/v1/chat/completions", json=_body(1000 + i, False, max_tokens))
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]
    return await asyncio.gather(*(one(i) for i in range(n)))


async def _wait_running(url: str, client: httpx.AsyncClient) -> None:
    """Until the replica's engine has every batch row busy (the background requests arrived)."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        s = await asyncio.to_thread(decoder_stats, APP)
        if s.get("waiting", 0) > 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the background requests never filled the engine")


def test_running_streams_closed_after_two_events_cost_at_most_a_block(base):
    n = 6
    before = _idle()

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(i: int) -> int:
                got = 0
                async with client.stream("POST", f"{base}/v1/chat/completions",
                                         json=_body(i, True, logprobs=True)) as r:
                    events = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            for c in json.loads(line[6:])["choices"]:
                                got += len((c.get("logprobs") or {}).get("content") or [])
                            events += 1
                            if events == 2:
                                break
                return got
            return await asyncio.gather(*(one(i) for i in range(n)))

    received = asyncio.run(run())
    after = _idle()
    nobody = after["generated"] - before["generated"] - sum(received)
    late = after["discarded"] - before["discarded"]
    print(f"running streams: {nobody} tokens for nobody, {late} of them after the replica saw the abort")
    assert after["streams"] == 0 and after["kv_pages_used"] == 0
    # the engine stops within a step of hearing of it: the step it may be running then, and none after
    assert late <= n * 2 * STEP, late
    assert nobody <= n * LONG // 10, (nobody, received)


@pytest.mark.parametrize("stream", [True, False], ids=["streaming-closed", "non-streaming-timed-out"])
def test_queued_requests_whose_clients_leave_cost_at_most_a_block(base, direct, stream):
    """Each of the n requests is aborted once, wherever its client found it: the ingress counts it (on a loaded
    machine a request may still be on its way to the replica at 0.3 s; the replica counts only those it held)."""
    n, leave_after = 8, 0.3 if stream else 1.0
    before, ports = _idle(), export_ports()
    counted = _aborted(scrape(ports), "client_disconnect")
    fill_tokens = 3 * LONG // 4

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=300) as client:
            bg = asyncio.create_task(_background(client, base, FILL, fill_tokens))
            await _wait_running(base, client)

            async def leave(i: int) -> None:
                try:
                    async with httpx.AsyncClient(timeout=leave_after) as c:
                        if stream:
                            async with c.stream("POST", f"{direct}/v1/chat/completions", json=_body(i, True)):
                                pass  # its headers come with its first block: the timeout closes it before
                        else:
                            await c.post(f"{direct}/v1/chat/completions", json=_body(i, False))
                except httpx.TimeoutException:
                    pass
            t0 = time.monotonic()
            await asyncio.gather(*(leave(i) for i in range(n)))
            assert time.monotonic() - t0 < 10  # they left while the background still ran
            return await bg

    delivered = asyncio.run(run())
    after = _idle()
    nobody = after["generated"] - before["generated"] - sum(delivered)
    assert sum(delivered) == FILL * fill_tokens
    print(f"queued, {'streaming' if stream else 'non-streaming'}: {nobody} tokens for nobody")
    assert nobody <= n * BLOCK, nobody
    assert after["streams"] == 0 and after["kv_pages_used"] == 0
    assert after["aborted"] - before["aborted"] <= n
    if after["aborted"] - before["aborted"] < n:  # some never reached the replica: the ingress counted them all
        samples = poll(ports, lambda got: _aborted(got, "client_disconnect") >= counted + n)
        assert _aborted(samples, "client_disconnect") - counted == n


def _aborted(samples, reason: str) -> float:
    return total(samples, "ray_mbd_requests_aborted_total", model_name=MODEL, reason=reason)


def test_a_request_deadline_ends_it_with_finish_reason_timeout(base):
    ports = export_ports()
    before = _aborted(scrape(ports), "deadline")
    with httpx.Client(timeout=120) as client:
        t0 = time.monotonic()
        r = client.post(f"{base}/v1/chat/completions", json=_body(1, False, 1000, timeout=0.5))
        took = time.monotonic() - t0
        body = r.json()
        with client.stream("POST", f"{base}/v1/chat/completions", json=_body(2, True, 1000, timeout=0.5)) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        bad = client.post(f"{base}/v1/chat/completions", json=_body(3, False, 16, timeout=-1))
    assert r.status_code == 200, body
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "timeout"
    assert body["usage"]["completion_tokens"] < 1000
    assert took < 30
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    assert events[-1] == "[DONE]"
    assert [c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]] == ["timeout"]
    assert bad.status_code == 400 and "timeout" in bad.text
    after = _idle()
    assert after["streams"] == 0 and after["kv_pages_used"] == 0
    samples = poll(ports, lambda got: _aborted(got, "deadline") >= before + 2)
    assert _aborted(samples, "deadline") - before == 2
