"""LLaDA2-MoE (LLaDA2-Mini / -DMax / 2.1-Mini / -CAP): fused QKV, partial rotary, per-head q/k RMSNorm,
sigmoid group-limited top-k routing with an expert bias, shared experts, first_k_dense_replace dense layers.

Attribute names equal the tensor names of LLaDA2's HuggingFace checkpoints (`model.word_embeddings`,
`model.layers.N.attention.query_key_value`, `mlp.experts.E.gate_proj`, `mlp.gate.expert_bias`, ...).
"""

from __future__ import annotations

import torch
from torch import nn

from mbd.config import ModelConfig
from mbd.model.base import CausalLMBase, self_attention
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

    def forward(self, x, cos, sin, mask, cache, layer, kv_at):
        b, n, _ = x.shape
        qkv = self.query_key_value(x).view(b, n, self.n_heads + 2 * self.n_kv, self.hd)
        q, k, v = qkv.split([self.n_heads, self.n_kv, self.n_kv], dim=2)
        q = self.query_layernorm(q).transpose(1, 2)
        k = self.key_layernorm(k).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.dense(self_attention(q, k, v.transpose(1, 2), mask, cache, layer, kv_at))


class LLaDA2Gate(nn.Module):
    """Sigmoid scores; the expert bias only steers *which* experts are chosen, not their weights."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
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


class LLaDA2SparseMoE(nn.Module):
    """Routed experts + shared experts; under TP every expert is split along its hidden dim and the
    partial sums of all experts are reduced once."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.gate = LLaDA2Gate(cfg)
        self.experts = nn.ModuleList(SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size, tp, reduce=False)
                                     for _ in range(cfg.num_experts))
        self.shared_experts = (SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts, tp, reduce=False)
                               if cfg.num_shared_experts else None)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        idx, w = self.gate(x)
        y = torch.zeros_like(x)
        # Loop over experts, not tokens: each expert runs once on the tokens routed to it. In training every
        # expert runs even on zero tokens, so that all data-parallel ranks produce the same gradient buckets.
        for e, expert in enumerate(self.experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel() or self.training:
                y.index_add_(0, tok, expert(x[tok]) * w[tok, slot].unsqueeze(-1).to(x.dtype))
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return self.tp.all_reduce(y).view(shape)


class LLaDA2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = LLaDA2Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        dense = cfg.num_experts == 0 or layer < cfg.first_k_dense_replace
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, tp) if dense else LLaDA2SparseMoE(cfg, tp)

    def forward(self, h, cos, sin, mask, cache, layer, kv_at):
        h = h + self.attention(self.input_layernorm(h), cos, sin, mask, cache, layer, kv_at)
        return h + self.mlp(self.post_attention_layernorm(h))


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
