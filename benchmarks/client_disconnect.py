"""Tokens generated for clients that went away, on the tiny service, through each HTTP front.

The tiny service (configs/serve/tiny.yaml, the embedded MBD model) on a local Ray cluster. Three ways for --drop
clients to go (issue 65), each measured --rounds times: running streams closed after two events; streaming requests
closed --leave-s after sending, queued behind --fill requests that keep every batch row busy; non-streaming
requests whose clients time out after --timeout-s while queued the same way. Every request asks for --max-tokens
with ignore_eos, so a request nobody aborts generates exactly that many. Tokens for nobody = what the decoder
replica counted its engine emitting (`generated`) less what the clients that stayed received (the background
requests' completion tokens, the closed streams' tokens read from their per-token logprobs).

Each case runs against the Serve front the cluster has (HAProxy in Ray Serve's high-throughput mode, this project's
default, or Serve's Python proxy with RAY_SERVE_ENABLE_HA_PROXY=0) and, with HAProxy, also against the ingress
replica's own HTTP port (what HAProxy forwards to). Loopback only; every loop is bounded.

    python -m benchmarks.client_disconnect                              # HAProxy front + the ingress port
    RAY_SERVE_ENABLE_HA_PROXY=0 python -m benchmarks.client_disconnect  # Serve's Python proxy
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import psutil

from actors.tp_worker import free_port
from mbd.tiny.task import generate as tiny_problems
from pipelines.ray_session import init_ray
from serve_app.config import load_serve_config

REPO = Path(__file__).resolve().parents[1]
CASES = ("running streams closed after 2 events", "queued streams closed", "queued non-streaming timed out")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "serve" / "tiny.yaml"))
    p.add_argument("--drop", type=int, default=8, help="clients that go away per case")
    p.add_argument("--fill", type=int, default=64, help="background requests queued in front of them")
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--leave-s", type=float, default=0.3)
    p.add_argument("--timeout-s", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cpus", type=int, default=2)
    return p.parse_args(argv)


class Bench:
    def __init__(self, args: argparse.Namespace, model: str, stats):
        self.args, self.model, self.stats = args, model, stats
        self.prompts = [p["question"] for p in tiny_problems("heldout", args.fill + args.drop, seed=7)]

    def body(self, i: int, stream: bool, **kw) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": self.prompts[i]}], "stream": stream,
                "max_tokens": self.args.max_tokens, "ignore_eos": True, **kw}

    async def idle(self) -> dict:
        deadline = time.monotonic() + 120
        while (s := await asyncio.to_thread(self.stats))["streams"] and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        return s

    async def running(self, url: str) -> int:
        """Streams closed after two events: the tokens their clients read."""
        async with httpx.AsyncClient(timeout=120) as http:
            async def one(i: int) -> int:
                got, events = 0, 0
                async with http.stream("POST", f"{url}/v1/chat/completions",
                                       json=self.body(i, True, logprobs=True)) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            got += sum(len((c.get("logprobs") or {}).get("content") or [])
                                       for c in json.loads(line[6:])["choices"])
                            events += 1
                            if events == 2:
                                break
                return got
            return sum(await asyncio.gather(*(one(i) for i in range(self.args.drop))))

    async def queued(self, url: str, stream: bool) -> int:
        """Requests that leave while queued behind --fill others: the tokens the others received."""
        a = self.args
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=a.fill + a.drop)) as http:
            async def fill(i: int) -> int:
                r = await http.post(f"{url}/v1/chat/completions", json=self.body(a.drop + i, False))
                return r.json()["usage"]["completion_tokens"]
            background = asyncio.gather(*(fill(i) for i in range(a.fill)))
            deadline = time.monotonic() + 60
            while (await asyncio.to_thread(self.stats)).get("waiting", 0) == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)

            async def leave(i: int) -> None:
                try:
                    async with httpx.AsyncClient(timeout=a.leave_s if stream else a.timeout_s) as c:
                        if stream:
                            async with c.stream("POST", f"{url}/v1/chat/completions", json=self.body(i, True)):
                                pass
                        else:
                            await c.post(f"{url}/v1/chat/completions", json=self.body(i, False))
                except httpx.TimeoutException:
                    pass
            await asyncio.gather(*(leave(i) for i in range(a.drop)))
            return sum(await background)

    async def case(self, k: int, url: str) -> int:
        before = await self.idle()
        received = await (self.running(url) if k == 0 else self.queued(url, stream=k == 1))
        after = await self.idle()
        return after["generated"] - before["generated"] - received


def ingress_url(app: str, route: str) -> str | None:
    """The ingress replica's own HTTP port (HAProxy mode), found by its process title."""
    title = f"ServeReplica:{app}:OpenAIIngress"
    for proc in psutil.process_iter(["cmdline"]):
        if title in " ".join(proc.info["cmdline"] or []):
            for c in proc.net_connections("tcp"):
                if c.status == psutil.CONN_LISTEN:
                    url = f"http://127.0.0.1:{c.laddr.port}{route}"
                    try:
                        if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                            return url
                    except httpx.HTTPError:
                        pass
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_serve_config(args.config)
    import ray
    from ray import serve

    from serve_app.app import build_app

    init_ray(num_cpus=args.cpus, logging_level="ERROR", log_to_driver=False)
    port = free_port()
    haproxy = os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "1") != "0"
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"serve_config": cfg}), name="bench", route_prefix="/bench")
        handle = serve.get_deployment_handle("Decoder", app_name="bench")
        bench = Bench(args, cfg.model.name, lambda: handle.stats.remote().result())
        fronts = {"HAProxy" if haproxy else "Serve's Python proxy": f"http://127.0.0.1:{port}/bench"}
        if haproxy and (direct := ingress_url("bench", "/bench")):
            fronts["the ingress replica's own port"] = direct
        out = {front: {CASES[k]: [asyncio.run(bench.case(k, url)) for _ in range(args.rounds)] for k in range(3)}
               for front, url in fronts.items()}
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"{args.drop} clients that go away per case, {args.max_tokens} tokens each if never aborted "
          f"({args.drop * args.max_tokens}); {args.fill} background requests; tokens generated for nobody per round:")
    for front, cases in out.items():
        for case, nobody in cases.items():
            print(f"  {front:>32} | {case:<40} | {nobody}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
