"""Requests that crash the engine, measured over HTTP on the tiny service (configs/serve/tiny.yaml, the embedded
model), with the test suite's injection (tests/integration/poison.py: a prompt holding POISON makes the engine
process raise on the request's N-th forward, counted across engines; the product has no such hook).

Case `culprit` (per --nth): 8 innocent completions are first run one by one (their uninterrupted text), then the 8
again with 1 poisonous one, all at once, half streaming. Counted: innocents that completed with exactly their
uninterrupted text, the poison's status and message, /health probes (every 0.1 s) that were not 200, and the
longest span of 503s met by a probe client that sends a small completion every 0.25 s throughout.
Case `ten`: --clients closed-loop innocent clients run while 10 poisonous requests arrive within a minute (one
every 6 s). Counted: each side's outcomes, the longest 503 span, whether the replica gave up.

    python -m benchmarks.poison_requests                  # culprit at --nth 1 and 6, then ten
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import httpx

from actors.tp_worker import free_port
from pipelines.ray_session import init_ray
from serve_app.config import load_serve_config
from tests.integration.poison import INNOCENT, POISON, POISON_ENV, SITE, STEP_ENV

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "serve" / "tiny.yaml"))
    p.add_argument("--nth", type=int, nargs="+", default=[1, 6], help="the poison crashes on its N-th step")
    p.add_argument("--clients", type=int, default=8, help="innocent clients of case `ten`")
    p.add_argument("--no-ten", action="store_true", help="only the `culprit` cases")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--cpus", type=int, default=2)
    return p.parse_args(argv)


async def complete(http: httpx.AsyncClient, url: str, model: str, prompt: str, stream: bool, max_tokens: int
                   ) -> tuple[int, str]:
    """(status, text or error message); a stream's text is its pieces joined ('error' events reported)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    try:
        if not stream:
            r = await http.post(url, json=body)
            j = r.json()
            return r.status_code, j["choices"][0]["text"] if r.status_code == 200 else j["error"]["message"]
        async with http.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return r.status_code, json.loads(await r.aread())["error"]["message"]
            events = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: {")]
        errors = [e["error"]["message"] for e in events if "error" in e]
        return (500, errors[0]) if errors else (200, "".join(c["text"] for e in events for c in e["choices"]))
    except httpx.HTTPError as e:
        return 0, repr(e)


def span_503(times: list[tuple[float, int]]) -> float:
    """The longest run of consecutive 503 answers, first to last, in seconds."""
    longest, start = 0.0, None
    for t, code in times:
        if code == 503:
            start = t if start is None else start
            longest = max(longest, t - start)
        else:
            start = None
    return round(longest, 2)


async def watch(http: httpx.AsyncClient, base: str, model: str, stop: asyncio.Event) -> tuple[list, list]:
    """/health every 0.1 s and a small completion every 0.25 s until `stop`."""
    health, probes = [], []

    async def health_loop() -> None:
        while not stop.is_set():
            r = await http.get(f"{base}/health")
            health.append((r.status_code, r.json().get("status")))
            await asyncio.sleep(0.1)

    async def probe_loop() -> None:
        while not stop.is_set():
            code, _ = await complete(http, f"{base}/v1/completions", model, "2+2=", False, 4)
            probes.append((time.monotonic(), code))
            await asyncio.sleep(0.25)

    await asyncio.gather(health_loop(), probe_loop())
    return health, probes


async def culprit(base: str, model: str, max_tokens: int) -> dict:
    url = f"{base}/v1/completions"
    async with httpx.AsyncClient(timeout=600) as http:
        alone = [await complete(http, url, model, p, False, max_tokens) for p in INNOCENT]
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(http, base, model, stop))
        got = await asyncio.gather(*(complete(http, url, model, p, i % 2 == 0, max_tokens) for i, p in
                                     enumerate(INNOCENT[:4] + [f"1+{POISON}="] + INNOCENT[4:])))
        stop.set()
        health, probes = await watcher
    poison = got.pop(4)
    return {"innocents_complete": sum(g[0] == 200 for g in got), "innocents_equal_uninterrupted":
            sum(g == a for g, a in zip(got, alone)), "poison_status": poison[0], "poison_message": poison[1][:160],
            "health_not_200": sum(c != 200 for c, _ in health), "health_states": sorted({s for _, s in health}),
            "probe_503_span_s": span_503(probes), "probes": len(probes)}


async def ten(base: str, model: str, clients: int, max_tokens: int) -> dict:
    url = f"{base}/v1/completions"
    innocent: list[int] = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=600) as http:
        async def client(k: int) -> None:
            n = 0
            while not stop.is_set():
                code, _ = await complete(http, url, model, f"{k}+{n}=", n % 2 == 0, max_tokens)
                innocent.append(code)
                n += 1

        async def poisons() -> list[int]:
            out = []
            for i in range(10):
                out.append(asyncio.create_task(complete(http, url, model, f"{i}*{POISON}=", False, max_tokens)))
                await asyncio.sleep(6)
            return [(await t)[0] for t in out]

        watcher = asyncio.create_task(watch(http, base, model, stop))
        workers = [asyncio.create_task(client(k)) for k in range(clients)]
        poisoned = await poisons()
        stop.set()
        await asyncio.gather(*workers)
        health, probes = await watcher
    return {"poison_statuses": sorted(poisoned), "innocent_outcomes": {str(c): innocent.count(c) for c in
            sorted(set(innocent))}, "probe_503_span_s": span_503(probes),
            "probe_outcomes": {str(c): [p for _, p in probes].count(c) for c in sorted({p for _, p in probes})},
            "health_states": sorted({s for _, s in health})}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_serve_config(args.config)
    import ray
    from ray import serve

    from serve_app.app import ONE_LOOP, build_app

    results = {}
    for case in [*(f"culprit@{n}" for n in args.nth), *([] if args.no_ten else ["ten"])]:
        nth = int(case.split("@")[1]) if "@" in case else 1
        tok_ids = ",".join(map(str, _poison_ids(cfg)))
        path = os.pathsep.join([SITE, str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        ONE_LOOP["env_vars"] = ONE_LOOP["env_vars"] | {POISON_ENV: tok_ids, STEP_ENV: str(nth), "PYTHONPATH": path}
        init_ray(num_cpus=args.cpus, logging_level="ERROR", log_to_driver=False)
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_app({"serve_config": cfg}), name="bench", route_prefix="/")
            base = f"http://127.0.0.1:{port}"
            t0 = time.monotonic()
            out = asyncio.run(culprit(base, cfg.model.name, args.max_tokens) if case != "ten" else
                              ten(base, cfg.model.name, args.clients, args.max_tokens))
            stats = serve.get_deployment_handle("Decoder", app_name="bench").stats.remote().result()
        finally:
            serve.shutdown()
            ray.shutdown()
        out |= {"wall_s": round(time.monotonic() - t0, 1), "load": round(os.getloadavg()[0], 1),
                "replica": {k: stats.get(k) for k in ("engine_restarts", "readmitted", "resumed", "quarantined",
                                                      "trials")}}
        results[case] = out
        print(f"{case}: {out}", flush=True)
    print(json.dumps(results))
    return 0


def _poison_ids(cfg) -> list[int]:
    from mbd.checkpoint_files import read_model_config
    from mbd.tokenizer import Tokenizer

    path = cfg.model.resolved_path()
    return Tokenizer.from_dir(path, read_model_config(path)).encode(POISON)


if __name__ == "__main__":
    raise SystemExit(main())
