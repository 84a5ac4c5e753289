"""Model runner: prefill, and the static-shape Block Buffer forward (CUDA Graph per batch bucket on GPU).

Every decode step is ONE forward over input ids [bucket, N_buf * B] at positions cache.lengths + arange,
against the static KV cache. The forward scatters all buffer tokens' K/V into the cache (scratch beyond
the committed length); the mask `block_causal_dense(pos, cache.size, lengths + n_resident * B, B)` lets a
real token see the committed prefix and the resident slots up to its own block, and makes DUMMY slots
invisible (a dummy token sees the visible region and itself, never another dummy: no empty softmax row,
no NaN; its output is ignored and its scratch K/V are rewritten before anyone may read them). Positions and
mask change only when committed lengths or resident slots do, so eager mode rebuilds them only then.
A TO_CACHE slot is still resident, so its final
tokens are re-run and their K/V land in the cache in the same forward that decodes the later slots
(decode-store overlap); the caller then commits them.

Batch buckets: the forward runs the first `bucket` rows, the smallest bucket covering every occupied row
(the scheduler admits into the lowest free row). Within a bucket the shapes never change, so on CUDA the
forward is captured once per bucket and replayed; on CPU it runs eagerly through the same function.
"""

from __future__ import annotations

import warnings
from collections import Counter

import torch
from torch import nn

from mbd.config import ModelConfig
from mbd.decoding.state import BatchBuffers, SlotState
from mbd.model import KVCache
from mbd.model.tp import SINGLE


def graph_capturable(model: nn.Module) -> bool:
    """MoE routing dispatches tokens with `nonzero` (a host sync), which CUDA Graph capture forbids."""
    from mbd.model.llada2_moe import LLaDA2SparseMoE

    return not any(isinstance(m, LLaDA2SparseMoE) for m in model.modules())


class ModelRunner:
    def __init__(self, model: nn.Module, cfg: ModelConfig, buf: BatchBuffers, max_len: int,
                 buckets: tuple[int, ...], use_graphs: bool, prefill_chunk: int = 512):
        self.model, self.buf, self.block = model, buf, buf.block
        rows, self.q = buf.tokens.shape
        dev = buf.tokens.device
        dtype = next(model.parameters()).dtype
        self.cache = KVCache(cfg, rows, max_len, margin=self.q, dtype=dtype, device=dev, tp=getattr(model, "tp", SINGLE))
        self.buckets = tuple(sorted(set(buckets)))
        if self.buckets[-1] != rows:
            raise ValueError(f"batch_buckets {buckets} must include max_batch_slots={rows}")
        self._views = {b: (self.cache if b == rows else self.cache.view(0, b)) for b in self.buckets}
        self._bucket_of = [next(b for b in self.buckets if b >= n) for n in range(rows + 1)]
        self._arange_q = torch.arange(self.q, device=dev)
        self._kv = torch.arange(self.cache.size, device=dev)
        self._kv_block = self._kv // self.block
        self.prefill_chunk = max(self.block, prefill_chunk // self.block * self.block)
        if use_graphs and not graph_capturable(model):
            warnings.warn("CUDA Graphs disabled: this model's MoE routing is not capturable; running eagerly")
            use_graphs = False
        self.use_graphs = use_graphs
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # eager: bucket -> (positions, mask)
        self.shapes: Counter[tuple[int, int]] = Counter()  # input shape of every decode forward

    def bucket(self, rows_needed: int) -> int:
        return self._bucket_of[rows_needed]

    def positions(self, b: int) -> torch.Tensor:
        return self.cache.lengths[:b, None] + self._arange_q

    def invalidate(self) -> None:
        """Committed lengths or resident slots changed: positions and masks must be rebuilt."""
        self._inputs.clear()

    def forward(self, b: int) -> torch.Tensor:
        """Logits [b, Q, V] of the Block Buffers of rows [0, b) (a static output buffer under graphs)."""
        self.shapes[(b, self.q)] += 1
        if not self.use_graphs:
            if b not in self._inputs:  # most steps change neither lengths nor resident slots: reuse
                self._inputs[b] = self._positions_and_mask(b)
            pos, mask = self._inputs[b]
            return self.model(self.buf.tokens[:b], pos, mask, cache=self._views[b])
        if b not in self._graphs:
            self._graphs[b] = self._capture(b)
        graph, out = self._graphs[b]
        graph.replay()
        return out

    def _positions_and_mask(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = self.cache.lengths[:b]
        pos = lengths[:, None] + self._arange_q
        visible = lengths + (self.buf.state[:b] != SlotState.DUMMY).sum(1) * self.block
        return pos, self.mask(pos, visible)

    def mask(self, pos: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """`block_causal_dense(pos, cache.size, visible, B)` (same rule, asserted equal in the tests) from
        precomputed key indices: fewer ops, which is what a step costs on CPU."""
        pos = pos.unsqueeze(-1)
        m = (self._kv_block <= pos // self.block) & (self._kv < visible.view(-1, 1, 1))
        return (m | (self._kv == pos)).unsqueeze(1)

    def _step(self, b: int) -> torch.Tensor:
        pos, mask = self._positions_and_mask(b)
        return self.model(self.buf.tokens[:b], pos, mask, cache=self._views[b])

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm-up runs only rewrite scratch K/V (positions >= lengths), which every forward rewrites anyway.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(b)
        torch.cuda.current_stream().wait_stream(side)
        # Each bucket gets its own memory pool: buckets are captured lazily in any order and replayed in any
        # order, so a shared pool could hand one graph's static output to another graph's scratch.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._step(b)
        return graph, out

    def prefill(self, row: int, ids: list[int]) -> None:
        """Run the block-aligned prompt part through the model into cache row `row` and commit it
        (chunked: each chunk sees the committed chunks and itself block-causally)."""
        self.invalidate()
        self.cache.reset(row)
        if not ids:
            return
        view = self.cache.view(row, row + 1)
        dev = self.cache.lengths.device
        all_ids = torch.tensor(ids, device=dev)[None]
        for start in range(0, len(ids), self.prefill_chunk):
            chunk = all_ids[:, start:start + self.prefill_chunk]
            n = chunk.shape[1]
            pos = torch.arange(start, start + n, device=dev)[None]
            mask = self.mask(pos, torch.tensor([start + n], device=dev))
            self.model(chunk, pos, mask, cache=view)
            self.cache.commit(row, n)
