"""Group-Aware Dual-Stream Mask (paper eq:multitf_attention_mask, sec:appendix_group_aware_mask).

The input is X = [x_t ; x_0] of length 2L (noisy stream first, clean stream second, shared position
ids 0..L-1 in each stream). With beta(i) the block of token i, g(i) its noise-group and alpha(i) the
first block of that group:

    A = [[M_GD, M_GOC], [0, M_BC]]
    M_GD : noisy i -> noisy j  iff g(i) = g(j) and beta(j) <= beta(i)
    M_GOC: noisy i -> clean j  iff beta(j) < alpha(i)
    M_BC : clean i -> clean j  iff beta(j) <= beta(i)
    clean -> noisy: never.

Choices beyond the paper (prompt blocks and padding):
- A clean prompt block (group id -1) has a noisy-stream copy that is never noised. Those tokens carry
  no loss, and no other token attends to them (they are in no noise-group, so M_GD never selects them).
  They attend to the clean stream block-causally (clean j with beta(j) <= beta(i)), i.e. they behave
  as if they had alpha(i) = beta(i) + 1. Why: their outputs are then well defined (the clean context of
  their clean twins, plus themselves) at no extra cost, and one "horizon" rule keeps mask_mod branch-free.
- Padding (positions >= total_len: the batch padding of rows shorter than the batch; a row's own
  block-alignment pads are real, trained tokens, see `corrupt.py`) is never attended by a real token, and a pad token attends to nothing real.
- Every token attends to itself, so no softmax row is empty (SDPA would produce NaN there).

Two implementations that must agree exactly:
- `dense_reference(block_group, total_len, block_size)`: one sequence, [2L, 2L], built block by block
  from the definitions above (the test reference).
- `DualStreamIndex`: small per-token tensors (stream, block, group id, group-first-block horizon,
  valid) from which `mask_mod` computes each entry by index arithmetic. `block_mask` turns it into a
  FlexAttention BlockMask without materialising 2L x 2L; `dense_mask` evaluates the same rule on the
  full index grid for SDPA, [b, 1, 2L, 2L].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mbd.multitf.layouts import groups


def dual_stream_position_ids(length: int, batch: int = 1, device: torch.device | str | None = None) -> torch.Tensor:
    """Position ids [batch, 2L]: both streams reuse positions 0..L-1."""
    pos = torch.arange(length, device=device).repeat(2)
    return pos.unsqueeze(0).expand(batch, -1)


@dataclass(frozen=True)
class DualStreamIndex:
    """Per-token index tensors for a batch of dual-stream sequences (n = 2L tokens each).

    clean [n] (stream: False = noisy x_t, True = clean x_0), block [n] (beta), group [b, n] (noise-group
    id of noisy tokens; -1 for clean-stream tokens and for noisy copies of prompt/pad blocks),
    horizon [b, n] (noisy token sees clean blocks < horizon: alpha(i), or beta(i)+1 for prompt blocks),
    valid [b, n] (False for padding).
    """

    clean: torch.Tensor
    block: torch.Tensor
    group: torch.Tensor
    horizon: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def build(cls, block_group: torch.Tensor | np.ndarray, total_len: torch.Tensor | np.ndarray | list[int],
              block_size: int, device: torch.device | str | None = None) -> "DualStreamIndex":
        """From per-block group ids [b, K] (-1 = clean prompt or batch-padding block) and real lengths [b]."""
        bg = torch.as_tensor(np.asarray(block_group) if not torch.is_tensor(block_group) else block_group,
                             dtype=torch.long, device=device)
        if bg.dim() != 2:
            raise ValueError(f"block_group must be [batch, K], got shape {tuple(bg.shape)}")
        tl = torch.as_tensor(total_len, dtype=torch.long, device=bg.device).reshape(-1)
        b, k = bg.shape
        length = k * block_size
        if tl.numel() != b or bool((tl < 0).any()) or bool((tl > length).any()):
            raise ValueError(f"total_len must hold {b} values in 0..{length} (K * block_size), got {tl.tolist()}")
        blocks = torch.arange(k, device=bg.device)
        starts = torch.ones_like(bg, dtype=torch.bool)
        starts[:, 1:] = bg[:, 1:] != bg[:, :-1]
        first = torch.cummax(torch.where(starts, blocks, 0), dim=1).values
        horizon_blk = torch.where(bg >= 0, first, blocks + 1)

        def tokens(x: torch.Tensor) -> torch.Tensor:
            return x.repeat_interleave(block_size, dim=-1)

        pos = torch.arange(length, device=bg.device)
        valid = pos.unsqueeze(0) < tl.unsqueeze(1)
        return cls(
            clean=torch.arange(2 * length, device=bg.device) >= length,
            block=tokens(blocks).repeat(2),
            group=torch.cat([tokens(bg), torch.full_like(tokens(bg), -1)], dim=1),
            horizon=torch.cat([tokens(horizon_blk), torch.zeros_like(tokens(bg))], dim=1),
            valid=valid.repeat(1, 2),
        )

    @property
    def length(self) -> int:
        """2L, the dual-stream sequence length."""
        return self.block.numel()

    @property
    def mask_mod(self):
        """FlexAttention mask_mod(b, h, q_idx, kv_idx) (a plain function: flex inspects its arity)."""

        def mask_mod(b, h, q_idx, kv_idx):
            return self.allowed(b, q_idx, kv_idx)

        return mask_mod

    def allowed(self, b, q, kv):
        """True = query q may attend key kv; works on scalar indices and on broadcast index grids."""
        q_clean, kv_clean = self.clean[q], self.clean[kv]
        q_blk, kv_blk = self.block[q], self.block[kv]
        q_grp = self.group[b, q]
        gd = ~q_clean & ~kv_clean & (q_grp >= 0) & (q_grp == self.group[b, kv]) & (kv_blk <= q_blk)
        goc = ~q_clean & kv_clean & (kv_blk < self.horizon[b, q])
        bc = q_clean & kv_clean & (kv_blk <= q_blk)
        return (self.valid[b, q] & self.valid[b, kv] & (gd | goc | bc)) | (q == kv)

    def dense_mask(self) -> torch.Tensor:
        """The same rule on the full index grid: bool [b, 1, 2L, 2L] for SDPA (True = may attend)."""
        n = self.length
        dev = self.block.device
        bi = torch.arange(self.group.shape[0], device=dev).view(-1, 1, 1)
        idx = torch.arange(n, device=dev)
        return self.allowed(bi, idx.view(1, n, 1), idx.view(1, 1, n)).unsqueeze(1)

    def block_mask(self, flex_block_size: int = 128, compile: bool = False):
        """FlexAttention BlockMask of `mask_mod` (only the small index tensors are captured).

        Use compile=True at training lengths: eager create_block_mask evaluates mask_mod on the full grid
        through vmap and is no cheaper than `dense_mask` in time and costs more memory; compiled it is much faster
        (benchmarks/multitf_masks.py measures both; docs/performance.md).
        """
        from torch.nn.attention.flex_attention import create_block_mask

        n = self.length
        return create_block_mask(self.mask_mod, self.group.shape[0], None, n, n, device=self.block.device,
                                 BLOCK_SIZE=flex_block_size, _compile=compile)


def dense_reference(block_group: np.ndarray, total_len: int, block_size: int) -> torch.Tensor:
    """Straightforward [2L, 2L] mask of one sequence, assembled from M_GD, M_GOC, M_BC (see module doc)."""
    bg = np.asarray(block_group)
    length = bg.size * block_size
    beta = torch.arange(length) // block_size
    causal = beta.view(1, -1) <= beta.view(-1, 1)  # [i, j]: beta(j) <= beta(i)
    m_bc = causal.clone()
    m_gd = torch.zeros(length, length, dtype=torch.bool)
    m_goc = torch.zeros(length, length, dtype=torch.bool)
    for members in groups(bg):
        tok = torch.from_numpy(np.concatenate([np.arange(k * block_size, (k + 1) * block_size) for k in members]))
        m_gd[tok.view(-1, 1), tok.view(1, -1)] = causal[tok.view(-1, 1), tok.view(1, -1)]
        alpha = int(members[0])
        m_goc[tok] = (beta < alpha).unsqueeze(0)
    for k in np.flatnonzero(bg < 0):  # noisy copy of a clean prompt block: block-causal onto the clean stream
        rows = slice(k * block_size, (k + 1) * block_size)
        m_goc[rows] = (beta <= k).unsqueeze(0)
    top = torch.cat([m_gd, m_goc], dim=1)
    bottom = torch.cat([torch.zeros(length, length, dtype=torch.bool), m_bc], dim=1)
    mask = torch.cat([top, bottom], dim=0)
    real = (torch.arange(length) < total_len).repeat(2)
    mask &= real.view(-1, 1) & real.view(1, -1)
    return mask | torch.eye(2 * length, dtype=torch.bool)
