"""Block-causal attention masks built from small per-token index tensors.

A query at absolute position p may see a key at position s iff s lies in the visible region of its
row (s < visible[b]) and block(s) <= block(p); every token also sees itself so that no softmax row is
empty (an empty row would turn into NaN and NaN * 0 still poisons other rows).
The dense boolean form is the reference (SDPA); `block_causal_block_mask` builds the same rule as a
FlexAttention mask_mod by index arithmetic, never materialising an L x L tensor.
"""

from __future__ import annotations

import torch


def block_causal_dense(q_pos: torch.Tensor, kv_len: int, visible: torch.Tensor, block_size: int) -> torch.Tensor:
    """Dense mask [b, 1, n, kv_len] for queries at `q_pos` [b, n] against keys at positions 0..kv_len-1."""
    kv = torch.arange(kv_len, device=q_pos.device)
    q = q_pos.unsqueeze(-1)
    m = (kv < visible.view(-1, 1, 1)) & (kv // block_size <= q // block_size)
    return (m | (kv == q)).unsqueeze(1)


def block_causal_block_mask(q_pos: torch.Tensor, kv_len: int, visible: torch.Tensor, block_size: int):
    """FlexAttention BlockMask equal to `block_causal_dense` (same arguments)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, n = q_pos.shape

    def mask_mod(bi, h, qi, ki):
        p = q_pos[bi, qi]
        return ((ki < visible[bi]) & (ki // block_size <= p // block_size)) | (ki == p)

    return create_block_mask(mask_mod, b, None, n, kv_len, device=q_pos.device)
