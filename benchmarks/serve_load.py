"""Serving load test: throughput and p50/p99 latency at 1, 8, 32 and 64 concurrent clients over HTTP (Ray Serve,
configs/serve/tiny.yaml), and the same workload on the engine called directly in this process.

Each client is closed-loop (sends its next request when the previous one returns). The direct run keeps the
same number of requests in flight through `add_request`/`step`, so HTTP/direct ratios measured in one run are
the cost of the service (HTTP, validation, tokenization, Serve routing, the Ray stream of committed blocks and
the hand-off to the engine process). Direct and HTTP rounds alternate and the best round of each is kept, because this
machine is shared; on an oversubscribed machine the multi-process HTTP path gets more CPU shares than the
single direct process, so read the ratios together with the machine load.

The machine's 1-minute load average is printed beside each level (this machine may be shared).

    python -m benchmarks.serve_load                          # the embedded model (mbd/assets/tiny)
    python -m benchmarks.serve_load --size 60m               # a random ~60M SDAR: a step costs what a real one does
    python -m benchmarks.serve_load --model DIR --max-tokens 48
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from actors.tp_worker import free_port
from benchmarks.hf_baseline import SIZES, TEMPER
from mbd.config import ModelConfig
from mbd.decoding import Engine, EngineConfig
from mbd.model import build_model, load_checkpoint, save_checkpoint
from mbd.tiny.task import generate as tiny_problems
from mbd.tiny.vocab import save_tokenizer, special_token_ids, vocab
from mbd.tokenizer import Tokenizer
from pipelines.ray_session import init_ray
from serve_app.config import ServeConfig, load_serve_config

REPO = Path(__file__).resolve().parents[1]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def summary(lat_s: list[float], tokens: int, wall_s: float) -> dict:
    return {"requests": len(lat_s), "req_per_s": len(lat_s) / wall_s, "tok_per_s": tokens / wall_s,
            "p50_ms": 1e3 * statistics.median(lat_s), "p99_ms": 1e3 * percentile(lat_s, 0.99)}


def heldout_messages(n: int) -> list[list[dict]]:
    """The first n held-out tinymath problems as chat conversations (one user turn each, as the evaluation sends
    them zero-shot)."""
    return [[{"role": "user", "content": r["question"]}] for r in tiny_problems("heldout", n, seed=0)]


def random_model(size: str, d: Path) -> Path:
    """A random SDAR of hf_baseline's `size` that speaks the tiny chat tokenizer: head rows outside the tokenizer's
    vocabulary, and those of EOS, end-of-turn and mask, are zero while the rest are tempered up, so a request
    always generates its whole max_tokens of printable characters (comparable runs, real detokenization)."""
    ids, n_chars = special_token_ids(), len(vocab())
    cfg = ModelConfig(family="sdar", mask_token_id=ids["mask_token_id"], eos_token_id=ids["eos_token_id"],
                      pad_token_id=ids["pad_token_id"], block_size=4, max_position_embeddings=1024, rms_norm_eps=1e-6,
                      **SIZES[size] | {"vocab_size": max(SIZES[size]["vocab_size"], n_chars)})
    model = build_model(cfg, seed=0).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(TEMPER)
        model.lm_head.weight[n_chars:] = 0
        model.lm_head.weight[[ids["eos_token_id"], ids["im_end_id"], ids["mask_token_id"]]] = 0
    save_checkpoint(model, cfg, d)
    save_tokenizer(d)
    return d


def run_direct(engine: Engine, prompts: list[list[int]], conc: int, max_tokens: int) -> dict:
    """`conc` requests in flight through the engine's own API (what `conc` HTTP clients keep busy)."""
    params = engine.cfg.model_copy(update={"max_new_tokens": max_tokens})
    todo, started, lat, tokens = list(prompts), {}, [], 0
    t0 = time.perf_counter()
    while todo or started:
        while todo and len(started) < conc:
            started[engine.add_request(todo.pop(), params)] = time.perf_counter()
        for o in engine.step():
            tokens += len(o.new_token_ids)
            if o.finished:
                lat.append(time.perf_counter() - started.pop(o.request_id))
    return summary(lat, tokens, time.perf_counter() - t0)


async def run_http(url: str, model: str, messages: list[list[dict]], conc: int, max_tokens: int) -> dict:
    todo, lat, tokens = list(messages), [], 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while todo:
            body = {"model": model, "messages": todo.pop(), "max_tokens": max_tokens}
            t = time.perf_counter()
            r = await http.post(url, json=body)
            r.raise_for_status()
            lat.append(time.perf_counter() - t)
            tokens += r.json()["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(conc)))
        return summary(lat, tokens, time.perf_counter() - t0)


async def run_http_stream(url: str, model: str, messages: list[list[dict]], conc: int, max_tokens: int,
                          ignore_eos: bool = True) -> dict:
    """Closed-loop streaming chat clients (ignore_eos: exactly max_tokens each; else each stops at its EOS):
    TTFT = request start to the first non-empty content chunk; ITL = (latency - TTFT) / (completion tokens - 1),
    as guidellm defines it; TPF = completion tokens over the forwards the service reported (`mbd.nfe`)."""
    todo, lat, ttft, itl, tokens, nfe = list(messages), [], [], [], 0, 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens, nfe
        while todo:
            body = {"model": model, "messages": todo.pop(), "max_tokens": max_tokens, "ignore_eos": ignore_eos,
                    "stream": True, "stream_options": {"include_usage": True}}
            t, first, n = time.perf_counter(), None, 0
            async with http.stream("POST", url, json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    ev = json.loads(line[6:])
                    if first is None and any(c["delta"].get("content") for c in ev["choices"]):
                        first = time.perf_counter()
                    if ev.get("usage"):
                        n = ev["usage"]["completion_tokens"]
                    if ev.get("mbd"):
                        nfe += ev["mbd"]["nfe"]
            end = time.perf_counter()
            lat.append(end - t)
            ttft.append((first or end) - t)
            if n > 1:
                itl.append((end - (first or end)) / (n - 1))
            tokens += n

    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(conc)))
        out = summary(lat, tokens, time.perf_counter() - t0)
    return out | {"ttft_p50_ms": 1e3 * statistics.median(ttft), "itl_p50_ms": 1e3 * statistics.median(itl),
                  "tpf": tokens / nfe if nfe else 0.0}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "serve" / "tiny.yaml"))
    p.add_argument("--model", help="model directory (default: the config's model.path)")
    p.add_argument("--size", choices=sorted(SIZES), help="serve a random SDAR of this size instead of the model")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--per-client", type=int, default=4, help="requests per client (at least 16 per level)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray instance")
    p.add_argument("--rounds", type=int, default=2, help="alternating direct/HTTP rounds; the best is kept")
    return p.parse_args(argv)


def served_config(args: argparse.Namespace) -> ServeConfig:
    """The serve config with the model the arguments name (a random one of `--size`, or `--model`)."""
    cfg: ServeConfig = load_serve_config(args.config)
    if args.size:
        args.model = str(random_model(args.size, Path(tempfile.mkdtemp(prefix=f"sdar_{args.size}_"))))
    if args.model:
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": args.model})})
    if not (cfg.model.resolved_path() / "config.json").is_file():
        raise SystemExit(f"no model at {cfg.model.resolved_path()}: train it (`mbd pretrain-tiny`) or pass --model DIR")
    return cfg


def run_levels(args: argparse.Namespace, cfg: ServeConfig, engine: Engine, ids: list[list[int]],
               messages: list[list[dict]]) -> dict[int, dict]:
    """Per concurrency level: direct and HTTP rounds alternated, the best of each kept, with the load average."""
    import ray
    from ray import serve

    from serve_app.app import build_app

    init_ray(num_cpus=args.cpus, logging_level="ERROR", log_to_driver=False)
    port = free_port()
    results: dict[int, dict] = {}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"serve_config": cfg}), name="bench", route_prefix="/")
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        run_direct(engine, ids[:2], 2, args.max_tokens)  # warm-up
        asyncio.run(run_http(url, cfg.model.name, messages[:2], 2, args.max_tokens))
        for c in args.concurrency:
            n = max(16, c * args.per_client)
            runs: dict[str, list[dict]] = {"direct": [], "http": []}
            load = os.getloadavg()[0]
            for _ in range(args.rounds):  # alternate, so both paths see the same background load
                runs["direct"].append(run_direct(engine, ids[:n], c, args.max_tokens))
                runs["http"].append(asyncio.run(run_http(url, cfg.model.name, messages[:n], c, args.max_tokens)))
            results[c] = {k: max(v, key=lambda s: s["req_per_s"]) for k, v in runs.items()}
            results[c]["load"] = (load + os.getloadavg()[0]) / 2
    finally:
        serve.shutdown()
        ray.shutdown()
    return results


def report(args: argparse.Namespace, cfg: ServeConfig, results: dict[int, dict]) -> None:
    """The table of HTTP against direct per level, and every number as one JSON line."""
    print(f"model {args.size or cfg.model.resolved_path().name}, buffer_size {cfg.decode.buffer_size}, max_batch_rows "
          f"{cfg.engine.max_batch_rows}, max_tokens {args.max_tokens}, torch threads 1, Ray CPUs {args.cpus}, "
          f"best of {args.rounds} alternating rounds; load = 1-min load average during the level "
          f"({os.cpu_count()} CPUs)")
    print("| clients | direct req/s | HTTP req/s | HTTP / direct | p50 direct | p50 HTTP | p50 added | load |")
    print("|---|---|---|---|---|---|---|---|")
    for c, r in results.items():
        d, h = r["direct"], r["http"]
        r["http_over_direct"] = {"p50_latency": h["p50_ms"] / d["p50_ms"], "p50_added_ms": h["p50_ms"] - d["p50_ms"],
                                 "throughput": h["req_per_s"] / d["req_per_s"]}
        print(f"| {c} | {d['req_per_s']:.1f} | {h['req_per_s']:.1f} | {r['http_over_direct']['throughput']:.2f} | "
              f"{d['p50_ms']:.0f} ms | {h['p50_ms']:.0f} ms | {h['p50_ms'] - d['p50_ms']:+.0f} ms | {r['load']:.1f} |")
    print(json.dumps({str(c): r for c, r in results.items()}))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    cfg = served_config(args)
    path = cfg.model.resolved_path()
    n_max = max(max(16, c * args.per_client) for c in args.concurrency)
    messages = heldout_messages(n_max)
    model, mcfg = load_checkpoint(path)
    tok = Tokenizer.from_dir(path, mcfg)
    engine = Engine(model, tok, cfg.decode, EngineConfig(max_batch_rows=cfg.engine.max_batch_rows))
    report(args, cfg, run_levels(args, cfg, engine, [tok.encode_chat(m) for m in messages], messages))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
