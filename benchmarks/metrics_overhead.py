"""What the engine loop pays for metrics, on the embedded tiny model (the shortest step, so the largest share).

The engine process pays for two things (the replica and the ingress, in other processes, pay the rest):
1. per decode step, the Block Buffer counters of `EngineStats` (`decode_rows`, `active_blocks`): timed here
   on the live batch of each step, against the step's own time;
2. at most every ON_STEP_S (and when it goes idle), `engine_stats` and pickling it for the socket: rounds
   alternate A (steps only) and B (a report after EVERY step, far above the real rate), and each report is
   timed where it runs. Medians of per-round medians. The report's own time, not B - A, is the cost: on a
   shared machine the difference of two step medians is noise far larger than a report.

    python -m benchmarks.metrics_overhead                 # 8 rows, 64 new tokens, 6 rounds of each arm
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.engine_process import ON_STEP_S, engine_stats  # noqa: E402
from mbd.config import DecodeConfig, EngineConfig  # noqa: E402
from mbd.decoding.spec import build_engine  # noqa: E402
from mbd.tiny.task import generate as tiny_problems  # noqa: E402


def one_round(engine, prompts: list[str], new: int, report: bool) -> tuple[float, float, float]:
    """Median step time (s) of one batch decoded to the end, of the per-step counters, of a report (B only)."""
    for p in prompts:
        engine.add_request(engine.encode(p), {"max_new_tokens": new})
    steps, counters, reports = [], [], []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
        if report:
            t = time.perf_counter()
            pickle.dumps(engine_stats(engine, len(prompts)))
            reports.append(time.perf_counter() - t)
        reqs = list(engine.scheduler.running.values())
        t = time.perf_counter()
        _ = len(reqs), sum(r.n_res - r.n_tc for r in reqs)  # what postprocess adds per step
        counters.append(time.perf_counter() - t)
    return statistics.median(steps), statistics.median(counters), statistics.median(reports or [0.0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    torch.set_num_threads(1)
    decode = DecodeConfig(buffer_size=2, tau_add=0.1, tau_semi=0.9, max_new_tokens=a.new)
    engine = build_engine("mbd/assets/tiny", decode, EngineConfig(device="cpu", max_batch_rows=a.rows))
    prompts = [p["question"] for p in tiny_problems("heldout", a.rows, seed=0)]
    one_round(engine, prompts, a.new, False)  # warm
    runs: dict[bool, list[float]] = {False: [], True: []}
    counter_s, report_s = [], []
    for _ in range(a.rounds):
        for report in (False, True):
            step, counters, rep = one_round(engine, prompts, a.new, report)
            runs[report].append(step)
            counter_s.append(counters)
            if report:
                report_s.append(rep)
    a_step, b_step = statistics.median(runs[False]), statistics.median(runs[True])
    counters, rep = statistics.median(counter_s), statistics.median(report_s)
    per_step = rep * min(1.0, a_step / ON_STEP_S)  # one report per ON_STEP_S, at most one per step
    print(f"step median: A (steps only) {a_step * 1e3:.3f} ms, B (+ a report every step) {b_step * 1e3:.3f} ms")
    print(f"per-step counters {counters * 1e6:.2f} us ({100 * counters / a_step:.4f}% of a step); one report "
          f"{rep * 1e6:.1f} us ({100 * rep / a_step:.3f}% of a step if every step; {100 * per_step / a_step:.4f}% "
          f"at one per {ON_STEP_S} s)")
    print(f"metrics cost of the engine loop: {100 * (counters + per_step) / a_step:.4f}% of its step time")

if __name__ == "__main__":
    main()
