"""LLaDA2-MoE (LLaDA2-Mini / -DMax / 2.1-Mini / -CAP): fused QKV, partial rotary, per-head q/k RMSNorm,
sigmoid group-limited top-k routing with an expert bias, shared experts, first_k_dense_replace dense layers.

Attribute names equal the tensor names of LLaDA2's HuggingFace checkpoints (`model.word_embeddings`,
`model.layers.N.attention.query_key_value`, `mlp.gate.expert_bias`, ...), except the routed experts, which are
stacked (`mlp.experts.gate_proj` [E, ...]) and read from / written to HF's `mlp.experts.E.gate_proj.weight`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mbd.config import ModelConfig
import mbd.model.fused_moe as fused_moe
from mbd.model.base import CausalLMBase
from mbd.model.layers import RMSNorm, SwiGLU, apply_rope
from mbd.model.tp import SINGLE, ColumnParallelLinear, RowParallelLinear, TPGroup, VocabParallelHead


class LLaDA2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        hd = cfg.head_dim
        self.n_heads = tp.split(cfg.num_attention_heads, "num_attention_heads")
        self.n_kv = tp.split(cfg.num_key_value_heads, "num_key_value_heads")
        self.hd = hd
        splits = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.num_key_value_heads * hd)
        self.query_key_value = ColumnParallelLinear(cfg.hidden_size, sum(splits), cfg.attention_bias, tp, splits)
        self.query_layernorm = RMSNorm(hd, cfg.rms_norm_eps)
        self.key_layernorm = RMSNorm(hd, cfg.rms_norm_eps)
        self.dense = RowParallelLinear(cfg.num_attention_heads * hd, cfg.hidden_size, False, tp)

    def forward(self, x, cos, sin, attend):
        b, n, _ = x.shape
        qkv = self.query_key_value(x).view(b, n, self.n_heads + 2 * self.n_kv, self.hd)
        q, k, v = qkv.split([self.n_heads, self.n_kv, self.n_kv], dim=2)
        q = apply_rope(self.query_layernorm(q), cos, sin).transpose(1, 2)
        k = apply_rope(self.key_layernorm(k), cos, sin).transpose(1, 2)
        return self.dense(attend(q, k, v.transpose(1, 2)))


class LLaDA2Gate(nn.Module):
    """Sigmoid scores; the expert bias only steers *which* experts are chosen, not their weights.

    router_dtype fp32 (the only one config.json may state, `mbd.hf_keys`): the router's logits are computed in
    float32 and the expert bias is kept in float32 through `.to(dtype)`, as the reference engines keep it (a bias
    rounded to bfloat16 can flip near-ties between experts)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))
        nn.init.normal_(self.weight, std=0.02)

    def _apply(self, fn, recurse=True):
        bias = self._buffers.pop("expert_bias")
        super()._apply(fn, recurse)
        # fn moves and casts; only its move applies to the bias (an empty slice tells where fn puts tensors)
        self._buffers["expert_bias"] = bias.to(fn(bias[:0]).device)
        return self

    def forward(self, x: torch.Tensor, path: fused_moe.Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [t, d] -> each token's chosen experts [t, k] and their weights [t, k] (float32); `path`: the MoE's
        (default `fused_moe.expert_path`), "triton" running this in one kernel."""
        c = self.cfg
        if (path or fused_moe.expert_path(x)) == "triton":
            return fused_moe.route(x, self.weight, self.expert_bias, c.n_group, c.topk_group, c.num_experts_per_tok,
                                   c.norm_topk_prob, c.routed_scaling_factor)
        scores = torch.sigmoid(x.float() @ self.weight.float().t())  # [t, E]
        choice = scores + self.expert_bias.float()
        t = choice.shape[0]
        grouped = choice.view(t, c.n_group, -1)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(c.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(c.num_experts // c.n_group, dim=1), float("-inf"))
        idx = choice.topk(c.num_experts_per_tok, dim=-1).indices
        w = scores.gather(1, idx)
        if c.norm_topk_prob and c.num_experts_per_tok > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * c.routed_scaling_factor


class LLaDA2Experts(nn.Module):
    """The routed experts' SwiGLU weights stacked over experts (each [E, out, in], HF's per-expert layout) so that
    grouped kernels run every expert on its tokens only, with static shapes and no host synchronisation (CUDA
    Graph capturable, `fullgraph` compilable); `mbd.model.fused_moe` chooses the path. Checkpoints keep HF's
    per-expert tensors (`experts.{e}.gate_proj.weight`, ...): `checkpoint_parts` says which, `shard_` cuts the
    stack under TP (gate/up column-parallel, down row-parallel along the expert's hidden dim)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.tp, self.num_experts = tp, cfg.num_experts
        d, ff = cfg.hidden_size, tp.split(cfg.moe_intermediate_size, "moe_intermediate_size")
        self.gate_proj = nn.Parameter(torch.empty(cfg.num_experts, ff, d))
        self.up_proj = nn.Parameter(torch.empty(cfg.num_experts, ff, d))
        self.down_proj = nn.Parameter(torch.empty(cfg.num_experts, d, ff))
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)

    def checkpoint_parts(self, name: str) -> list[str]:
        """The checkpoint tensors whose stack over experts is parameter `name` (`...experts.gate_proj`)."""
        prefix, _, leaf = name.rpartition(".")
        return [f"{prefix}.{e}.{leaf}.weight" for e in range(self.num_experts)]

    def join(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(parts)

    def split(self, name: str, full: torch.Tensor) -> list[torch.Tensor]:
        return list(full.unbind(0))

    def shard_(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full stack [E, out, in] of parameter `name`."""
        return full.chunk(self.tp.world, dim=2 if name.endswith("down_proj") else 1)[self.tp.rank]

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, shared: SwiGLU | None = None,
                path: fused_moe.Path | None = None) -> torch.Tensor:
        """x [t, d]; idx, w [t, k]: each token's chosen experts and their weights -> sum_k w * expert(x) (+ the
        shared expert's output), [t, d] (this rank's partial sum under TP). The shared expert is summed here so that
        the fused path can overlap it with the routed experts. `path`: default `fused_moe.expert_path`, which
        says the paths."""
        path = path or fused_moe.expert_path(x)
        if path == "triton":
            ws = (shared.gate_up_proj.weight, shared.down_proj.weight) if shared is not None else (None, None)
            return fused_moe.experts(x, idx, w, self.gate_proj, self.up_proj, self.down_proj, *ws)
        y = self._grouped(x, idx, w) if path == "grouped_mm" else self._loop(x, idx, w)
        return y if shared is None else y + shared(x)

    def _grouped(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Token copies sorted by expert, one grouped GEMM per projection (each expert's weights read once), the
        weighted results added back per token."""
        k = idx.shape[1]
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        tok = order // k
        ones = torch.ones_like(flat, dtype=torch.int32)
        ends = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device).scatter_add_(0, flat, ones)
        ends = ends.cumsum(0, dtype=torch.int32)
        xs = x[tok]
        mm = torch._grouped_mm if torch.is_grad_enabled() else fused_moe.grouped_mm
        gate = mm(xs, self.gate_proj.transpose(1, 2), offs=ends)
        up = mm(xs, self.up_proj.transpose(1, 2), offs=ends)
        y = mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=ends)
        y = y * w.flatten()[order].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(x).index_add_(0, tok, y)

    def _loop(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Each expert some token chose, on those tokens (host-side loop: float64 only, never compiled)."""
        y = torch.zeros_like(x)
        for e in idx.unique().tolist():
            tok, j = (idx == e).nonzero(as_tuple=True)
            h = F.silu(x[tok] @ self.gate_proj[e].t()) * (x[tok] @ self.up_proj[e].t())
            y.index_add_(0, tok, (h @ self.down_proj[e].t()) * w[tok, j].unsqueeze(-1).to(x.dtype))
        return y


class LLaDA2SparseMoE(nn.Module):
    """Routed experts + shared experts; under TP every expert is split along its hidden dim and the
    partial sums of all experts are reduced once."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.gate = LLaDA2Gate(cfg)
        self.experts = LLaDA2Experts(cfg, tp)
        self.shared_experts = (SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts, tp, reduce=False)
                               if cfg.num_shared_experts else None)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        path = fused_moe.expert_path(x)
        y = self.experts(x, *self.gate(x, path), self.shared_experts, path)
        return self.tp.all_reduce(y).view(shape)


class LLaDA2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = LLaDA2Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        dense = cfg.num_experts == 0 or layer < cfg.first_k_dense_replace
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, tp) if dense else LLaDA2SparseMoE(cfg, tp)

    def forward(self, x, residual, cos, sin, attend):
        residual = residual + x
        residual = residual + self.attention(self.input_layernorm(residual), cos, sin, attend)
        return self.mlp(self.post_attention_layernorm(residual)), residual


class LLaDA2MoeModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LLaDA2DecoderLayer(cfg, tp, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def embedding(self) -> nn.Embedding:
        return self.word_embeddings


class LLaDA2MoeModelLM(CausalLMBase):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.model = LLaDA2MoeModel(cfg, tp)
        self.lm_head = VocabParallelHead(cfg.hidden_size, cfg.vocab_size, tp)
        self.tie_weights()
