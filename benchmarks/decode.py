"""Decoding benchmark: our SingleBD and Block Buffer MultiBD (N_buf 2, 4) side by side with the plain
transformers loop (`benchmarks/hf_baseline.py`) on the same random SDAR weights, prompts and threshold.

Four parts, each measured in one run with interleaving so that load from other processes hits every
system alike (one torch thread; absolute times are noisy on a shared machine, the ratios are what count):

1. table: batch {1, 16} x block {4, 32} x prompt {64, 1024} tokens, 256 new tokens each; per cell every
   system runs `--repeats` times in ABCD / DCBA order; medians of TPS (generated tokens / decode wall time,
   prefill excluded), TPF (tokens / forwards per request), step latency (decode wall / forwards), the ratio
   to the plain loop, and the rule of sec:efficiency_analysis: TPS gain = TPF gain / step-latency cost.
   In every cell the plain loop's tokens are checked identical to our SingleBD's.
2. mixed: request budgets drawn from [32, 256], 48 requests through 16 slots (continuous batching vs
   lock-step batches), token identity checked.
3. overhead: on the ~60M model, engine step wall / bare model forward of the same shape (batch and key
   span), alternated step by step; wall and thread-CPU medians.
4. prefix: on the ~60M model at batch 1, step latency with a 1,024- vs a 64-token prompt, alternated step
   by step; and the KV bytes allocated vs needed vs mapped (pages). Prefix reuse: benchmarks/prefix_cache.py.
5. compiled (on request, `--parts compiled --size 60m`): the compiled decode forward (paged FlexAttention, one
   compiled layer) vs the eager sdpa and flex engines on CPU, ABAB after its warm-up, and inductor's generated
   kernels per compiled layer; the numbers behind the CPU default (eager sdpa; docs/engine.md).

    python -m benchmarks.decode                 # everything (< 10 minutes on 2 cores)
    python -m benchmarks.decode --parts table --size 60m --repeats 3
    (GPU steps against their floor, both paper model shapes: benchmarks/step_floor.py)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.hf_baseline import TEMPER, PlainBlockDiffusion, random_sdar, to_qwen3  # noqa: E402
from mbd.config import DecodeConfig  # noqa: E402
from mbd.decoding import Engine, EngineConfig  # noqa: E402

MAX_LEN = 2048  # the engine's max_length: what a server would allocate for, whatever the prompt
NEW = 256
# tau_add / tau_semi of the SDAR rows of tab:appendix_infer_hparams (MultiBD-TF Math); tau_m2t is lowered
# because a random model is rarely 95% sure
TAU_SEMI = {4: 0.25, 32: 0.90}
TAU_ADD = 0.10


@dataclass
class Run:
    tokens: int
    forwards: int  # per-request forwards summed over requests (plain loop: batch forwards x rows)
    steps: int  # forwards of the batch
    decode_s: float
    outputs: list[list[int]]


def decode_config(n_buf: int, block: int, tau: float) -> DecodeConfig:
    multi = dict(tau_add=TAU_ADD, tau_semi=TAU_SEMI[block]) if n_buf > 1 else {}
    return DecodeConfig(buffer_size=n_buf, max_new_tokens=NEW, max_length=MAX_LEN, max_nfe=100_000, tau_m2t=tau,
                        **multi)


CLOCK = {"clock": "wall"}  # --clock cpu: this thread's CPU time of the whole run (prefill included), for a busy host


def run_engine(engine: Engine, prompts: list[list[int]], max_new: int = NEW) -> Run:
    steps0, s0, c0 = engine.stats.steps, engine.stats.step_s, time.thread_time()
    res = engine.generate(prompts, params={"max_new_tokens": max_new})
    secs = time.thread_time() - c0 if CLOCK["clock"] == "cpu" else engine.stats.step_s - s0
    return Run(sum(r.num_generated for r in res), sum(r.nfe for r in res), engine.stats.steps - steps0, secs,
               [r.token_ids for r in res])


def run_plain(plain: PlainBlockDiffusion, prompts: list[list[int]], tau: float, max_new: int = NEW) -> Run:
    c0 = time.thread_time()
    r = plain.generate(prompts, tau, max_new, MAX_LEN)
    secs = time.thread_time() - c0 if CLOCK["clock"] == "cpu" else r.decode_s
    return Run(sum(r.num_generated), r.nfe * len(prompts), r.nfe, secs, r.token_ids)


def cell(model, cfg, hf, batch: int, plen: int, tau: float, repeats: int) -> dict[str, dict]:
    g = torch.Generator().manual_seed(plen * 100 + batch)
    prompts = torch.randint(0, cfg.vocab_size - 2, (batch, plen), generator=g).tolist()
    B = cfg.block_size
    systems = {f"ours N_buf={n}": Engine(model, None, decode_config(n, B, tau), EngineConfig(max_batch_rows=batch))
               for n in (1, 2, 4)}
    plain = PlainBlockDiffusion(hf, B, cfg.mask_token_id, {cfg.eos_token_id})

    def go(name: str, max_new: int = NEW) -> Run:
        if name == "plain":
            return run_plain(plain, prompts, tau, max_new)
        return run_engine(systems[name], prompts, max_new)

    names = [*systems, "plain"]
    for n in names:  # warm-up
        go(n, 2 * B)
    runs: dict[str, list[Run]] = {n: [] for n in names}
    for rep in range(repeats):
        for n in (names if rep % 2 == 0 else names[::-1]):
            runs[n].append(go(n))
    if runs["plain"][0].outputs != runs["ours N_buf=1"][0].outputs:
        raise AssertionError(f"batch {batch}, prompt {plen}, B={B}: plain loop and our SingleBD differ")
    out = {}
    for n, rs in runs.items():
        out[n] = {"tps": statistics.median(r.tokens / r.decode_s for r in rs),
                  "tpf": statistics.median(r.tokens / r.forwards for r in rs),
                  "step_ms": statistics.median(1e3 * r.decode_s / r.steps for r in rs)}
    return out


def table(size: str, repeats: int, tau: float, batches, blocks, plens) -> list[str]:
    head = ("| B | batch | prompt | system | TPS | TPF | step ms | TPS / plain | TPF gain | latency cost | "
            "TPF gain / cost |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for B in blocks:
        model, cfg = random_sdar(size, B, MAX_LEN)
        hf = to_qwen3(model, cfg)
        for batch in batches:
            for plen in plens:
                t = time.perf_counter()
                res = cell(model, cfg, hf, batch, plen, tau, repeats)
                base = res["plain"]
                for n, r in res.items():
                    gain, cost = r["tpf"] / base["tpf"], r["step_ms"] / base["step_ms"]
                    lines.append(f"| {B} | {batch} | {plen} | {n} | {r['tps']:.1f} | {r['tpf']:.2f} | "
                                 f"{r['step_ms']:.1f} | {r['tps'] / base['tps']:.2f} | {gain:.2f} | {cost:.2f} | "
                                 f"{gain / cost:.2f} |")
                print("\n".join(lines[-4:]), f"({time.perf_counter() - t:.0f} s)", flush=True)
    return lines


def mixed(size: str, tau: float, repeats: int, n_req: int = 48, slots: int = 16, block: int = 4,
          plen: int = 64) -> dict[str, float]:
    """Requests with budgets drawn from [32, 256] tokens through `slots` batch rows: our engine refills a
    freed row with the next request (continuous batching); the plain loop runs lock-step batches of `slots`
    in arrival order, each as long as its longest request. Returns TPS per system (medians, ABAB)."""
    model, cfg = random_sdar(size, block, MAX_LEN)
    hf = to_qwen3(model, cfg)
    g = torch.Generator().manual_seed(11)
    prompts = torch.randint(0, cfg.vocab_size - 2, (n_req, plen), generator=g).tolist()
    budgets = torch.randint(32, NEW + 1, (n_req,), generator=g).tolist()
    engines = {f"ours N_buf={n}": Engine(model, None, decode_config(n, block, tau), EngineConfig(max_batch_rows=slots))
               for n in (1, 2)}
    plain = PlainBlockDiffusion(hf, block, cfg.mask_token_id, {cfg.eos_token_id})

    def go(name: str) -> tuple[float, list[list[int]]]:
        if name == "plain":
            toks, outs, secs = 0, [], 0.0
            for i in range(0, n_req, slots):
                r = plain.generate(prompts[i:i + slots], tau, budgets[i:i + slots], MAX_LEN)
                toks, outs, secs = toks + sum(r.num_generated), outs + r.token_ids, secs + r.decode_s
            return toks / secs, outs
        e = engines[name]
        s0 = e.stats.step_s
        ids = [e.add_request(p, {"max_new_tokens": n}) for p, n in zip(prompts, budgets)]
        outs: dict[str, list[int]] = {i: [] for i in ids}
        toks = 0
        while e.has_unfinished():
            for o in e.step():
                outs[o.request_id] += o.new_token_ids
                toks += o.num_generated if o.finished else 0
        return toks / (e.stats.step_s - s0), [outs[i] for i in ids]

    names = [*engines, "plain"]
    tps: dict[str, list[float]] = {n: [] for n in names}
    outputs = {}
    for rep in range(repeats):
        for n in (names if rep % 2 == 0 else names[::-1]):
            t, outputs[n] = go(n)
            tps[n].append(t)
    if outputs["plain"] != outputs["ours N_buf=1"]:
        raise AssertionError("mixed workload: plain loop and our SingleBD differ")
    return {n: statistics.median(v) for n, v in tps.items()}


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


def overhead(size: str, batch: int, block: int, n_buf: int, plen: int, tau: float, steps: int) -> dict:
    """Median over steps of (engine step) / (bare forward of the same batch bucket, slots and key span), the
    bare forward timed right after its step on the same buffers and cache (it rewrites only scratch K/V),
    after an untimed one that builds positions and mask if the step changed them."""
    model, cfg = random_sdar(size, block, MAX_LEN)
    engine = Engine(model, None, decode_config(n_buf, block, tau), EngineConfig(max_batch_rows=batch))
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, cfg.vocab_size - 2, (batch, plen), generator=g).tolist()
    for p in prompts:
        engine.add_request(p)
    engine.step()  # admission + prefill + first forward
    runner = engine.runner
    wall, cpu = [], []
    with torch.inference_mode():
        for _ in range(steps):
            if not engine.has_unfinished():
                break
            batch = engine.scheduler.decode_batch()  # the step's shapes
            b, k, act, longest = batch.rows, batch.slots, batch.active, batch.max_committed
            a = clocks()
            engine.step()
            e = clocks()
            home = engine.kv.at_home(b)
            runner.forward(b, k, act, longest, home=home)  # builds positions and mask if the step changed them: not timed
            m = clocks()
            runner.forward(b, k, act, longest, home=home)
            z = clocks()
            wall.append((e[0] - a[0]) / (z[0] - m[0]))
            cpu.append((e[1] - a[1]) / (z[1] - m[1]))
    return {"wall": statistics.median(wall), "cpu": statistics.median(cpu), "steps": len(wall)}


def prefix_latency(size: str, block: int, tau: float, steps: int) -> dict:
    """Step latency at batch 1 with a 1,024- vs a 64-token prompt (steps alternate between the two engines),
    and KV bytes: allocated by the engine vs needed by its live rows (committed + one Block Buffer)."""
    model, cfg = random_sdar(size, block, MAX_LEN)
    g = torch.Generator().manual_seed(3)
    engines, times = {}, {}
    for plen in (64, 1024):
        e = Engine(model, None, decode_config(1, block, tau), EngineConfig(max_batch_rows=1))
        e.add_request(torch.randint(0, cfg.vocab_size - 2, (plen,), generator=g).tolist())
        e.step()
        engines[plen], times[plen] = e, []
    for _ in range(steps):
        for plen, e in engines.items():
            if e.has_unfinished():
                t = time.perf_counter()
                e.step()
                times[plen].append(time.perf_counter() - t)
    e = engines[1024]
    c = e.runner.cache
    per_pos = c.nbytes() // (c.num_pages * c.page_size)
    needed = (int(c.lengths.sum()) + c.rows * e.runner.q) * per_pos
    return {"ms64": 1e3 * statistics.median(times[64]), "ms1024": 1e3 * statistics.median(times[1024]),
            "alloc": c.nbytes(), "needed": needed, "mapped": e.kv.used() * c.page_size * per_pos}


def buffer_cost(size: str, tau: float, repeats: int, blocks, batches, temper: float, new: int) -> list[str]:
    """What a larger Block Buffer costs per step and gains per forward (sec:efficiency_analysis): N_buf 2 and 4
    vs N_buf 1 on the same engine, ABC / CBA repeats, medians. Batch 1: 2 requests one after another through
    one slot (TPF of a random model varies from prompt to prompt); batch 16: 16 requests through 16 slots.
    Prompts of 64 tokens, `new` new tokens. Also: the share of query positions that were DUMMY slots (the
    rows' resident prefixes differ) and the share whose logits the head computed."""
    head = ("| B | batch | N_buf | TPS | TPF | step ms | TPF gain | latency cost | TPS gain | TPS gain / (TPF gain / cost) "
            "| DUMMY positions | logit rows / positions |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for B in blocks:
        model, cfg = random_sdar(size, B, MAX_LEN, temper=temper)
        for batch in batches:
            t = time.perf_counter()
            n_req = 2 if batch == 1 else batch
            g = torch.Generator().manual_seed(B * 1000 + batch)
            prompts = torch.randint(0, cfg.vocab_size - 2, (n_req, 64), generator=g).tolist()
            engines = {n: Engine(model, None, decode_config(n, B, tau), EngineConfig(max_batch_rows=batch)) for n in (1, 2, 4)}
            for e in engines.values():
                run_engine(e, prompts[:batch], 2 * B)
            runs: dict[int, list[tuple[Run, float, float]]] = {n: [] for n in engines}
            for rep in range(repeats):
                for n in (list(engines) if rep % 2 == 0 else list(engines)[::-1]):
                    st = engines[n].stats
                    p0, r0, l0 = st.positions_run, st.resident_positions, st.logit_rows
                    r = run_engine(engines[n], prompts, new)
                    pos = st.positions_run - p0
                    runs[n].append((r, 1 - (st.resident_positions - r0) / pos, (st.logit_rows - l0) / pos))
            med = {n: {"tps": statistics.median(r.tokens / r.decode_s for r, _, _ in rs),
                       "tpf": statistics.median(r.tokens / r.forwards for r, _, _ in rs),
                       "ms": statistics.median(1e3 * r.decode_s / r.steps for r, _, _ in rs),
                       "dummy": statistics.median(d for _, d, _ in rs), "logit": statistics.median(x for *_, x in rs)}
                   for n, rs in runs.items()}
            base = med[1]
            for n, m in med.items():
                gain, cost, tps = m["tpf"] / base["tpf"], m["ms"] / base["ms"], m["tps"] / base["tps"]
                lines.append(f"| {B} | {batch} | {n} | {m['tps']:.1f} | {m['tpf']:.2f} | {m['ms']:.1f} | {gain:.2f} | "
                             f"{cost:.2f} | {tps:.2f} | {tps / (gain / cost):.2f} | {m['dummy']:.2f} | {m['logit']:.2f} |")
            print("\n".join(lines[-3:]), f"({time.perf_counter() - t:.0f} s)", flush=True)
    return lines


def admission(size: str, block: int, n_buf: int, tau: float, budgets, steps: int, long: int = 1024) -> list[str]:
    """Step latency of a decoding row (batch 1, prompt 64) while a `long`-token prompt is admitted, per
    prefill_budget, against the same row with no admission: the engines step in turn (same decode tokens,
    same shapes; the admitting one also carries the prompt chunks). A budget >= the prompt prefills it in
    one step, as a stall would. Reported: median and max latency ratio over the steps that carried a chunk,
    and how many steps the prompt took to be prefilled (its time to first decode)."""
    model, cfg = random_sdar(size, block, MAX_LEN)
    g = torch.Generator().manual_seed(5)
    short, prompt = (torch.randint(0, cfg.vocab_size - 2, (n,), generator=g).tolist() for n in (64, long))
    dc = decode_config(n_buf, block, tau).model_copy(update={"max_new_tokens": 1024})
    engines = {b: Engine(model, None, dc, EngineConfig(max_batch_rows=2, prefill_budget=b)) for b in (0, *budgets)}
    for b, e in engines.items():
        e.add_request(short)
        e.step()
        if b:
            e.add_request(prompt, {"max_new_tokens": 8})
    times: dict[int, list[float]] = {b: [] for b in engines}
    chunked: dict[int, list[bool]] = {b: [] for b in engines}
    for _ in range(steps):
        for b, e in engines.items():
            c0 = e.stats.chunked_steps
            t = time.perf_counter()
            e.step()
            times[b].append(time.perf_counter() - t)
            chunked[b].append(e.stats.chunked_steps > c0)
    lines = [f"| prefill_budget (effective) | steps to prefill {long} tokens | step / no-admission step (median) | (max) |",
             "|---|---|---|---|"]
    for b in budgets:
        ratios = [t / t0 for t, t0, c in zip(times[b], times[0], chunked[b]) if c]
        eff = engines[b].scheduler.prefill_budget
        done = "> " * (engines[b].stats.prefill_tokens < 64 + long - long % block) + str(len(ratios))
        lines.append(f"| {b} ({eff}) | {done} | {statistics.median(ratios):.2f} | {max(ratios):.2f} |")
    return lines


def step_costs(engine: Engine, prompts: list[list[int]], max_new: int) -> tuple[float, float, int]:
    """(median wall ms, median thread-CPU ms, steps) of the decode steps of `prompts` (the prefill step excluded)."""
    for p in prompts:
        engine.add_request(p, {"max_new_tokens": max_new})
    engine.step()
    wall, cpu = [], []
    while engine.has_unfinished():
        a = clocks()
        engine.step()
        z = clocks()
        wall.append(z[0] - a[0])
        cpu.append(z[1] - a[1])
    return 1e3 * statistics.median(wall), 1e3 * statistics.median(cpu), len(wall)


def compiled_vs_eager(size: str, tau: float, repeats: int, cases=((1, 1), (4, 2)), plen: int = 512,
                      max_new: int = 64) -> list[str]:
    """The compiled decode forward (one decoder layer compiled by inductor, paged FlexAttention) against the eager
    engines on CPU, whole engine steps: the same model, prompts and decisions, ABAB after the compiled engine's
    warm-up; and inductor's generated kernels per compiled layer graph (a fresh cache, so none is reused), the CPU
    proxy for a GPU step's kernels per layer."""
    import tempfile

    from torch._dynamo.utils import counters
    from torch._inductor import metrics

    model, cfg = random_sdar(size, 4, MAX_LEN)
    lines = ["| batch, N_buf | compiled layer graphs (warm-up s) | kernels per graph | eager sdpa step ms (CPU) | "
             "eager flex ms | compiled ms | compiled / eager sdpa (wall, CPU) |", "|---|---|---|---|---|---|---|"]
    for batch, n_buf in cases:
        g = torch.Generator().manual_seed(11 * batch + n_buf)
        prompts = torch.randint(0, cfg.vocab_size - 2, (batch, plen), generator=g).tolist()
        dc = decode_config(n_buf, 4, tau)
        metrics.reset()
        before = counters["stats"]["unique_graphs"]
        with tempfile.TemporaryDirectory() as cache:
            engines = {name: Engine(model, None, dc, EngineConfig(max_batch_rows=batch, **kw)) for name, kw in (
                ("sdpa", dict(attention="sdpa")), ("flex", dict(attention="flex", compile="off")),
                ("compiled", dict(attention="flex", compile="default", compile_cache=cache)))}
        graphs = counters["stats"]["unique_graphs"] - before  # layer graphs compiled (rows, slots pairs share them)
        kernels = metrics.generated_kernel_count / graphs
        runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in engines}
        for rep in range(repeats):
            for name in (list(engines) if rep % 2 == 0 else list(engines)[::-1]):
                runs[name].append(step_costs(engines[name], prompts, max_new))
        med = {a: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)) for a, rs in runs.items()}
        lines.append(f"| {batch}, {n_buf} | {graphs} ({engines['compiled'].warmup_s:.0f}) | {kernels:.1f} | "
                     f"{med['sdpa'][0]:.1f} ({med['sdpa'][1]:.1f}) | {med['flex'][0]:.1f} | {med['compiled'][0]:.1f} | "
                     f"{med['compiled'][0] / med['sdpa'][0]:.2f}, {med['compiled'][1] / med['sdpa'][1]:.2f} |")
    return lines


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="table,mixed,overhead,prefix",
                    help="any of table, mixed, overhead, prefix, buffer, admission (the last two on the 60m model), "
                         "compiled (the compiled forward vs the eager engines)")
    ap.add_argument("--size", default="tiny", help="model of the table: tiny | small | 60m (hf_baseline.SIZES)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tau", type=float, default=0.3, help="tau_m2t of every system")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--blocks", default="4,32")
    ap.add_argument("--prompts", default="64,1024")
    ap.add_argument("--steps", type=int, default=40, help="steps of the overhead, prefix and admission parts")
    ap.add_argument("--new", type=int, default=64, help="new tokens per request (buffer part)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall", help=(
        "wall: decode wall time; cpu: the (one torch) thread's CPU time of each whole run, prefill included, "
        "robust to other processes on a shared host (table and buffer parts)"))
    ap.add_argument("--temper", type=float, default=TEMPER, help="LM-head scale of the random model (buffer part)")
    return ap.parse_args(argv)


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


def report_throughput(args: argparse.Namespace, parts: set[str]) -> None:
    """The table, mixed and buffer parts: systems side by side on whole requests."""
    if "table" in parts:
        lines = table(args.size, args.repeats, args.tau, ints(args.batches), ints(args.blocks), ints(args.prompts))
        print("\n" + "\n".join(lines), flush=True)
    if "mixed" in parts:
        m = mixed(args.size, args.tau, args.repeats)
        print("\nmixed lengths, B=4, 48 requests (prompt 64, budgets 32-256) through 16 slots: TPS "
              + ", ".join(f"{n} {v:.1f} ({v / m['plain']:.2f}x plain)" for n, v in m.items()), flush=True)
    if "buffer" in parts:
        lines = buffer_cost(args.size, args.tau, args.repeats, ints(args.blocks), ints(args.batches), args.temper,
                            args.new)
        print(f"\nBlock Buffer cost vs N_buf=1, {args.size} model (head tempered x{args.temper:g}), tau_m2t "
              f"{args.tau}, {args.new} new tokens\n" + "\n".join(lines), flush=True)


def report_steps(args: argparse.Namespace, parts: set[str]) -> None:
    """The overhead, admission, compiled and prefix parts: single steps, alternated."""
    if "overhead" in parts:
        print("\nengine overhead, 60m model, SingleBD B=4, prompt 64: step / bare forward of the same shape (median)")
        for batch in (1, 16):
            o = overhead("60m", batch, 4, 1, 64, args.tau, args.steps)
            print(f"  batch {batch:2d}: wall {o['wall']:.3f}  thread-CPU {o['cpu']:.3f}  ({o['steps']} steps)", flush=True)
    if "admission" in parts:
        for block, n_buf in ((4, 2), (32, 2)):
            lines = admission("60m", block, n_buf, args.tau, (8, 16, 64, 256, 1024), args.steps)
            print(f"\nadmitting a 1,024-token prompt while one row decodes (60m, B={block}, N_buf={n_buf}, batch 1)\n"
                  + "\n".join(lines), flush=True)
    if "compiled" in parts:
        lines = compiled_vs_eager(args.size, args.tau, args.repeats)
        print(f"\ncompiled decode forward vs eager engines on CPU, {args.size} model, B=4, prompt 512, 64 new tokens, "
              f"medians of {args.repeats} alternating runs\n" + "\n".join(lines), flush=True)
    if "prefix" in parts:
        p = prefix_latency("60m", 4, args.tau, args.steps)
        print(f"\nprefix, 60m model, SingleBD B=4, batch 1: step {p['ms64']:.1f} ms (prompt 64) vs {p['ms1024']:.1f} "
              f"ms (prompt 1024): {p['ms1024'] / p['ms64']:.2f}x\nKV cache: {p['alloc'] / 2**20:.1f} MiB allocated, "
              f"{p['needed'] / 2**20:.1f} MiB needed by the live row (prompt 1024), {p['mapped'] / 2**20:.1f} MiB of "
              "pages mapped to it", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    parts = set(args.parts.split(","))
    CLOCK["clock"] = args.clock
    t0 = time.perf_counter()
    print(f"CPU, 1 torch thread, {args.clock} clock, random SDAR '{args.size}' (benchmarks/hf_baseline.py), "
          f"tau_m2t {args.tau}, "
          f"{NEW} new tokens, engine max_length {MAX_LEN}, {args.repeats} repeats ABCD/DCBA, medians\n", flush=True)
    report_throughput(args, parts)
    report_steps(args, parts)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
