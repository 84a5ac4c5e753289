"""How one forward's attention reads and writes keys: an object per forward that hands each layer its kernel.

A layer computes q, k, v and calls `attend(q, k, v)`; where those keys come from is the forward's business, and
each way the model runs is one class here:
- `Masked`: no cache (training, the no-cache reference): the input attends to itself under a mask.
- `Cached`: a `KVCache` view: the tokens' K/V are written at their cache addresses, then keys [0, span) of each
  row are read back (gathered through the page table, or viewed in place at home) under a dense or flex mask.
  Prefill and the dense (sdpa) decode step.
- `Paged`: the decode step's FlexAttention path: K/V are written into the page pool and attention runs over the
  pool itself, the BlockMask naming each row's pages (`masks.PagedDecodeMask`): no gather and no key span, so a
  step's shapes depend only on (batch rows, slots).
- `Packed`: the sdpa decode step: the resident slots of every decoding row packed end to end in one input, the
  K/V of those tokens alone written, attention per row over its own prefix and buffer.
- `Segmented`: several groups of rows in one flat input (a decode step carrying prompt chunks).

`layer(i)` returns layer i's `attend`. The objects a `Paged` forward hands out hold tensors and ints only (the
layer's pool pages, the addresses, the mask), never the layer index, so that one compiled decoder layer can serve
every layer (`mbd.decoding.compiled`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from torch.nn.attention.flex_attention import flex_attention

from mbd.model.cache import KVCache
from mbd.model.layers import attend as attend_masked

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # q [b,h,n,d], k/v [b,kvh,n,d] -> [b,n,h*d]


def _merge_heads(o: torch.Tensor) -> torch.Tensor:
    return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)


@dataclass(frozen=True)
class Masked:
    """Attention over the input itself (no cache) under `mask` (a dense bool mask or a FlexAttention BlockMask)."""

    mask: object

    def layer(self, i: int) -> Attend:
        return self

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _merge_heads(attend_masked(q, k, v, self.mask))


class Cached:
    """Tokens at `pos` [b, n] of the rows of `cache` (a view): K/V written at their addresses, keys [0, span) read
    back under `mask`."""

    def __init__(self, cache: KVCache, mask: object, pos: torch.Tensor):
        self.cache, self.mask = cache, mask
        self.kv_at = cache.address(pos)  # the same for every layer

    def layer(self, i: int) -> Attend:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.cache.write(i, k, v, self.kv_at)
            keys, values = self.cache.read(i)
            return _merge_heads(attend_masked(q, keys, values, self.mask))
        return attend


class Packed:
    """The tokens of `rows` rows packed end to end in one input [1, n]: the first `t = len(at)` are real (position
    `at[j]` of the rows' [rows, width] layout, at absolute `pos`), the rest padding. The linear layers run on the
    packed tokens only; each layer writes the K/V of the t real ones at their cache addresses (padding writes
    nothing), scatters their queries into the [rows, width] layout, attends per row over keys [0, span) of `cache`
    (a view of the rows) under the dense `mask` [rows, 1, width, span] (bool or additive), and gathers the real
    outputs back (padding's are zero). Query places the rows do not hold only cost attention, not the layers
    around it."""

    def __init__(self, cache: KVCache, mask: torch.Tensor, pos: torch.Tensor, at: torch.Tensor):
        self.cache, self.mask, self.at = cache, mask, at
        self.rows, self.width = pos.shape
        self.kv_at = cache.address(pos).index_select(0, at)  # the same for every layer

    def layer(self, i: int) -> Attend:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            t, n = self.at.numel(), q.shape[2]
            self.cache.write(i, k[:, :, :t], v[:, :, :t], self.kv_at)
            keys, values = self.cache.read(i)
            heads, d = q.shape[1], q.shape[3]
            laid = q.new_zeros(heads, self.rows * self.width, d).index_copy_(1, self.at, q[0, :, :t])
            o = attend_masked(laid.unflatten(1, (self.rows, self.width)).transpose(0, 1), keys, values, self.mask)
            real = _merge_heads(o).flatten(0, 1).index_select(0, self.at)
            return torch.nn.functional.pad(real, (0, 0, 0, n - t)).unsqueeze(0)
        return attend


@dataclass(frozen=True)
class PagedLayer:
    """One layer's view of a `Paged` forward: its K/V pool as [kv heads, pages x page, d] (flattened outside the
    compiled layer: inductor writes an input in place only when the layer does not reshape it first; a view taken
    inside would make it copy the whole pool back), the tokens' pool addresses and the BlockMask over the pool."""

    k_pool: torch.Tensor
    v_pool: torch.Tensor
    kv_at: torch.Tensor
    block_mask: object
    kernel_options: dict | None  # flex's tile sizes (CUDA)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k_pool[:, self.kv_at] = k.transpose(0, 1).flatten(1, 2)
        self.v_pool[:, self.kv_at] = v.transpose(0, 1).flatten(1, 2)
        o = flex_attention(q, self.k_pool.unsqueeze(0), self.v_pool.unsqueeze(0), block_mask=self.block_mask,
                        enable_gqa=q.shape[1] != k.shape[1], kernel_options=self.kernel_options)
        return _merge_heads(o)


class Paged:
    """A decode forward over the whole page pool of `cache`: tokens at `pos` [b, n] are written at their pool
    addresses and attend through `block_mask` (a `PagedDecodeMask` BlockMask over rows [0, b)). Eager, flex
    materialises the scores over the pool (the reference); inside a compiled layer it is inductor's fused kernel."""

    def __init__(self, cache: KVCache, pos: torch.Tensor, block_mask: object, kernel_options: dict | None = None):
        self.cache, self.block_mask, self.kernel_options = cache, block_mask, kernel_options
        self.kv_at = cache.address(pos)

    def layer(self, i: int) -> PagedLayer:
        return PagedLayer(self.cache.k[i].flatten(1, 2), self.cache.v[i].flatten(1, 2), self.kv_at, self.block_mask,
                          self.kernel_options)


@dataclass(frozen=True)
class Segmented:
    """Several groups of rows in one flat input [1, sum(rows * width)]: each part (`rows` x `width` tokens, a
    `Cached`, a `Packed` (one row of its packed tokens) or a `Paged`) attends against its own cache. The linear
    layers run once over all tokens, attention per part."""

    parts: tuple[tuple[int, int, "Cached | Packed | Paged"], ...]  # (rows, width, attention) in input order

    def layer(self, i: int) -> Attend:
        kernels = [(rows, width, part.layer(i)) for rows, width, part in self.parts]

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            outs, o = [], 0
            for rows, width, kernel in kernels:
                n = rows * width
                q_s, k_s, v_s = (x[0, :, o:o + n].unflatten(1, (rows, width)).transpose(0, 1) for x in (q, k, v))
                outs.append(kernel(q_s, k_s, v_s).reshape(1, n, -1))
                o += n
            return torch.cat(outs, 1)
        return attend
