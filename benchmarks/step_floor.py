"""A decode step against its physics: the engine's ms per step (compiled and CUDA-Graph captured on a GPU) for a
paper model's shape with random weights, against the weight-streaming floor (the bytes of weights one batch-1 step
reads, over the card's measured copy rate), with TPF, TPS and the kernels per step and per decoder layer from
torch.profiler. The floor counts every weight for a dense model (as the first H200 report did) and, for the MoE,
every weight but the routed experts plus the routed experts the step's tokens chose (counted by a hook).

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
    return model


def copy_rate(device: str, nbytes: int) -> float:
    """Bytes moved per second (read + written) by a device-to-device copy of `nbytes`, median of 5."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times[1:])


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def weight_bytes(model: torch.nn.Module, experts_read: dict[int, float] | None = None) -> float:
    """Every weight's bytes; for the MoE, each layer's routed experts count as many times as `experts_read`
    (layer -> experts a step's tokens chose, on average) says."""
    from mbd.model.llada2_moe import LLaDA2Experts

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for i, m in enumerate(x for x in model.modules() if isinstance(x, LLaDA2Experts)):
        per_expert = sum(p[0].numel() * p.element_size() for p in m.parameters())
        total -= per_expert * (m.num_experts - (experts_read or {}).get(i, m.num_experts))
    return total


def experts_read(model: torch.nn.Module, cfg: ModelConfig, device: str) -> dict[int, float]:
    """Per MoE layer, the distinct routed experts one batch-1 Block Buffer step's tokens chose, averaged over the
    steps of a short eager decode (forward hooks do not fire inside CUDA Graphs); empty for a dense model."""
    from mbd.model.llada2_moe import LLaDA2Experts

    layers = [m for m in model.modules() if isinstance(m, LLaDA2Experts)]
    if not layers:
        return {}
    chosen: dict[int, list[int]] = {i: [] for i in range(len(layers))}
    hooks = [m.register_forward_hook(lambda mod, args, out, i=i: chosen[i].append(len(set(args[1].flatten().tolist()))))
             for i, m in enumerate(layers)]
    try:
        eager = EngineConfig(device=device, max_batch_rows=1, attention="sdpa", compile="off", cuda_graphs="off")
        prompt = torch.randint(0, cfg.vocab_size - 2, (1, 64), generator=torch.Generator().manual_seed(5)).tolist()
        Engine(model, None, decode_config(2, 4 * cfg.block_size), eager).generate(prompt)
    finally:
        for h in hooks:
            h.remove()
    return {i: statistics.mean(c[1:]) for i, c in chosen.items()}  # c[0]: the prompt's prefill


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


def kernels_per_step(engine: Engine, prompts: list[list[int]], new: int, device: str) -> float | None:
    """GPU kernels launched per decode step (torch.profiler over a short run; memcpy / memset excluded)."""
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    n0 = engine.stats.steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, {"max_new_tokens": new})
    kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA"
                  and not e.key.startswith(("Memcpy", "Memset")))
    return kernels / max(engine.stats.steps - n0, 1)


def cell(model, cfg: ModelConfig, batch: int, n_bufs: list[int], new: int, repeats: int, device: str) -> list[dict]:
    """One (model, batch) cell: an engine per N_buf (compiled and captured at construction), ABAB repeats, medians."""
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, cfg.vocab_size - 2, (batch, 64), generator=g).tolist()
    ecfg = EngineConfig(device=device, max_batch_rows=batch, batch_buckets=[batch])
    engines = {n: Engine(model, None, decode_config(n, new), ecfg) for n in n_bufs}
    runs: dict[int, list[dict]] = {n: [] for n in n_bufs}
    for rep in range(repeats + 1):  # the first round warms up the allocator and is dropped
        for n in (n_bufs if rep % 2 else n_bufs[::-1]):
            sync(device)
            runs[n].append(run(engines[n], prompts))
    out = []
    for n, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs[1:] or rs) for k in rs[0]}
        med["kernels_step"] = kernels_per_step(engines[n], prompts, 4 * cfg.block_size, device)
        out.append(med | {"batch": batch, "n_buf": n, "warmup_s": engines[n].warmup_s})
    return out


def measure(shape: str, batches: list[int], n_bufs: list[int], block: int, new: int, repeats: int,
            device: str) -> dict:
    """Every (batch, N_buf) cell of one model shape, and the floor of a batch-1 step."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = shape_config(shape, block)
    model = random_model(cfg, device, dtype)
    rate, flops = copy_rate(device, (1 << 30) if device == "cuda" else (1 << 26)), matmul_rate(device, dtype)
    floor_b = weight_bytes(model, experts_read(model, cfg, device))
    cells = [c for b in batches for c in cell(model, cfg, b, n_bufs, new, repeats, device)]
    floor_ms = 1e3 * floor_b / rate
    active = active_params(model, cfg)
    for c in cells:  # the matrix floor: 2 FLOPs per active weight per query position of the step
        mm_ms = 1e3 * 2 * active * c["batch"] * c["n_buf"] * block / flops
        c |= {"floor_ms": floor_ms, "x_floor": c["ms_step"] / floor_ms, "matmul_floor_ms": mm_ms,
              "x_matmul": c["ms_step"] / mm_ms,
              "kernels_layer": c["kernels_step"] / cfg.num_hidden_layers if c["kernels_step"] else None}
    return {"shape": shape, "block": block, "device": device, "dtype": str(dtype).removeprefix("torch."),
            "copy_rate_tb_s": rate / 1e12, "matmul_tflops": flops / 1e12, "weight_bytes": weight_bytes(model),
            "floor_bytes": floor_b, "floor_ms": floor_ms, "cells": cells}


def active_params(model: torch.nn.Module, cfg: ModelConfig) -> float:
    """Weights one token multiplies: all but the input embedding, with only k of the E routed experts."""
    n = sum(p.numel() for p in model.parameters()) - model.model.embedding.weight.numel()
    if cfg.num_experts:
        from mbd.model.llada2_moe import LLaDA2Experts

        n -= sum(p.numel() for m in model.modules() if isinstance(m, LLaDA2Experts)
                 for p in m.parameters()) * (1 - cfg.num_experts_per_tok / cfg.num_experts)
    return n


def table(m: dict) -> str:
    lines = [f"{m['shape']} (B={m['block']}, {m['dtype']} on {m['device']}): copy rate {m['copy_rate_tb_s']:.2f} TB/s, "
             f"floor {m['floor_bytes'] / 1e9:.2f} GB -> {m['floor_ms']:.3f} ms per batch-1 step; matrix rate "
             f"{m['matmul_tflops']:.0f} TFLOP/s",
             "| batch | N_buf | ms/step | x weight floor | x matmul floor | TPF | TPS | kernels/step | kernels/layer | "
             "warm-up s |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in m["cells"]:
        k = "-" if c["kernels_step"] is None else f"{c['kernels_step']:.0f}"
        kl = "-" if c["kernels_layer"] is None else f"{c['kernels_layer']:.1f}"
        lines.append(f"| {c['batch']} | {c['n_buf']} | {c['ms_step']:.2f} | {c['x_floor']:.2f} | {c['x_matmul']:.2f} | "
                     f"{c['tpf']:.2f} | {c['tps']:.0f} | {k} | {kl} | {c['warmup_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="sdar-8b", help=f"{', '.join(SHAPES)}, tiny or tiny-moe")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--n-buf", default="1,2")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", help="also write the measurement here")
    args = ap.parse_args(argv)
    ints = [int(x) for x in args.batch.split(",")], [int(x) for x in args.n_buf.split(",")]
    m = measure(args.shape, *ints, args.block, args.new, args.repeats, args.device)
    print(table(m))
    if args.json:
        Path(args.json).write_text(json.dumps(m, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
