"""The README's serve command, scored: held-out tinymath problems asked over HTTP of the served default.

Starts the app of --config (default configs/serve/tiny.yaml: the embedded MBD model at the tiny MultiBD operating
point) on a local Ray cluster, sends the first --problems held-out problems as chat requests (--clients at a time,
greedy, max_tokens --max-tokens), scores each answer as the evaluation does (GSM8K's final-number rule) and prints
the accuracy with its 95% Wilson interval, the mean TPF the service reported, and a JSON line. Loopback only.

    python -m benchmarks.served_accuracy                       # 1,000 problems through configs/serve/tiny.yaml
    python -m benchmarks.served_accuracy --set model.path=mbd/assets/tiny   # the base, at the same point
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math

import httpx

from actors.tp_worker import free_port
from mbd.eval.math_scoring import score_gsm8k
from mbd.tiny.benchmark import TinyMath
from pipelines.ray_session import init_ray
from serve_app.config import load_serve_config


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p, d = k / n, 1 + z * z / n
    mid, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return mid - half, mid + half


async def ask_all(url: str, model: str, prompts: list[str], clients: int, max_tokens: int) -> list[dict]:
    gate = asyncio.Semaphore(clients)
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=clients)) as http:
        async def one(text: str) -> dict:
            async with gate:
                r = await http.post(f"{url}/v1/chat/completions", json={
                    "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens})
                r.raise_for_status()
                return r.json()
        return await asyncio.gather(*(one(t) for t in prompts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/serve/tiny.yaml")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--problems", type=int, default=1000)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128, help="the evaluation's max_new_tokens for tinymath")
    p.add_argument("--cpus", type=int, default=2)
    args = p.parse_args(argv)
    cfg = load_serve_config(args.config, args.sets)
    import ray
    from ray import serve

    from serve_app.app import build_app

    problems = TinyMath().load(limit=args.problems)
    init_ray(num_cpus=args.cpus, logging_level="ERROR", log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"serve_config": cfg}), name="acc", route_prefix="/acc")
        answers = asyncio.run(ask_all(f"http://127.0.0.1:{port}/acc", cfg.model.name,
                                      [q.prompt_text for q in problems], args.clients, args.max_tokens))
    finally:
        serve.shutdown()
        ray.shutdown()
    correct = sum(score_gsm8k(a["choices"][0]["message"]["content"], q.reference).correct
                  for a, q in zip(answers, problems))
    n, lo_hi = len(problems), wilson(correct, len(problems))
    tpf = sum(a["mbd"]["num_generated"] for a in answers) / sum(a["mbd"]["nfe"] for a in answers)
    print(f"{cfg.model.path} at buffer_size {cfg.decode.buffer_size} (tau_add {cfg.decode.tau_add}, tau_semi "
          f"{cfg.decode.tau_semi}, tau_m2t {cfg.decode.tau_m2t}) over HTTP: {correct}/{n} = {100 * correct / n:.2f}% "
          f"[95% Wilson {100 * lo_hi[0]:.2f}, {100 * lo_hi[1]:.2f}], TPF {tpf:.2f}")
    print(json.dumps({"model": cfg.model.path, "n": n, "correct": correct, "accuracy": correct / n,
                      "wilson95": lo_hi, "tpf": tpf}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
