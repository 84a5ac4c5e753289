"""Model FLOPs and the device's matrix rate, for MFU (model FLOPs utilisation) in training and the benchmarks."""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn


def train_flops_per_token(model: nn.Module) -> float:
    """6 x the non-embedding parameters (forward 2, backward 4 per weight and token; attention's own FLOPs
    left out, as usual). ZeRO-3 partitions parameters: their full size is `ds_numel`. For a MoE model every
    expert counts, so its MFU is an upper bound."""
    def size(ps) -> int:
        return sum(getattr(p, "ds_numel", p.numel()) for p in ps)

    embed = sum(size(m.parameters()) for m in model.modules() if isinstance(m, nn.Embedding))
    return 6.0 * (size(model.parameters()) - embed)


def matmul_rate(device: str, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul in `dtype` (the device's measured matrix rate), median of 5."""
    n = 8192 if device == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    times = []
    for _ in range(6):
        _sync(device)
        t = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times[1:])


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
