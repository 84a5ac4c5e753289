"""A decode step against its physics: the engine's ms per step (compiled and CUDA-Graph captured on a GPU) for a
paper model's shape with random weights, against the weight-streaming floor (the bytes of weights one batch-1 step
reads, over the card's copy rate: the median of event-timed device-to-device copies), with TPF, TPS and the kernels
per step and per decoder layer from torch.profiler (the ten longest by name). A step reads every weight once (a
tied head once, as the head) except the input embedding, of which it reads one row per query position, and, for the
MoE, the routed experts: each cell's floor counts those its own steps chose (hooked in an eager run of the same
prompts, batch and N_buf), beside the floor with every expert read. The MoE's random attention is sharpened so that
its routing spreads as a trained model's does (`ATTENTION_SHARPEN`).

    python -m benchmarks.step_floor --shape sdar-8b --batch 1,16 --n-buf 1,2          # on a GPU
    python -m benchmarks.step_floor --shape tiny --device cpu --new 32                 # the same code on CPU

Random tempered weights (the head scaled so that M2T accepts several tokens per forward, the EOS row zero so that
every request decodes its whole budget): the row measures the engine and the step, not a trained model's TPF.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbd.flops import matmul_rate  # noqa: E402
from mbd.config import DecodeConfig, EngineConfig, ModelConfig, read_json  # noqa: E402
from mbd.decoding import Engine  # noqa: E402
from mbd.model import build_model  # noqa: E402

SHAPES = {"sdar-8b": "configs/model/sdar-8b-shape.json", "llada2-mini": "configs/model/llada2-mini-shape.json"}
TINY = {"sdar": dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32),
        "llada2_moe": dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16,
                           num_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                           moe_intermediate_size=64, first_k_dense_replace=1, partial_rotary_factor=0.5)}
TEMPER = 10.0
# A trained LLaDA2-Mini block of 32 tokens routes to ~160 of 256 experts per layer; random weights route every mask
# position of a block alike (attention logits near 0 give each position the same mix of its context), ~30-35.
# Scaling the router's weights cannot change that (top-k of sigmoid scores is invariant to it: x10 gave 37 and 31
# of 256 where x1 gave 35 and 29); sharpening attention (q and k norm weights x4, logits x16) makes positions
# differ and the block route to 152 and 152 (LLaDA2-Mini's routing and attention shapes, 3 layers, SingleBD).
ATTENTION_SHARPEN = 4.0


def shape_config(shape: str, block: int) -> ModelConfig:
    """A paper model's shape (configs/model) or a tiny one of either family ("tiny", "tiny-moe")."""
    if shape in SHAPES:
        cfg = ModelConfig.from_hf(read_json(ROOT / SHAPES[shape]))
        return cfg.model_copy(update={"block_size": block})
    fam = "llada2_moe" if shape == "tiny-moe" else "sdar"
    v = TINY[fam]["vocab_size"]
    return ModelConfig(family=fam, mask_token_id=v - 1, eos_token_id=v - 2, pad_token_id=v - 2, block_size=block,
                       max_position_embeddings=4096, rms_norm_eps=1e-6, **TINY[fam])


def random_model(cfg: ModelConfig, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """Random weights allocated and initialised on the device (16B parameters initialise in seconds there)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(cfg, seed=0).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        model.lm_head.weight.mul_(TEMPER)
        model.lm_head.weight[cfg.eos_token_id].zero_()
        if cfg.num_experts:  # a routing that spreads as a trained model's (ATTENTION_SHARPEN)
            for name, p in model.named_parameters():
                if name.endswith(("query_layernorm.weight", "key_layernorm.weight")):
                    p.mul_(ATTENTION_SHARPEN)
    return model


def cuda_seconds(fn: Callable[[], object]) -> float:
    """Device time of `fn`'s kernels between two CUDA events (host launch overhead and sync not counted)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def wall_seconds(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def copy_rate(device: str, nbytes: int, repeats: int = 7,
              timer: Callable[[Callable[[], object]], float] | None = None) -> float:
    """Bytes moved per second (read + written) by a device-to-device copy of `nbytes`: the median of `repeats`
    copies after one untimed, each timed by `timer` (CUDA events on a GPU, the wall clock elsewhere)."""
    timer = timer or (cuda_seconds if device == "cuda" else wall_seconds)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / statistics.median(timer(lambda: dst.copy_(src)) for _ in range(repeats))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def step_bytes(model: torch.nn.Module, rows_read: int, experts: dict[int, float] | None = None) -> float:
    """Bytes of weights one decode step reads: every parameter and buffer once (a tied head is one parameter,
    counted as the head), except that an untied input embedding reads only `rows_read` rows (one per query
    position) and, for the MoE, MoE layer i reads `experts[i]` of its routed experts (None: all of them)."""
    from mbd.model.llada2_moe import LLaDA2Experts

    total = sum(map(tensor_bytes, model.parameters())) + sum(map(tensor_bytes, model.buffers()))
    table = model.model.embedding.weight
    if table is not model.lm_head.weight:
        total -= tensor_bytes(table) - min(rows_read, table.shape[0]) * tensor_bytes(table[0])
    for i, m in enumerate(x for x in model.modules() if isinstance(x, LLaDA2Experts)):
        per_expert = sum(tensor_bytes(p[0]) for p in m.parameters())
        total -= per_expert * (m.num_experts - (experts or {}).get(i, m.num_experts))
    return total


def experts_read(model: torch.nn.Module, engine: Engine, prompts: list[list[int]]) -> dict[int, float]:
    """Per MoE layer, the distinct routed experts a decode step of `engine` (eager: forward hooks do not fire
    inside CUDA Graphs) chose for all its tokens together, the median over the steps of decoding `prompts`
    (prefill forwards not counted); empty for a dense model."""
    from mbd.model.llada2_moe import LLaDA2Experts

    layers = [m for m in model.modules() if isinstance(m, LLaDA2Experts)]
    if not layers:
        return {}
    chosen: dict[int, list[int]] = {i: [] for i in range(len(layers))}
    prefilling = [False]

    def count(i: int, args: tuple) -> None:
        if not prefilling[0]:
            chosen[i].append(args[1].unique().numel())

    def prefill(*args, run=engine.runner.prefill, **kw) -> None:
        prefilling[0] = True
        try:
            run(*args, **kw)
        finally:
            prefilling[0] = False

    hooks = [m.register_forward_hook(lambda mod, args, out, i=i: count(i, args)) for i, m in enumerate(layers)]
    engine.runner.prefill = prefill
    try:
        engine.generate(prompts)
    finally:
        del engine.runner.prefill
        for h in hooks:
            h.remove()
    return {i: statistics.median(c) for i, c in chosen.items()}


def decode_config(n_buf: int, new: int) -> DecodeConfig:
    extra = dict(tau_add=0.1, tau_semi=0.9) if n_buf > 1 else {}
    return DecodeConfig(buffer_size=n_buf, tau_m2t=0.9, max_new_tokens=new, max_length=64 + new + 64,
                        max_nfe=100_000, **extra)


def run(engine: Engine, prompts: list[list[int]]) -> dict:
    """Decode `prompts` once; TPS over decode steps only (prefill excluded), ms per step, TPF per request."""
    s0, n0 = engine.stats.step_s, engine.stats.steps
    res = engine.generate(prompts)
    steps, secs = engine.stats.steps - n0, engine.stats.step_s - s0
    tokens = sum(r.num_generated for r in res)
    return {"ms_step": 1e3 * secs / steps, "tps": tokens / secs, "tpf": tokens / sum(r.nfe for r in res)}


TOP_KERNELS = 10


def kernels_per_step(engine: Engine, prompts: list[list[int]], new: int, device: str) -> dict | None:
    """GPU kernels per decode step, by name (torch.profiler over a short run; `kernel_table`)."""
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    n0 = engine.stats.steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, {"max_new_tokens": new})
    return kernel_table(prof.key_averages(), "CUDA", engine.stats.steps - n0)


def kernel_table(averages, device_type: str, steps: int, top: int = TOP_KERNELS) -> dict:
    """From a profile's `key_averages()`: the events of `device_type` ("CUDA": kernels; memcpy / memset excluded)
    launched per step, their device time per step (us), and the `top` of them by time as [name (cut to 120
    characters), launches per step, us per step], so a row says which kernels a step's time goes to."""
    steps = max(steps, 1)
    timed = sorted(((e, e.self_cpu_time_total if device_type == "CPU" else e.self_device_time_total)
                    for e in averages if e.device_type.name == device_type
                    and not e.key.startswith(("Memcpy", "Memset"))), key=lambda et: et[1], reverse=True)
    return {"per_step": sum(e.count for e, _ in timed) / steps, "us_step": sum(t for _, t in timed) / steps,
            "top": [[e.key[:120], e.count / steps, t / steps] for e, t in timed[:top]]}


def cell(model, cfg: ModelConfig, batch: int, n_bufs: list[int], new: int, repeats: int, device: str,
         compile: str = "auto") -> list[dict]:
    """One (model, batch) cell: an engine per N_buf (compiled and captured at construction), ABAB repeats, medians;
    for the MoE also the experts each N_buf's steps read, from an eager engine decoding the same prompts (its first
    4 blocks' worth of tokens)."""
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, cfg.vocab_size - 2, (batch, 64), generator=g).tolist()
    ecfg = EngineConfig(device=device, max_batch_rows=batch, batch_buckets=[batch], compile=compile)
    engines = {n: Engine(model, None, decode_config(n, new), ecfg) for n in n_bufs}
    runs: dict[int, list[dict]] = {n: [] for n in n_bufs}
    for rep in range(repeats + 1):  # the first round warms up the allocator and is dropped
        for n in (n_bufs if rep % 2 else n_bufs[::-1]):
            sync(device)
            runs[n].append(run(engines[n], prompts))
    eager = EngineConfig(device=device, max_batch_rows=batch, batch_buckets=[batch], attention="sdpa",
                         compile="off", cuda_graphs="off")
    out = []
    for n, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs[1:] or rs) for k in rs[0]}
        kernels = kernels_per_step(engines[n], prompts, 4 * cfg.block_size, device)
        med["kernels_step"] = kernels and kernels["per_step"]
        med["kernels_top"] = kernels and kernels["top"]
        med["device_ms_step"] = kernels and kernels["us_step"] / 1e3  # the GPU busy; the rest of ms_step it idles
        sample = decode_config(n, min(new, 4 * cfg.block_size))  # the cell's first steps: the row's time is short
        read = experts_read(model, Engine(model, None, sample, eager), prompts)
        out.append(med | {"batch": batch, "n_buf": n, "warmup_s": engines[n].warmup_s, "experts_read": read})
    return out


def floors(model, cfg: ModelConfig, c: dict, rate: float, flops: float) -> dict:
    """A cell's floors: weight streaming with every routed expert read ("naive") and with the experts the cell's
    steps read; the matrix floor (2 FLOPs per active weight per query position of the step)."""
    rows = c["batch"] * c["n_buf"] * cfg.block_size
    naive_b, read_b = step_bytes(model, rows), step_bytes(model, rows, c["experts_read"])
    mm_ms = 1e3 * 2 * active_params(model, cfg) * rows / flops
    return {"naive_floor_bytes": naive_b, "naive_floor_ms": 1e3 * naive_b / rate, "floor_bytes": read_b,
            "floor_ms": 1e3 * read_b / rate, "x_floor": c["ms_step"] / (1e3 * read_b / rate),
            "x_naive_floor": c["ms_step"] / (1e3 * naive_b / rate), "matmul_floor_ms": mm_ms,
            "x_matmul": c["ms_step"] / mm_ms,
            "kernels_layer": c["kernels_step"] / cfg.num_hidden_layers if c["kernels_step"] else None}


def measure(shape: str, batches: list[int], n_bufs: list[int], block: int, new: int, repeats: int,
            device: str, compile: str = "auto") -> dict:
    """Every (batch, N_buf) cell of one model shape against its floors; the top-level floor is the first cell's.
    compile: the engines' EngineConfig.compile (auto: compiled on a GPU, eager sdpa on CPU)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = shape_config(shape, block)
    model = random_model(cfg, device, dtype)
    rate, flops = copy_rate(device, (1 << 30) if device == "cuda" else (1 << 26)), matmul_rate(device, dtype)
    cells = [c for b in batches for c in cell(model, cfg, b, n_bufs, new, repeats, device, compile)]
    for c in cells:
        c |= floors(model, cfg, c, rate, flops)
    first = cells[0]
    return {"shape": shape, "block": block, "layers": cfg.num_hidden_layers, "device": device, "compile": compile,
            "dtype": str(dtype).removeprefix("torch."),
            "copy_rate_tb_s": rate / 1e12, "matmul_tflops": flops / 1e12,
            "weight_bytes": sum(map(tensor_bytes, model.parameters())) + sum(map(tensor_bytes, model.buffers())),
            "attention_sharpen": ATTENTION_SHARPEN if cfg.num_experts else None,
            "floor_bytes": first["floor_bytes"], "floor_ms": first["floor_ms"],
            "naive_floor_bytes": first["naive_floor_bytes"], "naive_floor_ms": first["naive_floor_ms"], "cells": cells}


def active_params(model: torch.nn.Module, cfg: ModelConfig) -> float:
    """Weights one token multiplies: all but the input embedding, with only k of the E routed experts."""
    n = sum(p.numel() for p in model.parameters()) - model.model.embedding.weight.numel()
    if cfg.num_experts:
        from mbd.model.llada2_moe import LLaDA2Experts

        n -= sum(p.numel() for m in model.modules() if isinstance(m, LLaDA2Experts)
                 for p in m.parameters()) * (1 - cfg.num_experts_per_tok / cfg.num_experts)
    return n


def table(m: dict) -> str:
    spread = f"; q/k norms x{m['attention_sharpen']:g} (routing spread)" if m["attention_sharpen"] else ""
    lines = [f"{m['shape']} (B={m['block']}, {m['dtype']} on {m['device']}): copy rate {m['copy_rate_tb_s']:.3g} TB/s "
             f"(median of device-to-device copies), weights {m['weight_bytes'] / 1e9:.2f} GB; matrix rate "
             f"{m['matmul_tflops']:.0f} TFLOP/s{spread}",
             "| batch | N_buf | ms/step | kernels' ms/step | floor ms (experts read) | x floor | "
             "floor ms (all experts) | x that floor | experts read / layer | x matmul floor | TPF | TPS | "
             "kernels/step | kernels/layer | warm-up s |",
             "|---:" * 15 + "|"]
    for c in m["cells"]:
        k = "-" if c["kernels_step"] is None else f"{c['kernels_step']:.0f}"
        kl = "-" if c["kernels_layer"] is None else f"{c['kernels_layer']:.1f}"
        ex = f"{statistics.mean(c['experts_read'].values()):.0f}" if c["experts_read"] else "-"
        dev = "-" if c["device_ms_step"] is None else f"{c['device_ms_step']:.2f}"
        lines.append(f"| {c['batch']} | {c['n_buf']} | {c['ms_step']:.2f} | {dev} | {c['floor_ms']:.3f} | "
                     f"{c['x_floor']:.2f} | {c['naive_floor_ms']:.3f} | {c['x_naive_floor']:.2f} | {ex} | "
                     f"{c['x_matmul']:.2f} | "
                     f"{c['tpf']:.2f} | {c['tps']:.0f} | {k} | {kl} | {c['warmup_s']:.1f} |")
    lines += [top_kernels(c, m["layers"]) for c in m["cells"] if c["kernels_top"]]
    return "\n".join(lines)


def top_kernels(c: dict, layers: int) -> str:
    """One cell's kernels by device time: name, launches per decoder layer per step, us per step."""
    return (f"- top kernels, batch {c['batch']} N_buf {c['n_buf']} (launches per layer per step, us per step): "
            + "; ".join(f"{name} x{count / layers:.2f} {us:.0f} us" for name, count, us in c["kernels_top"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="sdar-8b", help=f"{', '.join(SHAPES)}, tiny or tiny-moe")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--n-buf", default="1,2")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--compile", default="auto", help="EngineConfig.compile: auto, off, default, max-autotune")
    ap.add_argument("--json", help="also write the measurement here")
    args = ap.parse_args(argv)
    ints = [int(x) for x in args.batch.split(",")], [int(x) for x in args.n_buf.split(",")]
    m = measure(args.shape, *ints, args.block, args.new, args.repeats, args.device, args.compile)
    print(table(m))
    if args.json:
        Path(args.json).write_text(json.dumps(m, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
