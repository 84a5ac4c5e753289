"""Paged KV cache benchmark (issue 17), on the ~60M random SDAR model of benchmarks/decode.py, one torch thread.

1. reuse: 64 requests sharing a 1,024-token prefix (a long system prompt, or the same k-shot exemplars for every
   problem of an eval sweep) with distinct 32-token suffixes, through 16 batch rows, with and without prefix
   reuse, in one run (order ABA...: `--repeats` runs of each, alternating; medians): prompt tokens the model
   computed, share of prefix tokens served from cached pages, TTFT p50 (all requests arrive at once; time to
   the first final token, queueing included), total TPS (generated tokens / wall time, prefill included).
   Greedy outputs are checked identical.
2. capacity: the KV bytes of a per-row cache for 8 slots of max_length, given as a page pool to 8 slots
   (today's concurrency) and to 32 slots: 64 short requests (32-token prompts); peak concurrently decoding
   requests and total TPS, alternating, medians; outputs checked identical.

    python -m benchmarks.prefix_cache                  # both parts (~15 minutes on 2 busy cores)
    python -m benchmarks.prefix_cache --parts reuse --requests 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.hf_baseline import random_sdar  # noqa: E402
from mbd.config import DecodeConfig  # noqa: E402
from mbd.decoding import Engine, EngineConfig  # noqa: E402

BLOCK = 4


def drive(engine: Engine, prompts: list[list[int]], new: int) -> dict:
    """Add every prompt at once and step until done: TTFT per request, wall time, peak decoding rows, outputs."""
    p0, h0, q0 = engine.stats.prefill_tokens, engine.stats.prefix_hit_tokens, engine.stats.prefix_query_tokens
    t0 = time.perf_counter()
    ids = [engine.add_request(p, {"max_new_tokens": new}) for p in prompts]
    first: dict[str, float] = {}
    out: dict[str, list[int]] = {i: [] for i in ids}
    peak = 0
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t0
        peak = max(peak, sum(r.decoding for r in engine.scheduler.running.values()))
    wall = time.perf_counter() - t0
    tokens = sum(len(v) for v in out.values())
    return {"ttft": statistics.median(first.values()), "tps": tokens / wall, "wall": wall, "peak": peak,
            "prefill": engine.stats.prefill_tokens - p0, "hits": engine.stats.prefix_hit_tokens - h0,
            "queried": engine.stats.prefix_query_tokens - q0, "outputs": [out[i] for i in ids]}


def side_by_side(engines: dict[str, Engine], make_prompts, new: int, repeats: int) -> dict[str, list[dict]]:
    """`repeats` runs of every engine, alternating order (AB, BA, ...); each run on fresh prompts (a new
    shared prefix), so a run never hits pages an earlier run left cached."""
    runs: dict[str, list[dict]] = {k: [] for k in engines}
    for r in range(repeats):
        prompts = make_prompts(r)
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            runs[name].append(drive(engines[name], prompts, new))
        outs = [runs[name][-1]["outputs"] for name in engines]
        assert all(o == outs[0] for o in outs), "greedy outputs differ between the engines"
    return runs


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def reuse(n_req: int, prefix: int, suffix: int, slots: int, new: int, tau: float, repeats: int) -> list[str]:
    model, cfg = random_sdar("60m", BLOCK, 2048)
    dc = DecodeConfig(buffer_size=1, max_new_tokens=new, max_length=2048, max_nfe=100_000, tau_m2t=tau)
    engines = {"no reuse": Engine(model, None, dc, EngineConfig(max_batch_rows=slots, prefix_caching=False)),
               "prefix reuse": Engine(model, None, dc, EngineConfig(max_batch_rows=slots))}

    def make(r: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(1000 + r)
        shared = torch.randint(0, cfg.vocab_size - 2, (prefix,), generator=g).tolist()
        return [shared + torch.randint(0, cfg.vocab_size - 2, (suffix,), generator=g).tolist() for _ in range(n_req)]

    runs = side_by_side(engines, make, new, repeats)
    base = runs["no reuse"]
    head = "| engine | prompt tokens computed | prefix tokens from cache | TTFT p50 s | total TPS | TTFT gain | TPS gain |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for name, rs in runs.items():
        served = med(rs, "hits") / (n_req * prefix)
        lines.append(f"| {name} | {med(rs, 'prefill'):,.0f} | {100 * served:.1f}% | {med(rs, 'ttft'):.2f} | "
                     f"{med(rs, 'tps'):.1f} | {med(base, 'ttft') / med(rs, 'ttft'):.2f}x | "
                     f"{med(rs, 'tps') / med(base, 'tps'):.2f}x |")
    return lines


def capacity(n_req: int, plen: int, new: int, tau: float, repeats: int, max_len: int = 2048) -> list[str]:
    model, cfg = random_sdar("60m", BLOCK, max_len)
    dc = DecodeConfig(buffer_size=1, max_new_tokens=new, max_length=max_len, max_nfe=100_000, tau_m2t=tau)
    per_row = Engine(model, None, dc, EngineConfig(max_batch_rows=8))  # the default pool: every slot can reach max_length
    budget = per_row.runner.cache.nbytes()
    engines = {"8 slots": per_row, "32 slots": Engine(model, None, dc, EngineConfig(max_batch_rows=32, kv_cache_bytes=budget))}

    def make(r: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(2000 + r)
        return torch.randint(0, cfg.vocab_size - 2, (n_req, plen), generator=g).tolist()

    runs = side_by_side(engines, make, new, repeats)
    lines = [f"KV budget {budget / 2**20:.0f} MiB (8 rows x {max_len} positions) for both",
             "| engine | peak decoding requests | total TPS | TPS gain |", "|---|---|---|---|"]
    for name, rs in runs.items():
        lines.append(f"| {name} | {med(rs, 'peak'):.0f} | {med(rs, 'tps'):.1f} | "
                     f"{med(rs, 'tps') / med(runs['8 slots'], 'tps'):.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="reuse,capacity")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--new", type=int, default=32, help="new tokens per request")
    ap.add_argument("--tau", type=float, default=0.3, help="tau_m2t (a random model is rarely confident)")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    parts = set(args.parts.split(","))
    print(f"CPU, 1 torch thread, random SDAR 60m, B={BLOCK}, SingleBD, tau_m2t {args.tau}, {args.new} new tokens, "
          f"{args.repeats} run(s) per engine, alternating, medians", flush=True)
    if "reuse" in parts:
        print(f"\n{args.requests} requests, a shared {args.prefix}-token prefix + distinct {args.suffix}-token suffixes, "
              f"{args.slots} slots\n" + "\n".join(reuse(args.requests, args.prefix, args.suffix, args.slots, args.new,
                                                         args.tau, args.repeats)), flush=True)
    if "capacity" in parts:
        print(f"\n{args.requests} short requests ({args.suffix}-token prompts), the same KV bytes\n"
              + "\n".join(capacity(args.requests, args.suffix, args.new, args.tau, args.repeats)), flush=True)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
