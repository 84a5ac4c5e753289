"""GPU acceptance in one command: every GPU path of the product, checked against its reference, in one table.

    python -m benchmarks.gpu_acceptance                      # on one GPU: < 10 minutes on an H100
    python -m benchmarks.gpu_acceptance --device cpu --quick # the same code on CPU at small sizes (the test suite)

Rows: CUDA Graph replay == eager (tokens and NFE) for every bucket the run captured; FlexAttention (compiled on
GPU) == SDPA; bf16 drift against fp32 (`benchmarks.bf16_drift`); our engine against the plain transformers loop
(`benchmarks.hf_baseline`) on a random SDAR (~0.5B on GPU) at B=4 and B=32, batch 1 and 16, SingleBD and N_buf 2,
the plain loop's tokens checked equal to our SingleBD's; 20 DeepSpeed ZeRO-2 steps of the MultiTF objective with
the memory plan checked against the tensors DeepSpeed allocated; the same steps with the dual-stream mask as
FlexAttention equal to the dense mask's; one request served by Ray Serve over HTTP, equal to the engine called
directly. Rows that need CUDA print "skipped (no CUDA)" on CPU. Exit status 1 if a row fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bf16_drift import random_drift, tinymath_drift  # noqa: E402
from benchmarks.hf_baseline import PlainBlockDiffusion, random_sdar, to_qwen3  # noqa: E402
from mbd.config import DecodeConfig, EngineConfig  # noqa: E402
from mbd.decoding import Engine  # noqa: E402

SKIPPED = "skipped (no CUDA)"


@dataclass(frozen=True)
class Sizes:
    """What each row runs: GPU sizes, or the quick CPU ones (same code)."""

    graph_model: str = "60m"
    hf_model: str = "0.5b"
    prompt: int = 64
    new: int = 256
    flex_prompts: int = 8
    repeats: int = 2
    problems: int = 1000
    drift_model: str = "60m"
    train_model: str = "0.5b"
    train_rows: int = 4
    train_len: int = 256


QUICK = Sizes(graph_model="tiny", hf_model="tiny", prompt=16, new=32, flex_prompts=4, repeats=1, problems=48, drift_model="tiny",
              train_model="tiny", train_rows=4, train_len=32)


@dataclass
class Row:
    check: str
    result: str  # PASS | FAIL | skipped (no CUDA)
    detail: str
    seconds: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time (what the row would take on an idle machine, Ray's processes aside)
    data: dict = field(default_factory=dict)


def engine_for(model, decode: DecodeConfig, rows: int, **knobs) -> Engine:
    """The one place the rows build engines (attention backend, CUDA Graphs)."""
    device = next(model.parameters()).device.type
    return Engine(model, None, decode, EngineConfig(device=device, max_batch_rows=rows, **knobs))


def prompts_for(vocab: int, n: int, length: int, seed: int, ragged: bool = False) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(length // 2, length + 1, (n,), generator=g).tolist() if ragged else [length] * n
    return [torch.randint(0, vocab - 2, (k,), generator=g).tolist() for k in lens]


def multibd(n_buf: int, new: int, max_len: int) -> DecodeConfig:
    extra = dict(tau_add=0.1, tau_semi=0.5) if n_buf > 1 else {}
    return DecodeConfig(buffer_size=n_buf, tau_m2t=0.9, max_new_tokens=new, max_length=max_len, max_nfe=100_000,
                        **extra)


def same_outputs(a: list, b: list) -> tuple[bool, str]:
    tok = sum(x.token_ids == y.token_ids for x, y in zip(a, b))
    nfe = sum(x.nfe == y.nfe for x, y in zip(a, b))
    return tok == nfe == len(a), f"tokens equal {tok}/{len(a)}, NFE equal {nfe}/{len(a)}"


# ------------------------------------------------------------------------------------------------ rows

def graphs_row(s: Sizes, device: str) -> Row:
    """Per block size and buffer: 16 ragged prompts through 16 rows, graphs vs eager; as requests finish, the
    batch bucket shrinks, so the run captures many (batch, slots, span, active) buckets."""
    if device != "cuda":
        return Row("CUDA Graph replay == eager", SKIPPED, "needs a GPU")
    ok, parts, buckets = True, [], 0
    for block in (4, 32):
        model, cfg = random_sdar(s.graph_model, block, 2048)
        model = model.to(device, torch.bfloat16)
        ps = prompts_for(cfg.vocab_size, 16, s.prompt, block, ragged=True)
        for n_buf in (1, 2):
            decode = multibd(n_buf, s.new, 2048)
            eager = engine_for(model, decode, 16, cuda_graphs="off").generate(ps)
            graphed = engine_for(model, decode, 16, cuda_graphs="on")
            good, text = same_outputs(eager, graphed.generate(ps))
            ok &= good
            buckets += len(graphed.runner._graphs)
            parts.append(f"B={block} N_buf={n_buf}: {text}, {len(graphed.runner._graphs)} buckets")
    return Row("CUDA Graph replay == eager", "PASS" if ok else "FAIL", "; ".join(parts), data={"buckets": buckets})


def flex_row(s: Sizes, device: str) -> Row:
    """fp32 (so that only the attention kernel differs): FlexAttention BlockMasks vs dense SDPA masks; compiled
    on GPU, eager on CPU (compiling every bucket's kernel with inductor on CPU is the engine tests' job)."""
    ok, parts = True, []
    for block in (4, 32):
        model, cfg = random_sdar(s.graph_model, block, 2048)
        model = model.to(device)
        ps = prompts_for(cfg.vocab_size, s.flex_prompts, s.prompt, block + 1, ragged=True)
        for n_buf in (1, 2):
            decode, rows = multibd(n_buf, s.new, 2048), s.flex_prompts
            ref = engine_for(model, decode, rows, attention="sdpa").generate(ps)
            flex = engine_for(model, decode, rows, attention="flex", compile="default" if device == "cuda" else "off")
            good, text = same_outputs(ref, flex.generate(ps))
            ok &= good
            parts.append(f"B={block} N_buf={n_buf}: {text}")
    how = "compiled" if device == "cuda" else "eager on CPU"
    return Row(f"FlexAttention ({how}) == SDPA", "PASS" if ok else "FAIL", "; ".join(parts))


def bf16_row(s: Sizes, device: str) -> Row:
    """Accuracy may not drop significantly (paired exact McNemar p < 0.05 with bf16 below fp32 fails)."""
    t = tinymath_drift(s.problems, device)
    r = random_drift(s.drift_model, 4, 2, 16, s.new, device)
    worse = t["acc_bf16"] < t["acc_fp32"] and t["p_mcnemar"] < 0.05
    detail = (f"tiny tinymath n={s.problems}: {t['acc_fp32']:.1f}% -> {t['acc_bf16']:.1f}% ({t['paired']}), "
              f"identical outputs {100 * t['identical']:.0f}%; random {s.drift_model} N_buf 2: identical "
              f"{100 * r['identical']:.0f}%, prefix tokens {100 * r['prefix_tokens']:.0f}%")
    return Row("bf16 drift vs fp32", "FAIL" if worse else "PASS", detail, data={"tinymath": t, "random": r})


def hf_row(s: Sizes, device: str) -> Row:
    """Tokens per second of the decode phase (prefill excluded), medians over ABC/CBA-interleaved repeats."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cells, ok = [], True
    for block in (4, 32):
        model, cfg = random_sdar(s.hf_model, block, 2048)
        model = model.to(device, dtype)
        hf = to_qwen3(model, cfg)
        plain = PlainBlockDiffusion(hf, block, cfg.mask_token_id, {cfg.eos_token_id})
        for batch in (1, 16):
            ps = prompts_for(cfg.vocab_size, batch, s.prompt, batch)
            ours = {n: engine_for(model, multibd(n, s.new, 2048), batch) for n in (1, 2)}
            runs: dict[str, list[tuple[float, list]]] = {"plain": [], 1: [], 2: []}
            for rep in range(s.repeats + 1):  # the first round warms up (graphs, kernels) and is dropped
                for name in (["plain", 1, 2] if rep % 2 else [2, 1, "plain"]):
                    if name == "plain":
                        r = plain.generate(ps, 0.9, s.new, 2048)
                        runs[name].append((sum(r.num_generated) / r.decode_s, r.token_ids))
                    else:
                        e = ours[name]
                        t0 = e.stats.step_s
                        res = e.generate(ps)
                        runs[name].append((sum(x.num_generated for x in res) / (e.stats.step_s - t0),
                                           [x.token_ids for x in res]))
            ok &= runs["plain"][-1][1] == runs[1][-1][1]
            tps = {k: statistics.median(t for t, _ in v[1:]) for k, v in runs.items()}
            cells.append({"B": block, "batch": batch, "plain_tps": tps["plain"], "singlebd_x": tps[1] / tps["plain"],
                          "nbuf2_x": tps[2] / tps["plain"]})
    detail = "; ".join(f"B={c['B']} batch {c['batch']}: SingleBD {c['singlebd_x']:.2f}x, N_buf 2 {c['nbuf2_x']:.2f}x"
                       for c in cells)
    return Row(f"engine vs transformers loop ({s.hf_model}, TPS ratio)", "PASS" if ok else "FAIL",
               detail + ("" if ok else "; plain loop tokens != our SingleBD"), data={"cells": cells})


def train_row(s: Sizes, device: str) -> Row:
    from benchmarks.acceptance_train import zero2_steps

    r = zero2_steps(s.train_model, device, steps=20, rows=s.train_rows, length=s.train_len)
    ok = r["finite"] and r["last_loss"] < r["first_loss"] and r["plan_error"] <= 0.05
    detail = (f"{r['model']}: loss {r['first_loss']:.3f} -> {r['last_loss']:.3f} over 20 steps; plan vs allocated "
              f"(parameters + optimizer states) {100 * r['plan_error']:.2f}% off")
    return Row("DeepSpeed ZeRO-2, 20 steps", "PASS" if ok else "FAIL", detail, data=r)


def flex_train_row(s: Sizes, device: str) -> Row:
    """The dual-stream mask as FlexAttention BlockMasks (what the SDAR-8B train configs need to fit: docs/gpu.md)
    against the dense SDPA mask: the same 5 ZeRO-2 steps from the same weights give the same losses (bf16)."""
    from benchmarks.acceptance_train import zero2_steps

    if device != "cuda":
        return Row("MultiTF training: flex == dense", SKIPPED, "needs a GPU (FlexAttention has no backward on CPU)")
    dense, flex = (zero2_steps(s.train_model, device, steps=5, rows=s.train_rows, length=s.train_len, attention=a)
                   for a in ("dense", "flex"))
    worst = max(abs(a - b) / abs(a) for a, b in zip(dense["losses"], flex["losses"]))
    ok = flex["finite"] and worst <= 0.02
    return Row("MultiTF training: flex == dense", "PASS" if ok else "FAIL",
               f"{dense['model']}: 5 steps, largest relative loss difference {worst:.4f} (<= 0.02)",
               data={"dense": dense["losses"], "flex": flex["losses"]})


def serve_row(s: Sizes, device: str) -> Row:
    from benchmarks.acceptance_train import served_request

    r = served_request(device)
    return Row("one request served (Ray Serve, HTTP)", "PASS" if r["equal"] else "FAIL",
               f"HTTP {r['status']}, {r['tokens']} tokens, equal to the engine called directly: {r['equal']}", data=r)


ROWS: dict[str, Callable[[Sizes, str], Row]] = {"graphs": graphs_row, "flex": flex_row, "bf16": bf16_row,
                                                "hf": hf_row, "train": train_row, "flex_train": flex_train_row,
                                                "serve": serve_row}
TITLES = {"graphs": "CUDA Graph replay == eager", "flex": "FlexAttention == SDPA", "bf16": "bf16 drift vs fp32",
          "hf": "engine vs transformers loop", "train": "DeepSpeed ZeRO-2, 20 steps",
          "flex_train": "MultiTF training: flex == dense", "serve": "one request served (Ray Serve, HTTP)"}


def run_rows(names: list[str], s: Sizes, device: str) -> list[Row]:
    rows = []
    for name in names:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            row = ROWS[name](s, device)
        except Exception as e:  # a crashing row is a failed row; the others still run
            row = Row(TITLES[name], "FAIL", f"{type(e).__name__}: {e}", data={"traceback": traceback.format_exc()})
        row.seconds, row.cpu_s = time.perf_counter() - t0, time.process_time() - c0
        rows.append(row)
        print(f"  {row.check}: {row.result} ({row.seconds:.0f} s, {row.cpu_s:.0f} s CPU)", file=sys.stderr, flush=True)
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| check | result | detail | s |", "|---|---|---|---:|"]
    lines += [f"| {r.check} | {r.result} | {r.detail} | {r.seconds:.0f} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small sizes (the CPU test suite runs this)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    ap.add_argument("--json", help="also write the rows (with their data) to this file")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu --quick)")
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("MBD_ACCEPTANCE_THREADS", "1")))
    sizes = QUICK if args.quick else Sizes()
    card = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    rows = run_rows([n for n in args.rows.split(",") if n], sizes, args.device)
    print(f"GPU acceptance on {card}{' (quick sizes)' if args.quick else ''}, torch {torch.__version__}")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1, default=str))
    return 1 if any(r.result == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
