"""The forward pass shared by both families: embed -> decoder layers -> norm -> head.

One implementation serves training (mask over the whole input, no cache) and inference (queries are the
Block Buffer tokens, keys are the cached prefix of their row, which the forward also writes). How attention
reads and writes keys is the `attn` object's business (`mbd.model.attention`: Masked, Cached, Paged,
Segmented); a layer only calls the kernel it is handed. At inference the head runs only on the positions whose
logits are read (`logits_at`): a decode step needs them for its ACTIVE slots only, a prefill for none, and the
LM head plus the policy's vocabulary softmax is a large part of a small model's step. How each layer is called is
the caller's (`call`): the engine's compiled decode forward (`mbd.decoding.compiled`) passes `call_layer` compiled.

A layer takes and returns (x, residual): its output x is added to the residual stream by the next layer (the
final norm after the last), in the same kernel as that layer's input RMSNorm, so a compiled layer does not launch
a kernel for its closing residual add (vLLM's fused add + RMSNorm). The sums are the same additions in the same
order as `h = h + mlp(...)`, so the values are bit for bit those of the plain layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mbd.config import ModelConfig
from mbd.model.layers import rope_cos_sin
from mbd.model.tp import TPGroup

Hidden = tuple[torch.Tensor, torch.Tensor]  # (a layer's output x, the residual stream before it is added)
LayerCall = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Callable], Hidden]


def call_layer(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               attend) -> Hidden:
    """Decoder layer `layer` on (x, residual): the unit that `mbd.decoding.compiled` compiles (one graph serves
    every layer)."""
    return layer(x, residual, cos, sin, attend)


class CausalLMBase(nn.Module):
    """Subclasses define `self.model` (with `embedding`, `layers`, `norm`) and `self.lm_head`."""

    cfg: ModelConfig
    tp: TPGroup

    def tie_weights(self) -> None:
        """Share the LM head with the input embedding when the config says so (TP=1 only: under TP the
        head is a vocab shard and is loaded from the embedding tensor instead)."""
        if self.cfg.tie_word_embeddings and self.tp.world == 1:
            self.lm_head.weight = self.model.embedding.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn,
                logits_at: torch.Tensor | None = None, token_conf: torch.Tensor | None = None,
                call: LayerCall = call_layer) -> torch.Tensor:
        """Logits [b, n, V]; with `logits_at` (an index [b, m] into the n positions) only those [b, m, V]
        (m = 0: the head does not run). attn: how attention runs (`mbd.model.attention`). token_conf [b, n]:
        DMax's token merge (`merge_embeddings`). call: how each decoder layer is called."""
        h = self.model.embedding(input_ids)
        if token_conf is not None:
            h = merge_embeddings(h, token_conf, self.model.embedding, self.cfg.mask_token_id)
        cos, sin = rope_cos_sin(position_ids, self.cfg.rotary_dim, self.cfg.rope_theta, h.dtype)
        x, residual = h, torch.zeros_like(h)
        for i, layer in enumerate(self.model.layers):
            x, residual = call(layer, x, residual, cos, sin, attn.layer(i))
        if logits_at is not None:
            if logits_at.shape[1] == 0:
                return h.new_empty(h.shape[0], 0, self.cfg.vocab_size)
            at = logits_at.unsqueeze(-1).expand(-1, -1, h.shape[-1])
            x, residual = x.gather(1, at), residual.gather(1, at)
        return self.lm_head(self.model.norm(residual + x))


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
