"""One LLaDA2 MoE layer at a paper shape against its floor: the fused Triton path (`mbd.model.fused_moe`) and the
torch._grouped_mm path it replaces on CUDA, each timed eager and replayed as a CUDA Graph (as the engine runs it),
against the bytes this very call reads (the routed experts its tokens chose, the shared expert, the router) over a
copy rate passed in (or measured here as `benchmarks.step_floor` does).

    python -m benchmarks.moe_step --shape llada2-mini --tokens 32 --copy-rate 4.17e12     # on a GPU
    python -m benchmarks.moe_step --shape tiny-moe --tokens 8 --device cpu                  # grouped_mm only

The hidden states are independent random rows (RMS-normalised scale), so the router spreads a block's tokens as a
trained model's block does (LLaDA2-Mini, 32 tokens x 8: about 160 of 256 experts); the count is measured and
reported with the floor it gives. Both paths' outputs are compared (the largest difference over the output's
scale), so the row proves the fused path equal on the card as well as timing it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.step_floor import copy_rate as measured_copy_rate, shape_config  # noqa: E402
from mbd.model import fused_moe  # noqa: E402
from mbd.model.llada2_moe import LLaDA2SparseMoE  # noqa: E402
from mbd.model.tp import SINGLE  # noqa: E402


def moe_layer(shape: str, device: str, dtype: torch.dtype, seed: int = 0) -> LLaDA2SparseMoE:
    """One MoE layer of `shape` (step_floor's shapes) with random weights; the expert bias stays float32."""
    cfg = shape_config(shape, 32)
    torch.manual_seed(seed)
    with torch.device(device):
        return LLaDA2SparseMoE(cfg, SINGLE).to(dtype).eval()


def floor_bytes(moe: LLaDA2SparseMoE, idx: torch.Tensor) -> int:
    """The weight bytes one call reads: each routed expert some token chose (gate, up, down) once, the shared
    expert and the router (weight and fp32 bias)."""
    ex = moe.experts
    per_expert = sum(p[0].numel() * p.element_size() for p in (ex.gate_proj, ex.up_proj, ex.down_proj))
    rest = [*moe.gate.parameters(), *moe.gate.buffers()]
    if moe.shared_experts is not None:
        rest += list(moe.shared_experts.parameters())
    return len(idx.unique()) * per_expert + sum(t.numel() * t.element_size() for t in rest)


def cuda_us(fn: Callable[[], torch.Tensor], repeats: int, graph: bool) -> float:
    """Median microseconds of one call timed with CUDA events; `graph`: the call captured once and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def measure(shape: str = "llada2-mini", tokens: int = 32, copy_rate: float | None = None, device: str = "cuda",
            dtype: torch.dtype = torch.bfloat16, repeats: int = 50) -> dict:
    """The layer's microseconds per call on both paths (eager and graph-replayed on CUDA), the floor, each path
    over it, and how far the fused output is from the grouped_mm one. On CPU the fused path runs only under Triton's
    interpreter and nothing is timed (the row's sizes and equality, quickly)."""
    moe = moe_layer(shape, device, dtype)
    x = torch.randn(tokens, moe.gate.weight.shape[1], device=device, dtype=dtype)
    paths: dict[str, Callable[[], torch.Tensor]] = {
        "grouped_mm": lambda: moe.experts(x, *moe.gate(x, "grouped_mm"), moe.shared_experts, "grouped_mm")}
    if device == "cuda" or fused_moe.interpreting():
        paths["fused"] = lambda: moe.experts(x, *moe.gate(x, "triton"), moe.shared_experts, "triton")
    out: dict = {"shape": shape, "tokens": tokens, "dtype": str(dtype).removeprefix("torch.")}
    with torch.inference_mode():
        idx, _ = moe.gate(x, "grouped_mm")
        outputs = {name: fn() for name, fn in paths.items()}
        nbytes = floor_bytes(moe, idx)
        out.update(experts_touched=len(idx.unique()), num_experts=moe.experts.num_experts, floor_bytes=nbytes)
        if "fused" in outputs:
            ref = outputs["grouped_mm"].float()
            out["fused_vs_grouped_mm"] = ((outputs["fused"].float() - ref).abs().max() / ref.abs().max()).item()
        if device != "cuda":
            return out
        rate = copy_rate or measured_copy_rate(device, 1 << 30)
        out.update(copy_rate=rate, floor_us=nbytes / rate * 1e6, card=torch.cuda.get_device_name())
        for name, fn in paths.items():
            for graph in (False, True):
                if graph and name == "grouped_mm" and dtype != torch.bfloat16:
                    continue  # torch._grouped_mm's CUDA fallback for other dtypes reads offsets on the host
                key = f"{name}_{'graph' if graph else 'eager'}_us"
                out[key] = cuda_us(fn, repeats, graph)
                out[key.replace("_us", "_x_floor")] = out[key] / out["floor_us"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llada2-mini", help="llada2-mini or tiny-moe (benchmarks.step_floor)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per call: batch 1 x block size B")
    ap.add_argument("--copy-rate", type=float, default=None, help="bytes/s (read + written); default: measured")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--repeats", type=int, default=50)
    a = ap.parse_args(argv)
    m = measure(a.shape, a.tokens, a.copy_rate, a.device, getattr(torch, a.dtype), a.repeats)
    print(json.dumps(m, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
