"""What a second resident block costs on this machine, and whether the engine adds anything to it
(issue 38 item 5, on CPU).

A Block Buffer step runs `slots` resident blocks through the model and the head on a window of `active` of them.
The physics of a step shape is the bare model forward of that shape (`ModelRunner.forward`: no scheduling, no
policy, no host bookkeeping). This benchmark:

1. runs SingleBD (N_buf 1) and MultiBD (N_buf 2) on the same random SDAR, prompts and thresholds, alternated
   (ABBA, `--repeats`), and records every decode step's shape and its thread-CPU time;
2. times the bare forward of each shape that occurred, alternated shape by shape on one live row;
3. prints per shape: steps of each system, the bare forward, the engine's step (median), their ratio; then the
   MultiBD / SingleBD step cost that the shapes' mix predicts from the bare forwards alone (the physics), the
   measured one, the TPF gain, and the tokens/s ratio. MultiBD wins tokens/s exactly when its TPF gain exceeds the
   step cost: the physics ratio is the break-even TPF gain that no engine change below the model forward can lower.

Thread-CPU time (one torch thread) so that other processes on a shared host do not enter the ratios.

    python -m benchmarks.buffer_physics                       # 60m model, B=32, batch 1, 2 x 128 new tokens
    python -m benchmarks.buffer_physics --size tiny --new 32 --repeats 1 --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.decode import MAX_LEN, decode_config  # noqa: E402
from benchmarks.hf_baseline import random_sdar  # noqa: E402
from mbd.decoding import Engine, EngineConfig  # noqa: E402

Shape = tuple[int, int]  # (slots run, logits window in slots)


class ShapeLog:
    """Wraps `engine.runner.run` to note each decode forward's (slots, active)."""

    def __init__(self, engine: Engine):
        self.run, self.last = engine.runner.run, None
        engine.runner.run = self

    def __call__(self, batch):
        self.last = (batch.slots, batch.active)
        return self.run(batch)


def decode(engine: Engine, log: ShapeLog, prompts: list[list[int]], new: int) -> tuple[int, int, list]:
    """(tokens, forwards, [(shape, thread-CPU s)]) of the prompts decoded one after another through one row; a
    step that also prefilled a prompt is counted in the mix but not timed."""
    for p in prompts:
        engine.add_request(p, {"max_new_tokens": new})
    steps, tokens, nfe = [], 0, 0
    while engine.has_unfinished():
        log.last, prefills, t = None, engine.stats.prefills, time.thread_time()
        outs = engine.step()
        dt = time.thread_time() - t
        if log.last is not None:
            steps.append((log.last, None if engine.stats.prefills != prefills else dt))
        for o in outs:
            if o.finished:
                tokens, nfe = tokens + o.num_generated, nfe + o.nfe
    return tokens, nfe, steps


def bare_forwards(engine: Engine, prompt: list[int], shapes: list[Shape], reps: int) -> dict[Shape, float]:
    """Median thread-CPU seconds of the bare forward of each shape, alternated shape by shape on one live row
    of `engine` (stepped until two blocks are resident, so every shape reads the same prefix)."""
    engine.add_request(prompt, {"max_new_tokens": 4 * engine.block})
    engine.step()  # admission and prefill
    while engine.scheduler.decode_batch().slots < 2:
        engine.step()
    runner, longest = engine.runner, engine.scheduler.decode_batch().max_committed
    times: dict[Shape, list[float]] = defaultdict(list)
    with torch.inference_mode():
        for s in shapes:  # positions and masks of each shape built before timing
            runner.forward(1, *s, longest)
        for rep in range(reps):
            for s in (shapes if rep % 2 == 0 else shapes[::-1]):
                t = time.thread_time()
                runner.forward(1, *s, longest)
                times[s].append(time.thread_time() - t)
    while engine.has_unfinished():
        engine.step()
    return {s: statistics.median(v) for s, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="60m", help="random SDAR size (benchmarks/hf_baseline.SIZES)")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--new", type=int, default=128, help="new tokens per request (2 requests, one row)")
    ap.add_argument("--tau", type=float, default=0.3, help="tau_m2t (tau_add, tau_semi: benchmarks.decode's)")
    ap.add_argument("--repeats", type=int, default=3, help="ABBA repeats of the two systems' runs")
    ap.add_argument("--reps", type=int, default=15, help="timings of each bare forward shape")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    B = args.block
    model, cfg = random_sdar(args.size, B, MAX_LEN)
    g = torch.Generator().manual_seed(B * 1000 + 1)  # benchmarks.decode's buffer part: the same prompts
    prompts = torch.randint(0, cfg.vocab_size - 2, (3, 64), generator=g).tolist()
    engines = {n: Engine(model, None, decode_config(n, B, args.tau), EngineConfig(max_batch_rows=1)) for n in (1, 2)}
    logs = {n: ShapeLog(e) for n, e in engines.items()}
    for n, e in engines.items():  # warm: allocators, sdpa spans
        decode(e, logs[n], prompts[:1], 2 * B)
    runs: dict[int, list] = {n: [] for n in engines}
    for rep in range(args.repeats):
        for n in ((1, 2) if rep % 2 == 0 else (2, 1)):
            runs[n].append(decode(engines[n], logs[n], prompts[:2], args.new))
    mix = {n: [s for r in rs for s, _ in r[2]] for n, rs in runs.items()}
    timed = {n: defaultdict(list) for n in engines}
    for n, rs in runs.items():
        for r in rs:
            for s, dt in r[2]:
                if dt is not None:
                    timed[n][s].append(dt)
    shapes = sorted(set(mix[1]) | set(mix[2]))
    bare = bare_forwards(engines[2], prompts[2], shapes, args.reps)

    print(f"CPU, 1 torch thread, thread-CPU clock; random SDAR '{args.size}', B={B}, batch 1, 2 requests x "
          f"{args.new} new tokens, tau_m2t {args.tau}, {args.repeats} ABBA repeats, bare forwards x {args.reps}\n")
    print("| slots, logits window | N_buf 1 steps | N_buf 2 steps | bare forward ms | N_buf 1 step ms "
          "| N_buf 2 step ms | step / bare (1, 2) |\n|---|---|---|---|---|---|---|")
    for s in shapes:
        cells = []
        for n in (1, 2):
            t = timed[n].get(s)
            cells.append((1e3 * statistics.median(t), statistics.median(t) / bare[s]) if t else None)
        ms = " | ".join(f"{c[0]:.1f}" if c else "-" for c in cells)
        ratio = ", ".join(f"{c[1]:.2f}" if c else "-" for c in cells)
        print(f"| {s[0]}, {s[1]} | {mix[1].count(s)} | {mix[2].count(s)} | {1e3 * bare[s]:.1f} | {ms} | {ratio} |")
    per_step = {n: statistics.mean(bare[s] for s in mix[n]) for n in engines}
    measured = {n: statistics.mean(t for ts in timed[n].values() for t in ts) for n in engines}
    tpf = {n: sum(r[0] for r in rs) / sum(r[1] for r in rs) for n, rs in runs.items()}
    tps = {n: statistics.median(r[0] / sum(dt for _, dt in r[2] if dt is not None) for r in rs)
           for n, rs in runs.items()}
    physics, cost, gain = per_step[2] / per_step[1], measured[2] / measured[1], tpf[2] / tpf[1]
    print(f"\nMultiBD / SingleBD step cost: physics (the mix of bare forwards) {physics:.2f}, measured {cost:.2f} "
          f"(engine / physics {cost / physics:.2f})\nTPF {tpf[1]:.2f} -> {tpf[2]:.2f} (gain {gain:.2f}); tokens/s "
          f"ratio {tps[2] / tps[1]:.2f} (the rule TPF gain / cost: {gain / cost:.2f}); break-even TPF gain on this "
          f"machine = the physics ratio, {physics:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
