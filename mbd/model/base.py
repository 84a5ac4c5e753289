"""The forward pass shared by both families: embed -> decoder layers -> norm -> head.

One implementation serves training (mask over the whole input, no cache) and inference (queries are the
Block Buffer tokens, keys are the cached prefix of their row, which the forward also writes). At inference
the head runs only on the positions whose logits are read (`logits_at`): a decode step needs them for its
ACTIVE slots only, a prefill for none, and the LM head plus the policy's vocabulary softmax is a large part
of a small model's step. `Segments` lets one forward carry several groups of rows (the decode batch and a
prefill chunk of another request): the linear layers run once over all tokens, attention per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mbd.config import ModelConfig
from mbd.model.cache import KVCache
from mbd.model.layers import attend, rope_cos_sin
from mbd.model.tp import TPGroup


@dataclass(frozen=True)
class Segment:
    """`rows` x `width` consecutive tokens of a flat [1, N] input that attend as rows of `cache` under `mask`."""

    rows: int
    width: int
    cache: KVCache
    mask: object
    pos: torch.Tensor  # [rows, width]


@dataclass(frozen=True)
class Segments:
    """Passed as the forward's `cache` (with mask None): the input is [1, sum(rows * width)] tokens."""

    parts: tuple[Segment, ...]


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
                cache: KVCache | Segments | None = None, logits_at: torch.Tensor | None = None,
                token_conf: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [b, n, V]; with `logits_at` (an index [b, m] into the n positions) only those [b, m, V]
        (m = 0: the head does not run). token_conf [b, n]: DMax's token merge (`merge_embeddings`)."""
        h = self.model.embedding(input_ids)
        if token_conf is not None:
            h = merge_embeddings(h, token_conf, self.model.embedding, self.cfg.mask_token_id)
        cos, sin = rope_cos_sin(position_ids, self.cfg.rotary_dim, self.cfg.rope_theta, h.dtype)
        if isinstance(cache, KVCache):  # where each token's K/V go, the same for every layer
            kv_at = cache.address(position_ids)
        elif isinstance(cache, Segments):
            kv_at = tuple(s.cache.address(s.pos) for s in cache.parts)
        else:
            kv_at = None
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, mask, cache, i, kv_at)
        if logits_at is not None:
            if logits_at.shape[1] == 0:
                return h.new_empty(h.shape[0], 0, self.cfg.vocab_size)
            h = h.gather(1, logits_at.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
        return self.lm_head(self.model.norm(h))


def merge_embeddings(h: torch.Tensor, conf: torch.Tensor, embedding: nn.Module, mask_id: int) -> torch.Tensor:
    """DMax's soft input ("token merge", the authors' Diffulex `dmax_topk` with top-1 and renormalisation): a
    position with conf c < 1 enters as c E[token] + (1 - c) E[mask], rescaled to the norm c |E[token]| +
    (1 - c) |E[mask]|; c = 1 keeps E[token] exactly. Static shapes: a select over every position, no branch."""
    c = conf.unsqueeze(-1).float()
    tok = h.float()
    mask = embedding(conf.new_full((1,), mask_id, dtype=torch.long)).float()  # [1, H], broadcast
    soft = c * tok + (1 - c) * mask
    target = c * tok.norm(dim=-1, keepdim=True) + (1 - c) * mask.norm(dim=-1, keepdim=True)
    soft = soft * (target / soft.norm(dim=-1, keepdim=True).clamp_min(1e-12))
    return torch.where(c < 1, soft.to(h.dtype), h)


def self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, cache: KVCache | Segments | None,
                   layer: int, kv_at) -> torch.Tensor:
    """q [b,h,n,d], k/v [b,kvh,n,d]; with a cache, k/v are written at `kv_at` (the tokens' cache addresses; one
    per segment for Segments) and attention runs over the row."""
    if isinstance(cache, Segments):
        return _segmented_attention(q, k, v, cache, layer, kv_at)
    if cache is not None:
        cache.write(layer, k, v, kv_at)
        k, v = cache.read(layer)
    o = attend(q, k, v, mask)
    return o.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def _segmented_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segs: Segments, layer: int,
                         kv_at: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Flat [1, h, N, d] projections cut into each segment's [rows, h, width, d], attended against its cache."""
    outs, o = [], 0
    for s, where in zip(segs.parts, kv_at):
        n = s.rows * s.width
        q_s, k_s, v_s = (x[0, :, o:o + n].unflatten(1, (s.rows, s.width)).transpose(0, 1) for x in (q, k, v))
        outs.append(self_attention(q_s, k_s, v_s, s.mask, s.cache, layer, where).reshape(1, n, -1))
        o += n
    return torch.cat(outs, 1)
