"""Model runner: prefill, and the static-shape Block Buffer forward (a CUDA Graph per bucket on GPU, one pool).

`run(batch)` is the model half of an engine step (`Engine.step` = schedule -> run -> postprocess): it makes the
device's slot states and committed lengths match the batch's row layout (derived from the requests, uploaded
only when they changed), runs the forward, applies the policy's token update and returns one `RowOutput` per
decoding row from the step's single device-to-host copy.

Every decode step is ONE forward over input ids [bucket, N_buf * B] at positions cache.lengths + arange,
against the paged KV cache (read and written through each row's page table, whose contents the cache manager
changes in place; unmapped positions go to a scratch page). The forward scatters all buffer tokens' K/V into the
cache (scratch beyond the committed length); the mask `block_causal_dense(pos, span, lengths + n_resident * B, B)` lets a
real token see the committed prefix and the resident slots up to its own block, and makes DUMMY slots
invisible (a dummy token sees the visible region and itself, never another dummy: no empty softmax row,
no NaN; its output is ignored and its scratch K/V are rewritten before anyone may read them). Positions and
mask change only when committed lengths or resident slots do, so eager mode rebuilds them only then.
A TO_CACHE slot is still resident, so its final
tokens are re-run and their K/V land in the cache in the same forward that decodes the later slots
(decode-store overlap); the caller then commits them.

Buckets keep shapes static but small. Batch: the forward runs the first `bucket` rows, the smallest bucket
covering every occupied row (the scheduler admits into the lowest free row). Slots: it runs the first k
slots of each row, k = the most resident slots of any row (resident slots are a row prefix, so only DUMMY
slots are skipped). Span: attention reads keys [0, span) only, span = the longest row's committed length
+ k * B rounded up by `span_bucket` (so every token's own key is inside), never the whole
`max_len + margin` allocation: a step costs what the live prefix and the live blocks cost. Within a
(batch, slots, span, active) bucket the shapes never change, so on CUDA the forward is captured once per
bucket and replayed; on CPU it runs eagerly through the same function.
Masks come from small index tensors: a dense [b, 1, Q, span] bool mask for SDPA (the reference), or a
FlexAttention BlockMask whose per-row key-block counts stop at the row's last visible key (`attention: flex`,
its kernel compiled with `EngineConfig.compile`).

Logits: only ACTIVE slots' logits are ever read, so the head (and the policy's vocabulary softmax) runs on a
window of `active` slots per row (`window`; active = the most ACTIVE slots of any row, one more bucket axis):
TO_CACHE slots being stored and DUMMY slots get none unless they pad a row with fewer ACTIVE slots, and a
forward whose rows only store (SingleBD's store forward) runs no head at all; neither does a prefill.
Chunked prefill: prompt chunks of other rows ride in the decode forward (`_fused`): one pass over the weights
for all tokens, attention per segment (eager; on GPU such steps are not graph-captured).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Sequence

import torch
from torch import nn

from mbd.config import ConfigError, EngineConfig
from mbd.decoding.batch import DecodeBatch, PrefillChunk, RowOutput
from mbd.decoding.guided import Guide, RowFix
from mbd.decoding.policy import Policy
from mbd.decoding.state import FREE_ROW, BatchBuffers, RowLayout, SlotState
from mbd.model import KVCache
from mbd.model.base import Segment, Segments
from mbd.model.cache import default_page_size
from mbd.model.masks import FlexMask, decode_block_mask
from mbd.model.tp import SINGLE

SPAN_MIN = 64  # spans are multiples of 64 up to 4 * SPAN_MIN, then four per octave


def span_bucket(need: int, size: int) -> int:
    """The key span for a forward that needs keys [0, need): at most 25% more (64 more below 256), from a
    set of O(log size) values (one CUDA Graph each), capped at the cache size."""
    step = max(SPAN_MIN, (1 << (max(need, 1).bit_length() - 1)) // 4)
    return min(size, -(-need // step) * step)


def graph_capturable(model: nn.Module) -> bool:
    """MoE routing dispatches tokens with `nonzero` (a host sync), which CUDA Graph capture forbids."""
    from mbd.model.llada2_moe import LLaDA2SparseMoE

    return not any(isinstance(m, LLaDA2SparseMoE) for m in model.modules())


def use_cuda_graphs(model: nn.Module, mode: str, device: torch.device) -> bool:
    """`EngineConfig.cuda_graphs` on this device: auto = on cuda; a model that cannot be captured runs eagerly."""
    want = mode == "on" or (mode == "auto" and device.type == "cuda")
    if want and not graph_capturable(model):
        warnings.warn("CUDA Graphs disabled: this model's MoE routing is not capturable; running eagerly")
        return False
    return want


def allocate_cache(model: nn.Module, rows: int, max_len: int, margin: int, engine: EngineConfig,
                   device: torch.device) -> KVCache:
    """The paged KV pool: `engine.kv_cache_bytes` worth of pages, or (None) room for every row at max_len."""
    cfg, tp = model.cfg, getattr(model, "tp", SINGLE)
    dtype = next(model.parameters()).dtype
    page = engine.page_size or default_page_size(cfg.block_size)
    if engine.kv_cache_bytes is None:
        pages = 1 + rows * -(-(max_len + margin) // page)
    else:
        pages = engine.kv_cache_bytes // KVCache.page_bytes(cfg, page, dtype, tp)
        if pages < 2:
            raise ValueError(f"kv_cache_bytes={engine.kv_cache_bytes} holds {pages} pages of {page} tokens; the "
                             f"pool needs at least 2 ({2 * KVCache.page_bytes(cfg, page, dtype, tp)} bytes)")
    return KVCache(cfg, rows, max_len, margin=margin, dtype=dtype, device=device, tp=tp, page_size=page,
                   num_pages=pages)


class ModelRunner:
    """Runs the model for the engine: prefill, and `run(batch)` = upload the batch's row layout when it changed,
    one decode forward, the policy's token update, the Block Buffers' slide past committed slots and the step's
    one device-to-host copy, unpacked into a `RowOutput` per decoding row."""

    def __init__(self, model: nn.Module, buf: BatchBuffers, policy: Policy, engine: EngineConfig, max_len: int):
        """max_len: positions a row may reach (the KV cache adds a full Block Buffer of margin)."""
        self.model, self.buf, self.policy, self.block = model, buf, policy, buf.block
        self.attention, self.compile = engine.attention, engine.compile
        rows, self.q = buf.tokens.shape
        dev = buf.tokens.device
        if self.attention == "flex" and self.compile != "off" and next(model.parameters()).dtype == torch.float64:
            raise ConfigError("attention: flex with compile: " + self.compile + " needs float32/bfloat16/float16 "
                              "weights (inductor's FlexAttention rejects float64); use compile: off for the eager kernel")
        self.cache = allocate_cache(model, rows, max_len, self.q, engine, dev)
        self._views: dict[tuple[int, int, bool], KVCache] = {}
        self._arange_q = torch.arange(self.q, device=dev)
        self._kv = torch.arange(self.cache.size, device=dev)
        self._kv_block = self._kv // self.block
        self.prefill_chunk = max(self.block, engine.prefill_chunk // self.block * self.block)
        self.use_graphs = use_cuda_graphs(model, engine.cuda_graphs, dev)
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None  # every bucket's graph shares it
        self._logits: torch.Tensor | None = None  # and writes its logits into this buffer (`_capture`)
        self._graphs: dict[tuple[int, int, int, int, bool], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._inputs: dict[tuple[int, int, int], tuple[torch.Tensor, object]] = {}  # eager: (positions, mask)
        self._uploaded = [FREE_ROW] * rows  # what the device's slot states and committed lengths hold
        self.shapes: Counter[tuple[int, int, int]] = Counter()  # (batch, Q, span) of every decode forward
        self.guide: Guide | None = None  # structured output (the engine sets it with the first grammar)

    def run(self, batch: DecodeBatch) -> dict[int, RowOutput]:
        """One decode step of `batch`: forward, the policy's update, tokens stored back (TO_CACHE slots popped),
        and the step's single device -> host copy, unpacked per decoding row (keyed by row)."""
        self.sync(batch.layout)
        b, S, A, B = batch.rows, batch.slots, batch.active, self.block
        span = self.span(batch.max_committed, S)
        logits, idx = self.forward(b, S, span, A, batch.chunks, batch.home)
        buf, Q = self.buf, S * B
        tokens, parts, conf, tops = buf.tokens[:b, :Q], [], None, None
        merge = buf.token_conf[:b, :Q].clone() if self.policy.token_merge else None
        guided = bool(A) and batch.guided and self.guide is not None
        rows = [(r.row, r) for r in batch.requests]
        if A:
            fixed = None
            if guided:  # grammar frontiers: masked logits there, nothing accepted before it revised
                fixed = self.guide.before(rows, logits, self.positions(b, S).gather(1, idx),
                                          _window_starts(batch, b), buf.prompt_len[:b])
            elif batch.fixed:  # a prompt tail is still in a buffer
                fixed = self.positions(b, S).gather(1, idx) < buf.prompt_len[:b, None]
            dec = self.policy.update(logits, tokens.gather(1, idx), buf.state[:b].gather(1, idx[:, ::B] // B),
                                     buf.tau_m2t[:b], buf.semi_max_masked[:b], fixed,
                                     buf.tau_t2t[:b] if batch.t2t else None, batch.samplers)
            updated = tokens.scatter(1, idx, dec.tokens)
            if batch.logprobs:  # the probability each token was accepted (or last revised) with, where it changed
                full = torch.full(tokens.shape, -1.0, device=tokens.device).scatter(1, idx, dec.conf.float())
                conf = torch.where(updated != tokens, full, -1.0).tolist()
                tops = top_logprobs(logits, idx, batch)
            if merge is not None:  # DMax token merge: a token M2T filled in this step enters the next forward soft
                filled = (tokens.gather(1, idx) == buf.mask_id) & (dec.tokens != buf.mask_id)
                merge = merge.scatter(1, idx, torch.where(filled, dec.conf.float(), 1.0))
            parts = [dec.masked_in, dec.accepted] + ([dec.revised] if batch.t2t else []) + ([tokens] if guided else [])
            tokens = updated  # (the tokens before the decision ride along for the grammar's recount)
        old_at = Q + A * (len(parts) - 1)
        if batch.trace:
            parts.append(buf.state[:b])  # forward-time states
        summary = torch.cat([tokens, *parts], 1).tolist()  # the step's single device -> host transfer
        fixes = self.guide.after(rows, summary, old_at, S, tokens) if guided else {}
        buf.store_tokens(tokens, [lay.n_tc for lay in batch.layout], merge)  # re-run TO_CACHE slots are committed: pop
        return {req.row: self._unpack(summary[req.row], conf and conf[req.row], req.n_tc, batch, fixes.get(req.row),
                                      tops and tops[req.row]) for req in batch.requests}

    def _unpack(self, s: list[int], conf: list[float] | None, n_tc: int, batch: DecodeBatch, fix: RowFix | None = None,
                top: list | None = None) -> RowOutput:
        """A row of the step's summary [tokens (Q) | masked (A) | accepted (A) | revised (A)? | states (n_buf)?]
        as per-slot lists over the `slots` run: the window [lo, lo + A) from the device, TO_CACHE before it,
        all-mask DUMMY after it."""
        S, A, B = batch.slots, batch.active, self.block
        Q, lo = S * B, min(n_tc, S - A)
        pad = S - lo - A

        def per_slot(k: int, fill: int) -> list[int]:
            return [0] * lo + s[Q + k * A: Q + (k + 1) * A] + [fill] * pad

        return RowOutput(s[:Q], per_slot(0, B), per_slot(1, 0), per_slot(2, 0) if batch.t2t else None,
                         s[-self.buf.n_buf:] if batch.trace else None, conf, fix, top)

    def sync(self, layout: list[RowLayout]) -> None:
        """Make the device's slot states and committed lengths of rows [0, len(layout)) those of `layout` (one
        copy, only when something changed); positions and masks are rebuilt when lengths or resident slots
        moved."""
        b = len(layout)
        old = self._uploaded[:b]
        if layout == old:
            return
        self.buf.upload(layout, self.cache.lengths)
        if any(n.committed != o.committed or n.n_res != o.n_res for n, o in zip(layout, old)):
            self._inputs.clear()
        self._uploaded[:b] = layout

    def span(self, max_committed: int, slots: int) -> int:
        """Key span of a forward of `slots` slots whose longest row has `max_committed` committed tokens."""
        return span_bucket(max_committed + slots * self.block, self.cache.size)

    def view(self, b: int, span: int, home: bool = False) -> KVCache:
        key = (b, span, home)
        if key not in self._views:
            self._views[key] = self.cache.view(0, b, span, at_home=home)
        return self._views[key]

    def positions(self, b: int, slots: int) -> torch.Tensor:
        return self.cache.lengths[:b, None] + self._arange_q[: slots * self.block]

    def forward(self, b: int, slots: int, span: int, active: int, chunks: Sequence[PrefillChunk] = (),
                home: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [b, active * B, V], window [b, active * B]) of the first `slots` Block Buffer slots of rows
        [0, b) against keys [0, span) (`span(...)`): logits only for each row's window of `active` slots
        starting at its first ACTIVE slot (`window`: positions in the row's buffer; static outputs under
        graphs). `chunks`: prompt chunks of other rows computed in the same forward (eager). home: rows
        [0, b) map only their home pages (`CacheManager.at_home`), so keys are read without a gather."""
        key = (b, slots, span, active, home)
        self.shapes[(b, slots * self.block, span)] += 1
        if chunks:
            return self._fused(key, chunks)
        if not self.use_graphs:
            return self._step(*key, cached=True)
        if key not in self._graphs:
            self._graphs[key] = self._capture(*key)
        graph, out = self._graphs[key]
        graph.replay()
        return out

    def window(self, b: int, slots: int, active: int) -> torch.Tensor:
        """Buffer positions [b, active * B] of slots [start, start + active), start = the row's TO_CACHE count
        capped at slots - active: they cover every ACTIVE slot of a row with <= active of them (TO_CACHE slots
        are a prefix, DUMMY slots a suffix of the resident ones), so only padding is not ACTIVE."""
        n_tc = (self.buf.state[:b, :slots] == SlotState.TO_CACHE).sum(1)
        start = n_tc.clamp(max=slots - active)
        return start[:, None] * self.block + self._arange_q[: active * self.block]

    def _positions_and_mask(self, b: int, slots: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = self.cache.lengths[:b]
        pos = self.positions(b, slots)
        visible = lengths + (self.buf.state[:b] != SlotState.DUMMY).sum(1) * self.block
        if self.attention == "flex":
            return pos, FlexMask(decode_block_mask(pos, lengths, visible, span, self.block), self.compile)
        return pos, self.mask(pos, visible, span)

    def mask(self, pos: torch.Tensor, visible: torch.Tensor, span: int) -> torch.Tensor:
        """`block_causal_dense(pos, span, visible, B)` (same rule, asserted equal in the tests) from
        precomputed key indices: fewer ops, which is what a step costs on CPU."""
        kv, kv_block = self._kv[:span], self._kv_block[:span]
        pos = pos.unsqueeze(-1)
        m = (kv_block <= pos // self.block) & (kv < visible.view(-1, 1, 1))
        return (m | (kv == pos)).unsqueeze(1)

    def _step(self, b: int, slots: int, span: int, active: int, home: bool,
              cached: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if not cached:
            pos, mask = self._positions_and_mask(b, slots, span)
        else:  # most steps change neither lengths nor resident slots: reuse
            if (b, slots, span) not in self._inputs:
                self._inputs[(b, slots, span)] = self._positions_and_mask(b, slots, span)
            pos, mask = self._inputs[(b, slots, span)]
        idx = self.window(b, slots, active)
        Q = slots * self.block
        logits = self.model(self.buf.tokens[:b, :Q], pos, mask, cache=self.view(b, span, home), logits_at=idx,
                            token_conf=self.buf.token_conf[:b, :Q] if self.policy.token_merge else None)
        return logits, idx

    def _fused(self, key: tuple[int, int, int, int, bool],
               chunks: Sequence[PrefillChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step and prompt chunks of other rows in ONE forward (chunked prefill): the linear layers
        (the weights) are read once for all tokens, attention runs per segment. A prefilling row inside the
        decode bucket is all DUMMY there; its chunk segment comes after the decode segment, so the chunk's
        K/V overwrite that row's scratch K/V at the same positions. The caller commits the chunks."""
        b, slots, span, active, home = key
        Q = slots * self.block
        if key[:3] not in self._inputs:
            self._inputs[key[:3]] = self._positions_and_mask(b, slots, span)
        pos, mask = self._inputs[key[:3]]
        parts = [Segment(b, Q, self.view(b, span, home), mask, pos)]
        ids, all_pos = [self.buf.tokens[:b, :Q].reshape(1, -1)], [pos.reshape(1, -1)]
        dev = pos.device
        for c in chunks:
            end = c.start + len(c.ids)
            cpos = torch.arange(c.start, end, device=dev)[None]
            cmask = self.mask(cpos, torch.tensor([end], device=dev), end)
            parts.append(Segment(1, len(c.ids), self.cache.view(c.row, c.row + 1, end), cmask, cpos))
            ids.append(torch.tensor(c.ids, device=dev)[None])
            all_pos.append(cpos)
        idx = self.window(b, slots, active)
        flat_idx = (torch.arange(b, device=dev)[:, None] * Q + idx).view(1, -1)
        merge = None
        if self.policy.token_merge:  # prompt chunks enter as their tokens
            merge = torch.cat([self.buf.token_conf[:b, :Q].reshape(1, -1)] + [torch.ones_like(i, dtype=torch.float)
                                                                             for i in ids[1:]], 1)
        logits = self.model(torch.cat(ids, 1), torch.cat(all_pos, 1), None, cache=Segments(tuple(parts)),
                            logits_at=flat_idx, token_conf=merge)
        return logits.view(b, active * self.block, logits.shape[-1]), idx

    def _capture(self, b: int, slots: int, span: int, active: int,
                 home: bool) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]:
        # Warm-up runs only rewrite scratch K/V (positions >= lengths), which every forward rewrites anyway.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                logits, _ = self._step(b, slots, span, active, home)
        torch.cuda.current_stream().wait_stream(side)
        if self._logits is None:  # [rows, Q, V]: every graph's logits land in a view of this one buffer
            self._logits = logits.new_empty(self.buf.tokens.shape + logits.shape[-1:])
        # One memory pool and one logits buffer for every bucket, so graphs cost the largest forward plus one
        # batch of logits instead of the sum of every bucket's forward and logits (terabytes for SDAR-8B's 2,520
        # buckets: docs/gpu.md). Safe because graphs replay one at a time on one stream and each step consumes its
        # logits (the policy's update, the one device-to-host copy) before the next forward: a later capture may
        # reuse an earlier one's scratch, never memory still referenced (the buffer, each graph's window).
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, idx = self._step(b, slots, span, active, home)
            out = self._logits[:b, : logits.shape[1]]
            out.copy_(logits)
        return graph, (out, idx)

    def prefill(self, row: int, ids: list[int], start: int = 0) -> None:
        """Run prompt tokens `ids` (block-aligned, placed at `start`, after the committed [0, start) of cache row
        `row`) through the model and commit them, in chunks that each see the committed ones and themselves
        block-causally. No logits: the head does not run. The caller owns the committed length."""
        if not ids:
            return
        dev = self.cache.lengths.device
        all_ids = torch.tensor(ids, device=dev)[None]
        none = torch.zeros(1, 0, dtype=torch.long, device=dev)
        for off in range(0, len(ids), self.prefill_chunk):
            chunk = all_ids[:, off:off + self.prefill_chunk]
            a, n = start + off, chunk.shape[1]
            pos = torch.arange(a, a + n, device=dev)[None]
            mask = self.mask(pos, torch.tensor([a + n], device=dev), a + n)
            self.model(chunk, pos, mask, cache=self.cache.view(row, row + 1, a + n), logits_at=none)


def _window_starts(batch: DecodeBatch, b: int) -> list[int]:
    """Each row's first logits-window slot (`ModelRunner.window`), on the host."""
    lo = [0] * b
    for r in batch.requests:
        lo[r.row] = min(r.n_tc, batch.slots - batch.active)
    return lo


def top_logprobs(logits: torch.Tensor, idx: torch.Tensor, batch: DecodeBatch) -> list[list] | None:
    """Per row: (buffer position, top-k (id, logprob)) of every logits-window position, for rows asking for
    top_logprobs: of the distribution the step accepted from (the model's softmax with the mask token excluded
    and a grammar's mask applied; a sampled row's tempered, top-k / top-p one). None when no row asks."""
    k = max((r.params.top_logprobs for r in batch.requests if r.top_logprobs is not None), default=0)
    if not k:
        return None
    lp = logits.float().log_softmax(-1)
    for s in batch.samplers:
        lp[s.row] = s.probs(logits[s.row]).log()
    vals, ids = lp.topk(k, -1)
    return [list(zip(pos, ([list(zip(i, v)) for i, v in zip(ri, rv)])))
            for pos, ri, rv in zip(idx.tolist(), ids.tolist(), vals.tolist())]
