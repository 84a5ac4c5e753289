"""Block-causal attention masks built from small per-token index tensors.

A query at absolute position p may see a key at position s iff s lies in the visible region of its
row (s < visible[b]) and block(s) <= block(p); every token also sees itself so that no softmax row is
empty (an empty row would turn into NaN and NaN * 0 still poisons other rows).
The dense boolean form is the reference (SDPA); `decode_block_mask` builds the same rule as a FlexAttention
BlockMask from per-row key-block counts, never materialising an L x L tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlexMask:
    """A FlexAttention BlockMask and the torch.compile mode its kernel runs under ("off": eager flex, the
    reference; "default" / "max-autotune": one fused kernel per shape)."""

    block_mask: object
    compile: str = "default"


def block_causal_dense(q_pos: torch.Tensor, kv_len: int, visible: torch.Tensor, block_size: int) -> torch.Tensor:
    """Dense mask [b, 1, n, kv_len] for queries at `q_pos` [b, n] against keys at positions 0..kv_len-1."""
    kv = torch.arange(kv_len, device=q_pos.device)
    q = q_pos.unsqueeze(-1)
    m = (kv < visible.view(-1, 1, 1)) & (kv // block_size <= q // block_size)
    return (m | (kv == q)).unsqueeze(1)


def decode_block_mask(q_pos: torch.Tensor, committed: torch.Tensor, visible: torch.Tensor, kv_len: int,
                      block_size: int, kv_block: int = 128):
    """FlexAttention BlockMask equal to `block_causal_dense(q_pos, kv_len, visible, block_size)` for decode
    queries at committed[b] + arange(n) (a Block Buffer after a block-aligned committed prefix), built from
    per-row key-block counts with static shapes (CUDA Graph capturable, no `create_block_mask` pass): key
    blocks wholly inside the committed prefix are full (every query sees them), the blocks up to
    max(visible, committed + n) are evaluated by the mask_mod, and key blocks past that are skipped - they
    hold no visible key and no query's own position."""
    from torch.nn.attention.flex_attention import BlockMask

    b, n = q_pos.shape
    nk, nq = -(-kv_len // kv_block), -(-n // kv_block)
    end = torch.maximum(visible, committed + n)
    n_full = committed // kv_block
    n_part = torch.clamp(-(-end // kv_block), max=nk) - n_full
    idx = torch.arange(nk, device=q_pos.device, dtype=torch.int32)
    full_idx = idx.expand(b, 1, nq, nk)
    part_idx = torch.clamp(n_full.view(b, 1, 1, 1).to(torch.int32) + idx, max=nk - 1)

    def mask_mod(bi, h, qi, ki):
        p = q_pos[bi, qi]
        return ((ki < visible[bi]) & (ki // block_size <= p // block_size)) | (ki == p)

    def counts(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.int32).view(b, 1, 1).expand(b, 1, nq).contiguous()

    return BlockMask.from_kv_blocks(counts(n_part), part_idx.expand(b, 1, nq, nk).contiguous(), counts(n_full),
                                    full_idx.contiguous(), BLOCK_SIZE=kv_block, mask_mod=mask_mod,
                                    seq_lengths=(n, kv_len), compute_q_blocks=False)
