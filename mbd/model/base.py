"""The forward pass shared by both families: embed -> decoder layers -> norm -> head.

One implementation serves training (mask over the whole input, no cache) and inference (queries are the
Block Buffer tokens, keys are the whole static KV cache row, which the forward also writes).
"""

from __future__ import annotations

import torch
from torch import nn

from mbd.config import ModelConfig
from mbd.model.cache import KVCache
from mbd.model.layers import attend, rope_cos_sin
from mbd.model.tp import TPGroup


class CausalLMBase(nn.Module):
    """Subclasses define `self.model` (with `embedding`, `layers`, `norm`) and `self.lm_head`."""

    cfg: ModelConfig
    tp: TPGroup

    def tie_weights(self) -> None:
        """Share the LM head with the input embedding when the config says so (TP=1 only: under TP the
        head is a vocab shard and is loaded from the embedding tensor instead)."""
        if self.cfg.tie_word_embeddings and self.tp.world == 1:
            self.lm_head.weight = self.model.embedding.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask,
                cache: KVCache | None = None) -> torch.Tensor:
        h = self.model.embedding(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.cfg.rotary_dim, self.cfg.rope_theta, h.dtype)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, mask, cache, i, position_ids)
        return self.lm_head(self.model.norm(h))


def self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, cache: KVCache | None,
                   layer: int, pos: torch.Tensor) -> torch.Tensor:
    """q [b,h,n,d], k/v [b,kvh,n,d]; with a cache, k/v are written at `pos` and attention runs over the row."""
    if cache is not None:
        cache.write(layer, k, v, pos)
        k, v = cache.read(layer)
    o = attend(q, k, v, mask)
    return o.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
