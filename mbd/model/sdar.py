"""SDAR: a Qwen3-style dense decoder (q/k RMSNorm, RoPE, SwiGLU) trained as a block diffusion LM.

Module attribute names equal the tensor names of SDAR's HuggingFace checkpoints (`model.layers.N.self_attn.o_proj.
weight`, ...), except the packed projections: q|k|v run as one GEMM (`qkv_proj`) and the MLP's gate|up as one
(`gate_up_proj`), read from and written to the checkpoint's `q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`.
"""

from __future__ import annotations

from torch import nn

from mbd.config import ModelConfig
from mbd.model.base import CausalLMBase
from mbd.model.layers import RMSNorm, SwiGLU, apply_rope
from mbd.model.tp import SINGLE, ColumnParallelLinear, RowParallelLinear, TPGroup, VocabParallelHead


class SDARAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads = tp.split(cfg.num_attention_heads, "num_attention_heads")
        self.n_kv = tp.split(cfg.num_key_value_heads, "num_key_value_heads")
        self.hd = hd
        splits = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.num_key_value_heads * hd)
        self.qkv_proj = ColumnParallelLinear(d, sum(splits), cfg.attention_bias, tp, splits,
                                             parts=("q_proj", "k_proj", "v_proj"))
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, d, False, tp)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attend):
        b, n, _ = x.shape
        q, k, v = self.qkv_proj(x).view(b, n, -1, self.hd).split([self.n_heads, self.n_kv, self.n_kv], dim=2)
        q = apply_rope(self.q_norm(q), cos, sin).transpose(1, 2)
        k = apply_rope(self.k_norm(k), cos, sin).transpose(1, 2)
        return self.o_proj(attend(q, k, v.transpose(1, 2)))


class SDARDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SDARAttention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, tp)

    def forward(self, x, residual, cos, sin, attend):
        residual = residual + x
        residual = residual + self.self_attn(self.input_layernorm(residual), cos, sin, attend)
        return self.mlp(self.post_attention_layernorm(residual)), residual


class SDARModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(SDARDecoderLayer(cfg, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def embedding(self) -> nn.Embedding:
        return self.embed_tokens


class SDARForCausalLM(CausalLMBase):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.model = SDARModel(cfg, tp)
        self.lm_head = VocabParallelHead(cfg.hidden_size, cfg.vocab_size, tp)
        self.tie_weights()
