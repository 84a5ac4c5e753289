"""MultiBD's speedup over SingleBD as the batch grows (issue 64): tokens/s of the two decode points on held-out
tinymath problems, per batch, with the positions each forward ran against those its rows needed.

SingleBD decodes with `configs/decode/tiny_singlebd.yaml` over `--single` (the shipped base), MultiBD with
`configs/decode/tiny_multibd.yaml` over `--multi` (MBD-tiny, `mbd/assets/mbd-tiny` when shipped; else the base:
the same weights for both).
Per batch size, one engine per point (`max_batch_rows` = batch, power-of-two buckets, a KV pool with room for every
row), the first `--problems` held-out problems (zero-shot chat prompts, as the sweeps send them), `--rounds` runs
alternated ABAB after an untimed warm-up run each, one torch thread. Reported per point, medians over rounds:
tokens/s (generated tokens over the thread-CPU time of the whole `generate`: the host's other load stays out;
wall-clock in a second column; the MBD / SingleBD ratio also as the range of its per-round values), TPF, query positions run / positions the rows needed (their resident slots),
positions run per generated token, and the host share of a step: the time of decode steps (`EngineStats.step_s`:
schedule, forward, policy, bookkeeping, uploads, the device-to-host copy) outside the model forward
(`ModelRunner.forward`) over the forward's own, wall-clock. "Forwards only" is the tokens/s ratio counting the
decode forwards' time alone (the bound if a step's host work and the prompts' prefill cost nothing).

    python -m benchmarks.batch_speedup                                  # 64 problems, batch 1, 4, 16, 64
    python -m benchmarks.batch_speedup --multi /tmp/run/mbd-tiny --problems 32 --batches 1 16 --rounds 5
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

from mbd.config import load_decode  # noqa: E402
from mbd.decoding import Engine  # noqa: E402
from mbd.decoding.scheduler import power_of_two_buckets  # noqa: E402
from mbd.decoding.spec import build_engine, load_engine_model  # noqa: E402
from mbd.eval.prompts import chat_messages  # noqa: E402
from mbd.tiny.benchmark import TinyMath  # noqa: E402

MBD_TINY = ROOT / "mbd/assets/mbd-tiny"
CONFIGS = {"SingleBD": ROOT / "configs/decode/tiny_singlebd.yaml", "MultiBD": ROOT / "configs/decode/tiny_multibd.yaml"}


class ForwardClock:
    """Wraps `engine.runner.forward` to sum the seconds of the model forwards of decode steps (wall-clock, as the
    engine's own `step_s` that it is compared with)."""

    def __init__(self, engine: Engine):
        self.forward, self.seconds = engine.runner.forward, 0.0
        engine.runner.forward = self

    def __call__(self, *args, **kw):
        t = time.perf_counter()
        out = self.forward(*args, **kw)
        self.seconds += time.perf_counter() - t
        return out


def one_run(engine: Engine, clock: ForwardClock, prompts: list[list[int]]) -> dict[str, float]:
    """Decode every prompt (`max_batch_rows` at a time); tokens/s, TPF, positions and host share of this run."""
    st = engine.stats
    p0, r0, s0, f0 = st.positions_run, st.resident_positions, st.step_s, clock.seconds
    c0, w0 = time.thread_time(), time.perf_counter()
    results = engine.generate(prompts)
    cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
    tokens = sum(r.num_generated for r in results)
    ran, needed, fwd = st.positions_run - p0, st.resident_positions - r0, clock.seconds - f0
    return {"tps": tokens / cpu, "tps_wall": tokens / wall, "tpf": tokens / sum(r.nfe for r in results),
            "ran": ran, "needed": needed, "per_token": ran / tokens, "host": (st.step_s - s0) / fwd - 1,
            "fwd_tps": tokens / fwd}


def engines_for(batch: int, paths: dict[str, Path],
                loaded: dict[Path, tuple]) -> dict[str, tuple[Engine, ForwardClock]]:
    """One engine per decode point over its weights, decoding `batch` rows at a time, its forwards clocked."""
    out = {}
    for name, cfg_path in CONFIGS.items():
        decode, engine_cfg = load_decode(cfg_path)
        engine_cfg = engine_cfg.model_copy(update={"max_batch_rows": batch, "threads": 1, "kv_cache_bytes": None,
                                                   "batch_buckets": list(power_of_two_buckets(batch))})
        engine = build_engine(paths[name], decode, engine_cfg, loaded=loaded[paths[name]])
        out[name] = engine, ForwardClock(engine)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--single", type=Path, default=ROOT / "mbd/assets/tiny")
    ap.add_argument("--multi", type=Path, default=MBD_TINY if (MBD_TINY / "config.json").is_file() else None,
                    help="MBD-tiny weights (default: mbd/assets/mbd-tiny when shipped, else --single's)")
    ap.add_argument("--problems", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    paths = {"SingleBD": args.single, "MultiBD": args.multi or args.single}
    _, engine_cfg = load_decode(CONFIGS["SingleBD"])
    loaded = {p: load_engine_model(p, engine_cfg.model_copy(update={"threads": 1})) for p in set(paths.values())}
    tok = loaded[paths["SingleBD"]][1]
    prompts = [tok.encode_chat(chat_messages(p)) for p in TinyMath().load(limit=args.problems)]
    print(f"# {len(prompts)} held-out tinymath problems, SingleBD {paths['SingleBD']}, MultiBD {paths['MultiBD']}, "
          f"{args.rounds} alternated rounds, one torch thread", flush=True)
    head = ("| batch | point | tokens/s (CPU) | tokens/s (wall) | TPF | positions run / needed | positions run per "
            "token | host / forward | TPS MBD / SingleBD (CPU (range of rounds), wall) | forwards only "
            "| positions per token MBD / SingleBD |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for batch in args.batches:
        t = time.perf_counter()
        engines = engines_for(batch, paths, loaded)
        for engine, clock in engines.values():
            one_run(engine, clock, prompts[:batch])  # warm-up: first-call costs land in no round
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
        for rnd in range(args.rounds):
            for name in (list(engines) if rnd % 2 == 0 else list(engines)[::-1]):
                runs[name].append(one_run(*engines[name], prompts))
        med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
        s, m = med["SingleBD"], med["MultiBD"]
        paired = [a["tps"] / b["tps"] for a, b in zip(runs["MultiBD"], runs["SingleBD"])]  # rounds side by side
        ratio = (f"{m['tps'] / s['tps']:.2f}x ({min(paired):.2f}-{max(paired):.2f}), "
                 f"{m['tps_wall'] / s['tps_wall']:.2f}x",
                 f"{m['fwd_tps'] / s['fwd_tps']:.2f}x", f"{m['per_token'] / s['per_token']:.2f}")
        for name, r in med.items():
            lines.append(f"| {batch} | {name} | {r['tps']:.1f} | {r['tps_wall']:.1f} | {r['tpf']:.2f} | "
                         f"{r['ran'] / r['needed']:.3f} | {r['per_token']:.2f} | {100 * r['host']:.1f}% | "
                         + (" | ".join(ratio) if name == "MultiBD" else " |  | ") + " |")
        print("\n".join(lines if batch == args.batches[0] else lines[-2:]), f"({time.perf_counter() - t:.0f} s)",
              flush=True)


if __name__ == "__main__":
    main()
