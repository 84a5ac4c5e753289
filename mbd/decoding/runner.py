"""Model runner: prefill, and the Block Buffer forward (compiled and CUDA-Graph captured on GPU).

`run(batch)` is the model half of an engine step (`Engine.step` = schedule -> run -> postprocess): it makes the
device's slot states and committed lengths match the batch's row layout (derived from the requests, uploaded
only when they changed), runs the forward, applies the policy's token update and returns one `RowOutput` per
decoding row from the step's single device-to-host copy (`StepSummary`: fields by name).

Every decode step is ONE forward over the Block Buffer tokens of the decoding rows at positions cache.lengths +
arange, against the paged KV cache: the forward writes its tokens' K/V at their positions (through the row's page
table; unmapped positions go to a scratch page) and attends block-causally: a real token sees the committed
prefix and the resident slots up to its own block, DUMMY slots are invisible. A TO_CACHE slot is still
resident, so its final tokens are re-run and their K/V land in the cache in the same forward that decodes the
later slots (decode-store overlap); the caller then commits them.

Two attention paths (`EngineConfig.attention`), each eager, and the flex one compiled or captured:
- flex (GPU default): FlexAttention over the KV page pool itself with a `PagedDecodeMask` BlockMask whose
  tensors are rewritten in place when the layout or the page table changes: no gather and no key span, so a
  forward's shape is (batch bucket, slots, logits window) only, and on GPU it runs compiled and captured as a
  CUDA Graph per shape (`mbd.decoding.compiled`: the logits window is then all slots or none, `fit`).
  Its input is [bucket, slots * B]: every row of the batch bucket runs the fullest row's slots (padded).
- sdpa (CPU default, the reference): packed (`Packing`, `mbd.model.attention.Packed`): the input is the resident
  slots of each decoding row end to end, [1, t], t padded to a `token_bucket` (a row runs only the slots it
  holds, a free row nothing: the positions computed are the positions the rows need, so MultiBD's fewer steps
  stay fewer positions at any batch), and only those tokens' K/V are written; attention runs per row over keys
  [0, span) gathered from the pages (or viewed in place while every row sits in its home pages) under a dense
  mask, span = the longest row's need rounded by `span_bucket`, eager.
So `forward` reads: eager (the attention object of the path), or the compiled forward's `run(shape)`.

Buckets keep shapes small. Batch: the forward covers the first `bucket` rows, the smallest bucket covering every
occupied row (the scheduler admits into the lowest free row). Slots: the most resident slots of any row
(resident slots are a row prefix, so only DUMMY slots are skipped; packed, each row its own). Tokens (packed):
whole blocks up to 8, then eight sizes per octave. Logits: only ACTIVE slots' logits are read,
so the head (and the policy's vocabulary softmax) runs on a window of `active` slots per row (`window`), and not
at all for a forward whose rows only store or for a prefill.
Chunked prefill: eager, prompt chunks of other rows ride in the decode forward (`_fused`): one pass over the
weights for all tokens, attention per segment. Compiled, they run as prefill forwards right after the step (so
the step's shape stays one of the few).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from mbd.config import EngineConfig
from mbd.decoding.batch import DecodeBatch, PrefillChunk, RowOutput
from mbd.decoding.compiled import CompiledForward, cache_key, decode_mode, decode_shapes, keyed_cache
from mbd.decoding.guided import Guide, RowFix
from mbd.decoding.policy import Policy
from mbd.decoding.state import FREE_ROW, BatchBuffers, RowLayout, SlotState
from mbd.model import KVCache
from mbd.model.attention import Cached, Packed, Paged, Segmented
from mbd.model.cache import default_page_size
from mbd.model.base import LayerCall
from mbd.model.masks import PagedDecodeMask, additive, block_causal_dense
from mbd.model.tp import SINGLE

log = logging.getLogger("mbd.engine")

SPAN_MIN = 64
LOGPROB_FLOOR = -9999.0  # reported for a token the distribution excludes (JSON has no -inf; vLLM's floor too)  # sdpa spans are multiples of 64 up to 4 * SPAN_MIN, then four per octave


def span_bucket(need: int, size: int) -> int:
    """The sdpa key span for a forward that needs keys [0, need): at most 25% more (64 more below 256), from a
    set of O(log size) values, capped at the cache size."""
    step = max(SPAN_MIN, (1 << (max(need, 1).bit_length() - 1)) // 4)
    return min(size, -(-need // step) * step)


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


def flex_kernel_options(q: int, page: int, device: torch.device) -> dict | None:
    """Triton tile sizes for the paged FlexAttention kernel on CUDA: its key blocks are pages (16-32 tokens, smaller
    than the default tiles, which must divide them) and its query block is one row's buffer."""
    if device.type != "cuda":
        return None
    return {"BLOCK_M": min(PagedDecodeMask.q_block(q), 64), "BLOCK_N": min(page & -page, 64)}


def token_bucket(n: int, block: int) -> int:
    """The packed tokens a forward runs for n resident positions (whole blocks): n itself up to 8 blocks, then
    eight sizes per octave (at most 12.5% padding), so that a run sees O(8 log n) token counts: the shapes a
    compiled or captured forward would hold."""
    step = max(block, (1 << (max(n, 1).bit_length() - 1)) // 8)
    step = -(-step // block) * block
    return -(-n // step) * step


class DecodeInput(NamedTuple):
    """What one decode forward hands the model: ids, positions and DMax's merge weights [r, n] (r = 1: packed
    rows; r = b: the flex layout), the attention, the head's positions [r, m] and the rows' logits window
    [b, active * B] in buffer positions (what the policy reads)."""

    ids: torch.Tensor
    pos: torch.Tensor
    conf: torch.Tensor | None
    attn: Packed | Paged
    logits_at: torch.Tensor
    window: torch.Tensor


class Packing(NamedTuple):
    """A packed sdpa forward's layout (`ModelRunner._packing`), derived from the rows' layout and the page table:
    `source` [t] the buffer place ([b * slots * B], row-major) of each packed token (padding repeats place 0),
    their positions [1, t], the attention, `packed_of` [b * slots * B] the packed index of each place, and the
    logits windows asked of it so far."""

    source: torch.Tensor
    pos: torch.Tensor
    attn: Packed
    packed_of: torch.Tensor
    windows: dict[int, tuple[torch.Tensor, torch.Tensor]]  # per `active`: (packed logits indices, `window`)


class ModelRunner:
    """Runs the model for the engine: prefill, and `run(batch)` = upload the batch's row layout when it changed,
    one decode forward, the policy's token update, the Block Buffers' slide past committed slots and the step's
    one device-to-host copy, unpacked into a `RowOutput` per decoding row."""

    def __init__(self, model: nn.Module, buf: BatchBuffers, policy: Policy, engine: EngineConfig, max_len: int):
        """max_len: positions a row may reach (the KV cache adds a full Block Buffer of margin)."""
        self.model, self.buf, self.policy, self.block = model, buf, policy, buf.block
        rows, self.q = buf.tokens.shape
        dev = buf.tokens.device
        mode = decode_mode(engine, dev)
        self.attention = mode.attention
        self.cache = allocate_cache(model, rows, max_len, self.q, engine, dev)
        self._views: dict[tuple[int, int, bool], KVCache] = {}
        self._arange_q = torch.arange(self.q, device=dev)
        self.prefill_chunk = max(self.block, engine.prefill_chunk // self.block * self.block)
        self.paged = None
        if self.attention == "flex":
            c = self.cache
            self.paged = PagedDecodeMask(rows, buf.n_buf, self.block, c.page_size, c.num_pages,
                                         c.page_table.shape[1], dev)
        self.compiled = None  # the compiled / captured forward (flex only), or eager decoding
        if mode.static:
            dtype, tp = next(model.parameters()).dtype, getattr(model, "tp", SINGLE).world
            cache = keyed_cache(engine.compile_cache, cache_key(model.cfg, dtype, mode, tp, dev))
            self.compiled = CompiledForward(self._paged_forward, mode, cache, dtype, rows, self.q)
        self._inputs: dict[tuple[int, int, int, bool], Packing] = {}  # sdpa, per (b, slots, span, home)
        self._inputs_version = -1  # the cache's page-table version the packings were derived from
        self.step_positions = 0  # query positions the last decode forward ran
        self._uploaded = [FREE_ROW] * rows  # what the device's slot states and committed lengths hold
        self._table_version = -1  # the cache's page-table version the paged masks were derived from
        # every decode forward's (batch bucket, query positions, span): sdpa packed tokens and key span; flex b x Q, 0
        self.shapes: Counter[tuple[int, int, int]] = Counter()
        self.guide: Guide | None = None  # structured output (the engine sets it with the first grammar)
        self._refresh()

    def fit(self, batch: DecodeBatch) -> DecodeBatch:
        """`batch` as its forward runs: compiled, with the logits window of `CompiledForward.window` (all slots or
        none: a step's shape is one of `decode_shapes`)."""
        if self.compiled is None:
            return batch
        return dataclasses.replace(batch, active=self.compiled.window(batch.slots, batch.active))

    def warmup(self, buckets: Sequence[int], say: Callable[[str], None] = log.info) -> float:
        """Compile and capture every decode shape before serving (`CompiledForward.warmup`); the seconds it took
        (0: eager decoding, nothing to prepare)."""
        if self.compiled is None:
            return 0.0
        return self.compiled.warmup(decode_shapes(buckets, self.buf.n_buf), say)

    # ----------------------------------------------------------------- the step
    def run(self, batch: DecodeBatch) -> dict[int, RowOutput]:
        """One decode step of `batch`: forward, the policy's update, tokens stored back (TO_CACHE slots popped),
        and the step's single device -> host copy, unpacked per decoding row (keyed by row)."""
        self.sync(batch.layout)
        b, S, A, B = batch.rows, batch.slots, batch.active, self.block
        logits, idx = self.forward(b, S, A, batch.max_committed, batch.chunks, batch.home)
        buf, Q = self.buf, S * B
        tokens, conf, tops = buf.tokens[:b, :Q], None, None
        fields: dict[str, torch.Tensor] = {}
        merge = buf.token_conf[:b, :Q].clone() if self.policy.token_merge else None
        guided = bool(A) and batch.guided and self.guide is not None
        rows = [(r.row, r) for r in batch.requests]
        if A:
            dec = self._decide(batch, logits, idx, tokens, rows, guided)
            updated = tokens.scatter(1, idx, dec.tokens)
            if batch.logprobs:  # the probability each token was accepted (or last revised) with, where it changed
                full = torch.full(tokens.shape, -1.0, device=tokens.device).scatter(1, idx, dec.conf.float())
                conf = torch.where(updated != tokens, full, -1.0).tolist()
                tops = top_logprobs(logits, idx, batch)
            if merge is not None:  # DMax token merge: a token M2T filled in this step enters the next forward soft
                filled = (tokens.gather(1, idx) == buf.mask_id) & (dec.tokens != buf.mask_id)
                merge = merge.scatter(1, idx, torch.where(filled, dec.conf.float(), 1.0))
            fields = {"masked_in": dec.masked_in, "accepted": dec.accepted, "revised": dec.revised,
                      "confident": dec.confident, "failed": dec.failed, "before": tokens if guided else None}
            tokens = updated
        fields["states"] = buf.state[:b] if batch.trace else None  # forward-time states
        summary = StepSummary({"tokens": tokens, **fields})  # the step's single device -> host transfer
        fixes = self.guide.after(rows, summary, S, tokens) if guided else {}
        buf.store_tokens(tokens, [lay.n_tc for lay in batch.layout], merge)  # re-run TO_CACHE slots are committed: pop
        return {req.row: self._unpack(summary, req, batch, conf and conf[req.row], fixes.get(req.row),
                                      tops and tops[req.row]) for req in batch.requests}

    def _decide(self, batch: DecodeBatch, logits: torch.Tensor, idx: torch.Tensor, tokens: torch.Tensor,
                rows: list, guided: bool):
        """The policy's update of the logits window (grammar frontiers masked first, prompt tokens fixed)."""
        b, B, buf = batch.rows, self.block, self.buf
        fixed = None
        if guided:  # grammar frontiers: masked logits there, nothing accepted before it revised
            fixed = self.guide.before(rows, logits, self.positions(b, batch.slots).gather(1, idx),
                                      _window_starts(batch, b), buf.prompt_len[:b])
        elif batch.fixed:  # a prompt tail is still in a buffer
            fixed = self.positions(b, batch.slots).gather(1, idx) < buf.prompt_len[:b, None]
        return self.policy.update(logits, tokens.gather(1, idx), buf.state[:b].gather(1, idx[:, ::B] // B),
                                  buf.tau_m2t[:b], buf.semi_max_masked[:b], fixed,
                                  buf.tau_t2t[:b] if batch.t2t else None, batch.samplers)

    def _unpack(self, summary: "StepSummary", req, batch: DecodeBatch, conf: list[float] | None,
                fix: RowFix | None, top: list | None) -> RowOutput:
        """A row of the step's summary as per-slot lists over the `slots` run: the logits window [lo, lo + A) from
        the device, TO_CACHE before it, all-mask DUMMY after it."""
        S, A, B = batch.slots, batch.active, self.block
        lo = min(req.n_tc, S - A)
        pad = S - lo - A

        def per_slot(name: str, fill: int, applies: bool = True) -> list[int] | None:
            """S counts: 0 before the window, the device's in it (none when A = 0), `fill` after it. None where
            the field does not apply (T2T off) or the policy does not report it (only DMax reports `confident`)."""
            got = summary.row(req.row, name)
            if not applies or (got is None and A):
                return None
            return [0] * lo + (got or []) + [fill] * pad

        return RowOutput(summary.row(req.row, "tokens"), per_slot("masked_in", B), per_slot("accepted", 0),
                         per_slot("revised", 0, batch.t2t), summary.row(req.row, "states"), conf, fix, top,
                         per_slot("confident", 0, batch.t2t), summary.row(req.row, "failed") == [1])

    # ----------------------------------------------------------------- device state
    def sync(self, layout: list[RowLayout]) -> None:
        """Make the device's slot states and committed lengths of rows [0, len(layout)) those of `layout` (one
        copy, only when something changed); what is derived from them (sdpa positions and masks, the paged
        masks' tensors) follows, the paged masks also when the page table changed."""
        b = len(layout)
        old = self._uploaded[:b]
        if layout != old:
            self.buf.upload(layout, self.cache.lengths)
            self._inputs.clear()
            self._uploaded[:b] = layout
            self._table_version = -1
        if self.paged is not None and self._table_version != self.cache.table_version:
            self._refresh()

    def _refresh(self) -> None:
        if self.paged is not None:
            resident = (self.buf.state != SlotState.DUMMY).sum(1)
            self.paged.update(self.cache.lengths, resident, self.cache.page_table)
            self._table_version = self.cache.table_version

    def view(self, b: int, span: int | None = None, home: bool = False) -> KVCache:
        key = (b, span or self.cache.size, home)
        if key not in self._views:
            self._views[key] = self.cache.view(0, b, span, at_home=home)
        return self._views[key]

    def positions(self, b: int, slots: int) -> torch.Tensor:
        return self.cache.lengths[:b, None] + self._arange_q[: slots * self.block]

    # ----------------------------------------------------------------- the forward
    def forward(self, b: int, slots: int, active: int, max_committed: int = 0, chunks: Sequence[PrefillChunk] = (),
                home: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [b, active * B, V], window [b, active * B]) of the resident slots among the first `slots` of
        rows [0, b): logits only for each row's window of `active` slots starting at its first ACTIVE slot
        (`window`: positions in the row's buffer; static outputs under graphs). sdpa packs the rows' resident
        slots (`_dense`) and reads keys [0, span) for the longest row's `max_committed`; home: rows [0, b) map
        only their home pages (`CacheManager.at_home`), so sdpa reads keys without a gather. `chunks`: prompt
        chunks of other rows, computed in the same forward when eager, right after it when compiled (their K/V
        last). Sets `step_positions`, the query positions the forward ran."""
        Q = slots * self.block
        self.step_positions = b * Q
        if self.compiled is not None:
            self.shapes[(b, Q, 0)] += 1
            out = self.compiled.run((b, slots, active))
            for c in chunks:
                self.prefill(c.row, c.ids, c.start)
            return out
        if self.paged is not None:
            attn = self._paged(b, slots)
            self.shapes[(b, Q, 0)] += 1
        else:
            span = span_bucket(max_committed + Q, self.cache.size)
            attn = self._dense(b, slots, span, home)
            self.step_positions = attn.pos.shape[1]
            self.shapes[(b, self.step_positions, span)] += 1
        if chunks:
            return self._fused(b, slots, active, chunks, attn)
        return self._logits(b, slots, active, attn)

    def window(self, b: int, slots: int, active: int) -> torch.Tensor:
        """Buffer positions [b, active * B] of slots [start, start + active), start = the row's TO_CACHE count
        capped at slots - active: they cover every ACTIVE slot of a row with <= active of them (TO_CACHE slots
        are a prefix, DUMMY slots a suffix of the resident ones), so only padding is not ACTIVE."""
        n_tc = (self.buf.state[:b, :slots] == SlotState.TO_CACHE).sum(1)
        start = n_tc.clamp(max=slots - active)
        return start[:, None] * self.block + self._arange_q[: active * self.block]

    def _inputs_of(self, b: int, slots: int, active: int, attn: "Packing | Paged") -> "DecodeInput":
        """What the model is handed for rows [0, b) x `slots` slots: the flex layout ([b, slots * B], padded: what
        its BlockMask and the captured graphs are built for) or the packed tokens of a `Packing` ([1, t])."""
        Q, merge = slots * self.block, self.policy.token_merge
        if isinstance(attn, Paged):
            idx = self.window(b, slots, active)
            return DecodeInput(self.buf.tokens[:b, :Q], self.paged.q_pos[:b, :Q],
                               self.buf.token_conf[:b, :Q] if merge else None, attn, idx, idx)
        if active not in attn.windows:  # the layout (TO_CACHE counts included) is the packing's: kept with it
            idx = self.window(b, slots, active)
            rows = torch.arange(b, device=idx.device)[:, None] * Q
            attn.windows[active] = attn.packed_of[(rows + idx).view(1, -1)], idx
        at, idx = attn.windows[active]

        def packed(t: torch.Tensor) -> torch.Tensor:
            return t[:b, :Q].reshape(-1).index_select(0, attn.source)[None]

        return DecodeInput(packed(self.buf.tokens), attn.pos, packed(self.buf.token_conf) if merge else None,
                           attn.attn, at, idx)

    def _logits(self, b: int, slots: int, active: int, attn: "Packing | Paged",
                **call: LayerCall) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward of `attn`; `call`: how the model calls each layer (the compiled forward's; eager: its own)."""
        inp = self._inputs_of(b, slots, active, attn)
        logits = self.model(inp.ids, inp.pos, inp.attn, logits_at=inp.logits_at, token_conf=inp.conf, **call)
        return logits.view(b, active * self.block, logits.shape[-1]), inp.window

    def _paged(self, b: int, slots: int) -> Paged:
        Q = slots * self.block
        return Paged(self.view(b), self.paged.q_pos[:b, :Q], self.paged.block_mask(b, slots),
                     flex_kernel_options(Q, self.cache.page_size, self.cache.k.device))

    def _paged_forward(self, b: int, slots: int, active: int, call: LayerCall) -> tuple[torch.Tensor, torch.Tensor]:
        """The flex forward of the compiled runner (`CompiledForward`), each layer called by `call`."""
        return self._logits(b, slots, active, self._paged(b, slots), call=call)

    def _dense(self, b: int, slots: int, span: int, home: bool) -> "Packing":
        """The sdpa forward's layout: the resident slots among the first `slots` of rows [0, b), packed end to end
        (a row that holds fewer runs fewer) and padded to `token_bucket`, with a dense per-row mask over keys
        [0, span). Rebuilt only when the rows' layout or the page table moved (most steps change neither); a step
        then only gathers its tokens."""
        if self._inputs_version != self.cache.table_version:
            self._inputs.clear()
            self._inputs_version = self.cache.table_version
        key = (b, slots, span, home)
        if key not in self._inputs:
            self._inputs[key] = self._packing(b, slots, span, home)
        return self._inputs[key]

    def _packing(self, b: int, slots: int, span: int, home: bool) -> "Packing":
        """Where each row's resident positions sit in the packed input (a place a row does not hold maps to
        packed index 0: only logits windows reach such places, and the policy reads ACTIVE slots only)."""
        W, B, dev = slots * self.block, self.block, self.cache.lengths.device
        n_res = [min(lay.n_res, slots) for lay in self._uploaded[:b]]
        at = torch.tensor([r * W + j for r, n in enumerate(n_res) for j in range(n * B)], dtype=torch.long,
                          device=dev)
        source = torch.nn.functional.pad(at, (0, token_bucket(at.numel(), B) - at.numel()))
        packed_of = torch.zeros(b * W, dtype=torch.long, device=dev)
        packed_of[at] = torch.arange(at.numel(), device=dev)
        pos = self.positions(b, slots)
        mask = additive(block_causal_dense(pos, span, self.cache.lengths[:b] + torch.tensor(n_res, device=dev) * B, B),
                        self.cache.k.dtype)
        return Packing(source, pos.reshape(-1).index_select(0, source)[None],
                       Packed(self.view(b, span, home), mask, pos, at), packed_of, {})

    def _fused(self, b: int, slots: int, active: int, chunks: Sequence[PrefillChunk],
               decode: "Packing | Paged") -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step and prompt chunks of other rows in ONE forward (chunked prefill): the linear layers
        (the weights) are read once for all tokens, attention runs per segment. A prefilling row inside the
        decode bucket is all DUMMY there (packed, it runs no token); its chunk segment comes after the decode
        segment, so under flex the chunk's K/V overwrite that row's scratch K/V at the same positions. The caller
        commits the chunks."""
        dev = self.cache.lengths.device
        inp = self._inputs_of(b, slots, active, decode)
        r, n = inp.ids.shape
        parts, ids, all_pos = [(r, n, inp.attn)], [inp.ids.reshape(1, -1)], [inp.pos.reshape(1, -1)]
        for c in chunks:
            end = c.start + len(c.ids)
            cpos = torch.arange(c.start, end, device=dev)[None]
            cmask = block_causal_dense(cpos, end, torch.tensor([end], device=dev), self.block)
            parts.append((1, len(c.ids), Cached(self.cache.view(c.row, c.row + 1, end), cmask, cpos)))
            ids.append(torch.tensor(c.ids, device=dev)[None])
            all_pos.append(cpos)
        flat_at = (torch.arange(r, device=dev)[:, None] * n + inp.logits_at).view(1, -1)
        merge = None
        if inp.conf is not None:  # prompt chunks enter as their tokens
            merge = torch.cat([inp.conf.reshape(1, -1)] + [torch.ones_like(i, dtype=torch.float) for i in ids[1:]], 1)
        logits = self.model(torch.cat(ids, 1), torch.cat(all_pos, 1), Segmented(tuple(parts)), logits_at=flat_at,
                            token_conf=merge)
        return logits.view(b, active * self.block, logits.shape[-1]), inp.window

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
            mask = block_causal_dense(pos, a + n, torch.tensor([a + n], device=dev), self.block)
            self.model(chunk, pos, Cached(self.cache.view(row, row + 1, a + n), mask, pos), logits_at=none)


class StepSummary:
    """The step's one device-to-host copy: per batch row, named [b, width] fields laid end to end (None fields
    are left out), read back by name; `set_row` lets structured output rewrite a row's tokens."""

    def __init__(self, fields: dict[str, torch.Tensor | None]):
        kept = {k: v for k, v in fields.items() if v is not None}
        self.slices, at = {}, 0
        for name, t in kept.items():
            self.slices[name] = slice(at, at + t.shape[1])
            at += t.shape[1]
        self.rows: list[list[int]] = torch.cat([t.long() for t in kept.values()], 1).tolist()

    def row(self, row: int, name: str) -> list[int] | None:
        at = self.slices.get(name)
        return None if at is None else self.rows[row][at]

    def set_row(self, row: int, name: str, values: list[int]) -> None:
        self.rows[row][self.slices[name]] = values


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
    vals, ids = lp.nan_to_num(nan=LOGPROB_FLOOR).clamp_min(LOGPROB_FLOOR).topk(k, -1)
    return [list(zip(pos, ([list(zip(i, v)) for i, v in zip(ri, rv)])))
            for pos, ri, rv in zip(idx.tolist(), ids.tolist(), vals.tolist())]
