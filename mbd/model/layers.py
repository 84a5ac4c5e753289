"""Building blocks shared by both BD-LM families: RMSNorm, RoPE, attention kernels, SwiGLU MLP."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from mbd.model.tp import SINGLE, ColumnParallelLinear, RowParallelLinear, TPGroup


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(position_ids: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [b, n, 1, rotary_dim] for absolute positions (computed on the fly: cheap, no max-len table)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=position_ids.device, dtype=torch.float32) / rotary_dim))
    freqs = position_ids.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).unsqueeze(2), emb.sin().to(dtype).unsqueeze(2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first cos.shape[-1] dims of each head of x [b, n, heads, d] (partial rotary leaves
    the rest). Applied before the heads move to dim 1, so q reaches attention as a transposed view of [b, n, h, d],
    the attention output keeps that order and merging its heads is a view, not a copy (one kernel fewer per
    compiled layer)."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr.chunk(2, dim=-1)
    xr = xr * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((xr, xp), dim=-1) if xp.numel() else xr


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """Scaled dot-product attention [b,h,n,d] x [b,kvh,s,d] under a dense bool mask (SDPA, the reference) or a
    FlexAttention BlockMask (training's dual-stream mask)."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return training_flex(q.is_cuda)(q, k, v, block_mask=mask, enable_gqa=gqa)


@functools.cache
def training_flex(cuda: bool):
    """flex_attention for a training BlockMask: compiled on CUDA (a fused kernel: uncompiled it materialises the
    scores, which a long dual-stream input cannot afford), eager on CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if cuda else flex_attention


class SwiGLU(nn.Module):
    """gate|up one column-parallel GEMM (the checkpoint's gate_proj and up_proj), down row-parallel (one
    all-reduce per MLP under TP)."""

    def __init__(self, d: int, d_ff: int, tp: TPGroup = SINGLE, reduce: bool = True):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(d, 2 * d_ff, False, tp, (d_ff, d_ff), parts=("gate_proj", "up_proj"))
        self.down_proj = RowParallelLinear(d_ff, d, False, tp, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
