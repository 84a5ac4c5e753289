"""Static prefix KV cache, one row per request slot.

Shapes never change after allocation, so a decode step can be captured as a CUDA Graph. Every forward
that is given the cache scatters the K/V of its tokens into their absolute positions; positions at or past
`lengths[row]` are scratch that attention only sees through the caller's mask. `commit(rows, n)` makes the
next n positions of a row part of the immutable prefix: the K/V there were written by the forward in which
those tokens were final (the TO_CACHE step), which is the paper's decode-store overlap. The cache holds
`max_len + margin` positions so that a full Block Buffer past the last committed token always fits.
A view may also cap the key span that `read` returns (`view(..., span=L)`): attention then costs what the live
prefix needs, not what the allocation holds; writes still land at absolute positions < span.
"""

from __future__ import annotations

import torch

from mbd.config import ModelConfig
from mbd.model.tp import SINGLE, TPGroup


class KVCache:
    def __init__(self, cfg: ModelConfig, rows: int, max_len: int, margin: int = 0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", tp: TPGroup = SINGLE):
        heads = tp.split(cfg.num_key_value_heads, "num_key_value_heads")
        self.size = max_len + margin
        self.span = self.size  # keys [0, span) are what `read` returns
        self.max_len = max_len
        shape = (cfg.num_hidden_layers, rows, heads, self.size, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)

    def view(self, start: int, stop: int, span: int | None = None) -> "KVCache":
        """A cache over rows [start, stop) sharing storage (writes and commits land in this cache) whose
        `read` returns keys [0, span) only: a smaller batch bucket runs against the front rows, and a short
        live prefix against a short key range, without copying."""
        span = self.size if span is None else span
        if not 0 < span <= self.size:
            raise ValueError(f"span={span} must be in (0, {self.size}]")
        v = KVCache.__new__(KVCache)
        v.k, v.v, v.lengths = self.k[:, start:stop], self.v[:, start:stop], self.lengths[start:stop]
        v.size, v.span, v.max_len = self.size, span, self.max_len
        return v

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Scatter k/v [b, kvh, n, d] of every row (in order) to absolute positions pos [b, n]."""
        idx = pos.clamp(max=self.size - 1).view(pos.shape[0], 1, -1, 1).expand(-1, k.shape[1], -1, k.shape[3])
        self.k[layer].scatter_(2, idx, k)
        self.v[layer].scatter_(2, idx, v)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [b, kvh, span, d] of every row: the key range a mask over `span` keys addresses."""
        k, v = self.k[layer], self.v[layer]
        if self.span == self.size:
            return k, v
        return k[:, :, : self.span], v[:, :, : self.span]

    def nbytes(self) -> int:
        """Bytes allocated for K and V (all rows, all positions)."""
        return self.k.nbytes + self.v.nbytes

    def commit(self, rows: torch.Tensor, n: torch.Tensor | int) -> None:
        """Extend the committed prefix of `rows` by n tokens (their K/V are already in place)."""
        self.lengths[rows] += n

    def reset(self, rows: torch.Tensor | int) -> None:
        self.lengths[rows] = 0
