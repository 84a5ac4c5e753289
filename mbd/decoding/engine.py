"""The Block Buffer MultiBD engine (alg:optimized_multibd): the public decoding API of the project.

One `step()` = admit waiting requests into free rows while their KV pages fit (reusing cached prefix pages,
`cache_manager`) -> map pages for every row's resident slots (preempting the youngest request when the pool is
short) -> ONE static-shape forward over every decoding row's
Block Buffer, carrying up to `prefill_budget` prompt tokens of admitted rows (chunked prefill; with no row
decoding a prompt is prefilled at once) -> logits for the ACTIVE slots only -> vectorised M2T / T2T token
updates -> one device-to-host transfer of the tokens and per-slot counts -> per-request host bookkeeping in
plain ints (TO_CACHE marking, emit final tokens, finish, activation) -> in place on the device: slide the
buffers past the committed blocks, and (when any changed) upload slot states and committed lengths in one
copy. The CLI, the eval sweeps and the HTTP service all drive this object; `generate` and `stream` are
convenience drivers of the same loop.

Per-request params (`add_request(params=...)`): a full DecodeConfig or a mapping of overrides of the
engine's config; buffer_size may not exceed the engine's compiled buffer_size, block_size must be the
model's, max_length is capped by the engine's (and the model's max_position_embeddings).

Outputs: a block's tokens become final (and are streamed) when it becomes TO_CACHE; they are cut at the
first stop token (excluded from the text, counted in num_generated) and at the generation limit.
NFE counts decode forwards (prefill is not counted); TPF = num_generated / NFE.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel
from torch import nn

from mbd.config import ConfigError, DecodeConfig, validate
from mbd.decoding.cache_manager import CacheManager
from mbd.decoding.constraints import ConstraintSpec, GrammarVocab
from mbd.decoding.guided import Guide, merge_counts
from mbd.decoding.policy import Sampler, policy_for
from mbd.decoding.runner import ModelRunner, PrefillChunk
from mbd.decoding.scheduler import Scheduler
from mbd.decoding.state import BatchBuffers, Request, RequestParams, SlotState
from mbd.decoding.trace import step_entry
from mbd.detokenize import TextStream
from mbd.tokenizer import Tokenizer

Params = DecodeConfig | Mapping[str, Any] | None
DUMMY = SlotState.DUMMY


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one step produced for one request (a dataclass, not pydantic: built for every request every step)."""

    request_id: str
    new_token_ids: list[int]  # tokens that became final in this step
    finished: bool
    finish_reason: str | None  # "eos" | "length" | "max_nfe" | "abort" | None
    nfe: int
    num_generated: int
    new_logprobs: list[float] | None = None  # with params.logprobs: the log-probability of each new token
    new_top_logprobs: list[list[tuple[int, float]]] | None = None  # with params.top_logprobs: per new token
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage.prompt_tokens_details)
    # with params.provisional: the resident tokens after the final ones (masks included), per block (the first may
    # be partial: a prompt's tail), from the end of the output so far; None when not asked for
    provisional: list[list[int]] | None = None


class GenerationResult(BaseModel):
    request_id: str
    text: str
    token_ids: list[int]
    nfe: int
    num_generated: int
    tpf: float
    wall_time_s: float  # from add_request to finish (includes queueing)
    step_latency_ms: float  # mean wall time of the steps this request took part in
    finish_reason: str
    trace: list[dict] | None = None


@dataclass
class EngineStats:
    steps: int = 0
    step_s: float = 0.0  # decode steps (forward + decisions + bookkeeping, chunks of prefill riding in them)
    prefills: int = 0  # prompts prefilled on their own (no row was decoding)
    prefill_s: float = 0.0
    prefill_tokens: int = 0  # prompt tokens run through the model, alone or as chunks of decode steps
    chunked_steps: int = 0  # decode steps that also carried prompt chunks
    positions_run: int = 0  # query positions of decode forwards (batch bucket x slots run x B)
    resident_positions: int = 0  # of those, positions of resident (ACTIVE / TO_CACHE) slots of decoding rows
    logit_rows: int = 0  # positions whose logits the head computed (ACTIVE windows, padding included)
    prefix_query_tokens: int = 0  # block-aligned prompt tokens looked up in the prefix cache at admission
    prefix_hit_tokens: int = 0  # of those, tokens whose K/V came from cached pages (their prefill was skipped)
    preemptions: int = 0  # requests sent back to the queue because the KV page pool ran out
    grammar_s: float = 0.0  # of step_s, the grammar matchers' (masks before the decision, settling after)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


def power_of_two_buckets(rows: int) -> tuple[int, ...]:
    out, b = [], 1
    while b < rows:
        out.append(b)
        b *= 2
    return (*out, rows)


class Engine:
    def __init__(self, model: nn.Module, tokenizer: Tokenizer | None, cfg: DecodeConfig, max_batch_slots: int = 8,
                 device: torch.device | str | None = None, trace: bool = False,
                 batch_buckets: Sequence[int] | None = None, use_cuda_graphs: bool | None = None,
                 prefill_chunk: int = 512, attention: str = "sdpa", prefill_budget: int = 64,
                 kv_cache_bytes: int | None = None, page_size: int | None = None, prefix_caching: bool = True):
        """attention: "sdpa" (dense bool masks over the key span) or "flex" (FlexAttention BlockMasks that skip
        key blocks past each row's visible region; compiled on GPU). prefill_budget: prompt tokens a decode
        step may carry (chunked prefill) while rows are decoding, rounded down to whole blocks (at least one);
        with no row decoding a prompt is prefilled at once, `prefill_chunk` tokens per forward.
        kv_cache_bytes: the KV page pool's budget (default: room for every row at max_length); page_size: tokens
        per page, a multiple of the block size; prefix_caching: reuse committed prefix pages across requests."""
        mcfg = model.cfg
        self.block = mcfg.block_size
        if cfg.block_size not in (None, self.block):
            raise ConfigError(f"decode config block_size={cfg.block_size} but the model was trained with "
                              f"block_size={self.block}: remove block_size or set it to {self.block}")
        if max_batch_slots < 1:
            raise ConfigError(f"max_batch_slots must be >= 1, got {max_batch_slots}")
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(self.device).eval()
        self.tokenizer, self.cfg, self.trace = tokenizer, cfg, trace
        self.n_buf, self.q = cfg.buffer_size, cfg.buffer_size * self.block
        self.max_length = min(cfg.max_length, mcfg.max_position_embeddings)
        self.mask_id = mcfg.mask_token_id
        stops = tokenizer.stop_token_ids if tokenizer is not None else [mcfg.eos_token_id]
        self._stop_set = frozenset(stops)
        self._stop_t = torch.tensor(sorted(stops), device=self.device)
        self.policy = policy_for(cfg.strategy)(self.block, self.mask_id)  # issue 13: DMax native rules
        self.buf = BatchBuffers(max_batch_slots, self.n_buf, self.block, self.mask_id, self.device)
        graphs = self.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        # the last block may straddle the generation limit, hence + block
        self.runner = ModelRunner(self.model, mcfg, self.buf, self.max_length + self.block,
                                  tuple(batch_buckets or power_of_two_buckets(max_batch_slots)), graphs, prefill_chunk,
                                  attention, page_size, kv_cache_bytes)
        self.kv = CacheManager(self.runner.cache, prefix_caching)
        self.sched = Scheduler(max_batch_slots)
        self.prefill_budget = max(self.block, prefill_budget // self.block * self.block)
        # per row: slot states + committed cache length, as last written to the device
        self._host_rows = [self.buf.slot_states(0, 0, self.n_buf) + [0] for _ in range(max_batch_slots)]
        self.stats = EngineStats()
        self._guide: Guide | None = None  # built with the first constrained request

    def guide(self) -> Guide:
        """Structured output's side of the policy (mbd.decoding.guided), over this model's vocabulary."""
        if self._guide is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer (tokenizer.json)")
            vocab = GrammarVocab(self.tokenizer.tok, self.model.cfg.vocab_size, sorted(self._stop_set))
            self._guide = Guide(vocab, self.block, self.mask_id)
        return self._guide

    # ----------------------------------------------------------------- requests
    def resolve_params(self, params: Params) -> DecodeConfig:
        """A request's DecodeConfig: the engine's, a full DecodeConfig, or a mapping of overrides."""
        if params is None:
            cfg = self.cfg
        elif isinstance(params, DecodeConfig):
            cfg = params
        else:
            cfg = validate(DecodeConfig, {**self.cfg.model_dump(), **dict(params)}, "request params")
        if cfg.buffer_size > self.n_buf:
            raise ValueError(f"request buffer_size={cfg.buffer_size} exceeds the engine's compiled buffer_size="
                             f"{self.n_buf}: lower it or build the Engine with buffer_size >= {cfg.buffer_size}")
        if cfg.block_size not in (None, self.block):
            raise ValueError(f"request block_size={cfg.block_size} differs from the model's block_size={self.block}")
        if cfg.strategy != self.cfg.strategy:
            raise ValueError(f"request strategy={cfg.strategy} differs from the engine's {self.cfg.strategy}")
        return cfg

    def add_request(self, prompt_ids: list[int], params: Params = None, request_id: str | None = None,
                    constraint: ConstraintSpec | None = None) -> str:
        """Queue a request; `constraint`: structured output (what it may commit), refused with a
        ConstraintError (a ValueError) when it cannot be honoured exactly."""
        return self._add(prompt_ids, params, request_id, constraint).id

    def check_request(self, prompt_ids: Sequence[int], params: Params = None, constraint: ConstraintSpec | None = None
                      ) -> tuple[list[int], RequestParams]:
        """The one request check (the CLI, the eval sweeps and every served replica go through it): prompt ids
        are ints in [0, vocab_size) other than the mask token, the prompt leaves room to generate, the
        parameters fit this engine, and a constraint compiles. Raises ValueError naming what is wrong."""
        if constraint is not None:
            self.guide().vocab.compile(constraint)
        ids = list(prompt_ids)
        if not ids:
            raise ValueError("prompt_ids is empty: a request needs at least one prompt token")
        vocab = self.model.cfg.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_ids must be ints in [0, {vocab})")
        if self.mask_id in ids:
            raise ValueError(f"prompt_ids contain the mask token id {self.mask_id}, which the decoder reserves")
        p = RequestParams.resolve(self.resolve_params(params), len(ids), self.max_length)
        need = self.kv.pages_for(-(-p.gen_end // self.block) * self.block + p.buffer_size * self.block)
        if need > self.kv.capacity:
            raise ValueError(f"the request needs up to {need} KV pages (prompt + max_new_tokens + its Block Buffer) "
                             f"but the pool holds {self.kv.capacity}: lower max_new_tokens or raise kv_cache_bytes")
        return ids, p

    def _add(self, prompt_ids: Sequence[int], params: Params, request_id: str | None,
             constraint: ConstraintSpec | None = None) -> Request:
        ids, p = self.check_request([int(t) for t in prompt_ids], params)
        req = Request(request_id or uuid.uuid4().hex, ids, p, self.block)
        if constraint is not None:
            self.guide().start(req, constraint)
        if self.trace:
            req.trace = []
        if p.temperature > 0:
            req.generator = torch.Generator(device=self.device).manual_seed(p.seed)
        if p.logprobs:
            req.logprobs = {}
            req.top_logprobs = {} if p.top_logprobs else None
        self.sched.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request; its slot is freed (and an "abort" output emitted) next step."""
        return self.sched.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.sched.has_unfinished()

    def num_free_slots(self) -> int:
        return max(0, self.sched.rows - len(self.sched.running) - len(self.sched.waiting))

    # ----------------------------------------------------------------- the step loop
    def step(self) -> list[StepOutput]:
        """Admit waiting requests into free rows, then one decode forward. A row's prompt is prefilled at once
        when no row is decoding (nobody waits), otherwise in block-aligned chunks of at most `prefill_budget`
        tokens per step that ride in the decode forward, so admitting a long prompt never stalls decoding."""
        outs = []
        with torch.inference_mode():
            for req in self.sched.take_aborted():
                if req.row >= 0:
                    self._release(req.row)
                outs.append(self._finish(req, "abort", []))
            for req in self.sched.admit(self._map_pages):
                if req.cache_len == req.aligned_len:  # nothing to prefill (all cached, or all in the first block)
                    self._activate(req)
            self._ensure_pages()
            if not any(r.decoding for r in self.sched.running.values()):
                for req in list(self.sched.running.values()):
                    self._prefill_rest(req)
            if self.sched.running:
                outs += self._decode()
        return outs

    def _map_pages(self, req: Request, row: int) -> bool:
        """Admission: map pages for the request's given tokens and a full Block Buffer into `row`, reusing
        cached prefix pages (their prefill is skipped), and keeping one page per decoding row in reserve so that
        admitting does not force a preemption at once. False: it does not fit yet."""
        need = req.aligned_len + req.params.buffer_size * self.block
        reserve = sum(r.decoding for r in self.sched.running.values())
        hit = self.kv.admit(row, req.known[: req.aligned_len], need, reserve)
        if hit is None:
            return False
        req.cache_len = hit
        if req.cached_tokens is None:  # readmissions after a preemption re-find their own pages: not the prompt's
            req.cached_tokens = min(hit, req.prompt_len)
        self.runner.cache.lengths[row] = hit
        self._host_rows[row][-1] = hit
        self.stats.prefix_query_tokens += req.aligned_len
        self.stats.prefix_hit_tokens += hit
        return True

    def _ensure_pages(self) -> None:
        """Every decoding row needs pages up to its last resident slot. Oldest first; when the pool is short, the
        youngest request is preempted (possibly the one asking), which always lets the oldest go on: a request
        whose worst case exceeds the pool is refused by `check_request`."""
        for req in list(self.sched.running.values()):
            while req.row >= 0 and req.decoding and not self.kv.ensure(req.row, req.cache_len + req.n_res * self.block):
                self._preempt(self.sched.youngest())

    def _preempt(self, req: Request) -> None:
        """Free the request's row and pages and queue it first, keeping its Block Buffer (resident tokens and
        slot states) on the host. On readmission its committed tokens are prefilled again (or found in the
        prefix cache) and the buffer is put back as it was, so the request decodes exactly as if never
        preempted (a MultiBD buffer's later blocks depend on the earlier ones' partial state)."""
        if req.decoding:
            req.resume = (self.buf.tokens[req.row, : req.n_res * self.block].tolist(), req.n_res, req.n_tc)
            req.aligned_len = req.cache_len
        self._release(req.row)
        self.sched.preempt(req)
        req.decoding, req.cache_len, req.n_res, req.n_tc = False, 0, 0, 0
        self.stats.preemptions += 1

    def _prefill_rest(self, req: Request) -> None:
        t = time.perf_counter()
        self.runner.prefill(req.row, req.known[req.cache_len: req.aligned_len], req.cache_len)
        self.stats.prefills += 1
        self.stats.prefill_tokens += req.aligned_len - req.cache_len
        self._activate(req)
        self.stats.prefill_s += time.perf_counter() - t

    def _activate(self, req: Request) -> None:
        """The block-aligned known tokens are committed (their full pages become reusable): the row starts
        decoding its first block, which holds the prompt's tail (fixed) then masks, or, after a preemption, gets
        its Block Buffer back."""
        self.buf.load_row(req.row, req.prompt_ids[req.aligned_len:], req.prompt_len, req.params,
                          self.policy.semi_max_masked(req.params.tau_semi))
        req.cache_len, req.n_res, req.n_tc, req.decoding = req.aligned_len, 1, 0, True
        if req.resume is not None:
            tokens, req.n_res, req.n_tc = req.resume
            self.buf.restore_row(req.row, tokens, self.buf.slot_states(req.n_tc, req.n_res, self.n_buf))
            req.resume = None
        self.kv.register(req.row, req.known, req.cache_len)
        self._host_rows[req.row] = self.buf.slot_states(req.n_tc, req.n_res, self.n_buf) + [req.aligned_len]
        self.runner.invalidate()

    def _chunks(self) -> list[tuple[Request, PrefillChunk]]:
        """Prompt chunks for this step: prefilling rows in admission order, `prefill_budget` tokens in all."""
        out, left = [], self.prefill_budget
        for req in self.sched.running.values():
            if left == 0:
                break
            if not req.decoding:
                n = min(left, req.aligned_len - req.cache_len)
                out.append((req, PrefillChunk(req.row, req.cache_len, req.known[req.cache_len: req.cache_len + n])))
                left -= n
        return out

    def _commit_chunks(self, chunks: list[tuple[Request, PrefillChunk]]) -> None:
        for req, c in chunks:
            req.cache_len += len(c.ids)
            self.runner.cache.commit(req.row, len(c.ids))
            self._host_rows[req.row][-1] = req.cache_len
            self.stats.prefill_tokens += len(c.ids)
            if req.cache_len == req.aligned_len:
                self._activate(req)
        self.stats.chunked_steps += 1
        self.runner.invalidate()  # a prefilling row inside the decode bucket moved

    def _release(self, row: int) -> None:
        """Free a row and its pages; its committed length drops to 0 so that it no longer widens the key span."""
        self.kv.release(row)
        self.buf.clear_row(row)
        self.runner.cache.reset(row)
        self.runner.invalidate()
        self._host_rows[row] = self.buf.slot_states(0, 0, self.n_buf) + [0]

    def _decode(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        running = [(row, r) for row, r in self.sched.running.items() if r.decoding]
        b = self.runner.bucket(max(row for row, _ in running) + 1)
        # slots run: the resident prefix of the fullest row (trailing DUMMY slots of every row are skipped);
        # logits: a window of A slots per row, A = the most ACTIVE slots of any row
        S = max(r.n_res for _, r in running)
        A = max(r.n_res - r.n_tc for _, r in running)
        if any(r.generator is not None for _, r in running):
            A = S  # sampling draws one number per position it is given: keep the draws as before, all slots run
        buf, B, Q = self.buf, self.block, S * self.block
        chunks = self._chunks()

        span = self.runner.span(max(r.cache_len for _, r in running), S)
        logits, idx = self.runner.forward(b, S, span, A, [c for _, c in chunks], self.kv.at_home(b))
        tokens = buf.tokens[:b, :Q]
        parts, t2t, conf, tops = [], None, None, None
        has_t2t = any(r.params.tau_t2t is not None for _, r in running)
        guided = bool(A) and any(r.grammar is not None for _, r in running)
        if A:
            fixed = None
            if guided:  # grammar frontiers: masked logits there, nothing accepted before it revised
                lo = [0] * b
                for row, r in running:
                    lo[row] = min(r.n_tc, S - A)
                pos = self.runner.positions(b, S).gather(1, idx)
                fixed = self._guide.before(running, logits, pos, lo, buf.prompt_len[:b])
            elif any(r.cache_len < r.prompt_len for _, r in running):  # a prompt tail is still in a buffer
                fixed = self.runner.positions(b, S).gather(1, idx) < buf.prompt_len[:b, None]
            t2t = buf.tau_t2t[:b] if has_t2t else None
            samplers = [Sampler(row, r.params.temperature, r.generator, r.params.top_p, r.params.top_k)
                        for row, r in running if r.generator is not None]
            slots = idx[:, ::B] // B
            dec = self.policy.update(logits, tokens.gather(1, idx), buf.state[:b].gather(1, slots), buf.tau_m2t[:b],
                                     buf.semi_max_masked[:b], fixed, t2t, samplers)
            updated = tokens.scatter(1, idx, dec.tokens)
            if any(r.logprobs is not None for _, r in running):
                # logprobs: the probability each token was accepted (or last revised) with, where it changed
                full = torch.full(tokens.shape, -1.0, device=tokens.device).scatter(1, idx, dec.conf.float())
                conf = torch.where(updated != tokens, full, -1.0).tolist()
                tops = self._top_logprobs(logits, idx, running, samplers)
            parts = [dec.masked_in, dec.accepted] + ([dec.revised] if t2t is not None else [])
            if guided:
                parts.append(tokens)  # the tokens before the decision, for the grammar's recount
            tokens = updated
        old_at = Q + A * (len(parts) - 1)
        if self.trace:
            parts.append(buf.state[:b])  # forward-time states
        summary = torch.cat([tokens, *parts], 1).tolist()  # the step's single device -> host transfer
        fixes = self._guide.after(running, summary, old_at, S, tokens) if guided else {}
        pops = [0] * b  # the TO_CACHE slots this forward re-ran are committed and popped
        for row, req in running:
            pops[row] = req.n_tc
        buf.store_tokens(tokens, pops)
        if chunks:
            self._commit_chunks(chunks)
        self.stats.positions_run += b * Q
        self.stats.resident_positions += B * sum(r.n_res for _, r in running)
        self.stats.logit_rows += b * A * B

        outs, done, dirty, moved = [], [], False, False
        for row, req in running:
            s = summary[row]
            toks = s[:Q]
            # per slot of the run: window slots [lo, lo + A) from the device, TO_CACHE before, DUMMY after
            lo, k = min(req.n_tc, S - A), Q + A
            pad = [B] * (S - lo - A)
            masked_in = [0] * lo + s[Q:k] + pad
            accepted = [0] * lo + s[k:k + A] + [0] * len(pad)
            revised = [0] * lo + s[k + A:k + 2 * A] + [0] * len(pad) if has_t2t else None
            filled, unchanged = self.policy.counts(masked_in, accepted, revised)
            if row in fixes:
                filled, unchanged = merge_counts(fixes[row], filled, unchanged)
            if req.trace is not None:  # skipped DUMMY slots: all masks
                req.trace.append(step_entry(s[-self.n_buf:], masked_in + [B] * (self.n_buf - S), req.cache_len, B))
            req.nfe += 1
            base, n_res, pre_tc = req.cache_len, req.n_res, req.n_tc
            if req.logprobs is not None and conf is not None:
                req.logprobs.update((base + i, math.log(c)) for i, c in enumerate(conf[row][:n_res * B]) if c > 0)
                if req.top_logprobs is not None and tops is not None:
                    pos, top = tops[0][row], tops[1][row]
                    req.top_logprobs.update((base + q, top[j][: req.params.top_logprobs])
                                            for j, q in enumerate(pos) if conf[row][q] > 0)
            post_tc = self.policy.final_count(req.params, pre_tc, n_res, filled, unchanged)
            new = self._emit(req, toks, base, pre_tc, post_tc)
            if base + post_tc * B > len(req.known):
                req.known += toks[len(req.known) - base: post_tc * B]
            eos_seen = req.eos or (not req.params.ignore_eos
                                   and not self._stop_set.isdisjoint(toks[max(0, req.prompt_len - base): n_res * B]))
            req.cache_len = base + pre_tc * B
            if pre_tc:
                self.kv.register(row, req.known, req.cache_len)
            plan = self.policy.plan(req.params, n_res=n_res, pre_tc=pre_tc, post_tc=post_tc,
                                    filled_last=filled[n_res - 1], unchanged_last=unchanged[n_res - 1],
                                    eos_seen=eos_seen, nfe=req.nfe, cache_len=req.cache_len)
            req.n_res, req.n_tc = n_res - pre_tc + plan.activate, post_tc - pre_tc
            if plan.finish is not None:
                if plan.finish == "max_nfe":
                    new = new + self._emit_partial(req, toks, base, post_tc, n_res)
                reason = plan.finish if plan.finish == "max_nfe" else ("eos" if req.eos else "length")
                done.append(req)
                outs.append(self._finish(req, reason, new))
                req.n_res = req.n_tc = 0
            else:
                outs.append(StepOutput(req.id, new, False, None, req.nfe, req.num_generated,
                                       self._logprobs(req, new), self._top(req, new), req.cached_tokens or 0,
                                       self._provisional(req, toks, base, post_tc, n_res)))
            host_row = buf.slot_states(req.n_tc, req.n_res, self.n_buf) + [0 if req.finished else req.cache_len]
            old = self._host_rows[row]
            if host_row != old:
                moved |= host_row[-1] != old[-1] or host_row.count(DUMMY) != old.count(DUMMY)
                self._host_rows[row], dirty = host_row, True
        if dirty:
            buf.upload(self._host_rows[:b], self.runner.cache.lengths)
            if moved:  # committed lengths or resident slots changed: positions and mask too
                self.runner.invalidate()
        for req in done:
            buf.clear_row(req.row)
            self.kv.release(req.row)

        dt = time.perf_counter() - t0
        for _, req in running:
            req.step_time_s += dt
        self.stats.steps += 1
        self.stats.step_s += dt
        if self._guide is not None:
            self.stats.grammar_s, self._guide.seconds = self.stats.grammar_s + self._guide.seconds, 0.0
        return outs

    def _emit(self, req: Request, toks: list[int], base: int, lo_slot: int, hi_slot: int) -> list[int]:
        """Append the final tokens of slots [lo_slot, hi_slot) (slot 0 starts at absolute position `base`)."""
        if hi_slot <= lo_slot or req.eos:
            return []
        B = self.block
        start = base + lo_slot * B
        seg = toks[lo_slot * B: hi_slot * B]
        return self._append(req, seg[max(0, req.prompt_len - start): max(0, req.params.gen_end - start)])

    def _emit_partial(self, req: Request, toks: list[int], base: int, lo_slot: int, n_res: int) -> list[int]:
        """On max_nfe: the still-resident tokens after the final blocks, up to the first mask."""
        if req.eos:
            return []
        B = self.block
        start = base + lo_slot * B
        seg = toks[lo_slot * B: n_res * B]
        seg = seg[max(0, req.prompt_len - start): max(0, req.params.gen_end - start)]
        if self.mask_id in seg:
            seg = seg[: seg.index(self.mask_id)]
        return self._append(req, seg)

    def _append(self, req: Request, ids: list[int]) -> list[int]:
        for i, t in enumerate(ids):
            if t in self._stop_set and not req.params.ignore_eos:
                req.eos = True
                ids = ids[:i]
                break
        req.output.extend(ids)
        return ids

    def _finish(self, req: Request, reason: str, new: list[int]) -> StepOutput:
        req.finish_reason = reason
        req.t_finished = time.perf_counter()
        self.sched.finish(req)
        return StepOutput(req.id, new, True, reason, req.nfe, req.num_generated, self._logprobs(req, new),
                          self._top(req, new), req.cached_tokens or 0)

    def _top_logprobs(self, logits: torch.Tensor, idx: torch.Tensor, running: list[tuple[int, Request]],
                      samplers: list[Sampler]) -> tuple[list, list] | None:
        """(window buffer positions [b][A*B], their top-k (id, logprob) lists) for rows asking for top_logprobs:
        of the distribution the step accepted from (the model's softmax with the mask token excluded and the
        grammar's mask applied; a sampled row's tempered, top-k / top-p one). None when no row asks."""
        k = max((r.params.top_logprobs for _, r in running if r.top_logprobs is not None), default=0)
        if not k:
            return None
        lp = logits.float().log_softmax(-1)
        for s in samplers:
            lp[s.row] = s.probs(logits[s.row]).log()
        vals, ids = lp.topk(k, -1)
        top = [[list(zip(i, v)) for i, v in zip(ri, rv)] for ri, rv in zip(ids.tolist(), vals.tolist())]
        return idx.tolist(), top

    @staticmethod
    def _top(req: Request, new: list[int]) -> list[list[tuple[int, float]]] | None:
        if req.top_logprobs is None:
            return None
        end = req.prompt_len + len(req.output)
        return [req.top_logprobs.pop(pos, []) for pos in range(end - len(new), end)]

    def _provisional(self, req: Request, toks: list[int], base: int, post_tc: int, n_res: int
                     ) -> list[list[int]] | None:
        """The tokens of the resident slots after the final ones, within the generation limit, per block."""
        if not req.params.provisional or req.eos:
            return None
        B = self.block
        lo = max(base + post_tc * B, req.prompt_len + len(req.output))
        hi = max(lo, min(base + n_res * B, req.params.gen_end))
        cuts = [lo, *range((lo // B + 1) * B, hi, B), hi]
        return [toks[a - base: b - base] for a, b in zip(cuts, cuts[1:]) if b > a]

    @staticmethod
    def _logprobs(req: Request, new: list[int]) -> list[float] | None:
        """The log-probabilities of the `new` tokens just appended to req.output (output j is at prompt_len + j)."""
        if req.logprobs is None:
            return None
        end = req.prompt_len + len(req.output)
        return [req.logprobs.pop(pos, 0.0) for pos in range(end - len(new), end)]

    # ----------------------------------------------------------------- convenience drivers
    def encode(self, prompt: str | Sequence[int], chat: bool = True) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError("string prompts need a tokenizer: build the Engine with one or pass token ids")
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], params: Params = None,
                 chat: bool = True, constraints: Sequence[ConstraintSpec | None] | None = None) -> list[GenerationResult]:
        """Decode all prompts with continuous batching and return their results in order (`constraints`: one
        per prompt, structured output)."""
        cons = constraints if constraints is not None else [None] * len(prompts)
        reqs = [self._add(self.encode(p, chat), params, None, c) for p, c in zip(prompts, cons, strict=True)]
        pending = {r.id for r in reqs}
        while pending:
            for out in self.step():
                if out.finished:
                    pending.discard(out.request_id)
        return [self.result(r) for r in reqs]

    def stream(self, prompt: str | Sequence[int], params: Params = None, chat: bool = True) -> Iterator[str]:
        """Yield text as blocks become final, through the one incremental detokenizer (`mbd.detokenize`): each
        token is decoded once, and a character split across tokens is yielded only when complete."""
        if self.tokenizer is None:
            raise ValueError("stream() yields text and needs a tokenizer")
        req = self._add(self.encode(prompt, chat), params, None)
        text, n = TextStream(self.tokenizer), 0
        try:
            while not req.finished:
                self.step()
                if piece := text.push(req.output[n:]):
                    yield piece
                n = len(req.output)
            if piece := text.finish():
                yield piece
        finally:
            if not req.finished:
                self.abort(req.id)

    def result(self, req: Request) -> GenerationResult:
        text = self.tokenizer.decode(req.output) if self.tokenizer is not None else ""
        return GenerationResult(
            request_id=req.id, text=text, token_ids=list(req.output), nfe=req.nfe, num_generated=req.num_generated,
            tpf=req.num_generated / max(req.nfe, 1), wall_time_s=req.t_finished - req.t_added,
            step_latency_ms=1e3 * req.step_time_s / max(req.nfe, 1), finish_reason=req.finish_reason or "",
            trace=req.trace,
        )
