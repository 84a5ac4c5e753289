"""The Block Buffer MultiBD engine (alg:optimized_multibd): the public decoding API of the project.

`Engine(model, tokenizer, decode_config, engine_config)`: the DecodeConfig says how to decode (the paper's
thresholds, the Block Buffer size), the EngineConfig how to run (device, batch rows and buckets, attention
kernel, compilation, CUDA Graphs, chunked prefill, the KV page pool). One `step()` is split as nano-vllm's:
- `scheduler.schedule()` (mbd/decoding/scheduler.py): aborts, admission into free batch rows while KV pages
  fit (reusing cached prefix pages), pages for every decoding row's resident slots (preempting the youngest
  request when the pool is short); with no row decoding, whole prompts are prefilled first;
- `runner.run(batch)` (mbd/decoding/runner.py): ONE static-shape forward over every decoding row's Block
  Buffer, carrying up to `prefill_budget` prompt tokens of admitted rows (chunked prefill), the vectorised
  M2T / T2T update, and one device-to-host copy, returned as a `RowOutput` per row;
- `postprocess` (here): per-request host bookkeeping in plain ints: TO_CACHE marking, emitting final tokens,
  stop tokens, finishing, activation. The request's counts are the only state; the device's slot states and
  committed lengths are derived from them before the next forward.
The CLI, the eval sweeps and the HTTP service all drive this object; `generate` and `stream` are convenience
drivers of the same loop.

Per-request params (`add_request(params=...)`): a full DecodeConfig or a mapping of overrides of the
engine's config, checked by `mbd.decoding.validate` (buffer_size may not exceed the engine's compiled
buffer_size, block_size must be the model's, max_length is capped by the engine's and the model's).

Outputs: a block's tokens become final (and are streamed) when it becomes TO_CACHE; they are cut at the
first stop token (excluded from the text and from num_generated) and at the generation limit. A request
finishes after the forward that stores its last block (as the authors' engine counts). NFE counts decode
forwards, that store forward included (prefill is not counted); TPF = num_generated / NFE.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from mbd.config import ConfigError, DecodeConfig, EngineConfig
from mbd.decoding.batch import DecodeBatch, RowOutput
from mbd.decoding.cache_manager import CacheManager
from mbd.decoding.constraints import ConstraintSpec, GrammarVocab
from mbd.decoding.guided import Guide, merge_counts
from mbd.decoding.outputs import EngineStats, GenerationResult, StepOutput
from mbd.decoding import resume
from mbd.decoding.policy import policy_for
from mbd.decoding.runner import ModelRunner
from mbd.decoding.scheduler import Scheduler
from mbd.decoding.state import BatchBuffers, Request, RequestParams
from mbd.decoding.trace import step_entry
from mbd.decoding.validate import EngineLimits, Params, resolve_params, validate_constraint, validate_request
from mbd.detokenize import TextStream
from mbd.tokenizer import Tokenizer

__all__ = ["Engine", "EngineStats", "GenerationResult", "StepOutput"]

NO_DISTRIBUTION = ("no valid distribution at a decoding position: the model's logits there are not finite or "
                   "every token is excluded; this request ends, the others go on")


class Engine:
    def __init__(self, model: nn.Module, tokenizer: Tokenizer | None, decode: DecodeConfig,
                 engine: EngineConfig | None = None):
        """model: on its device and in its dtype unless `engine` names others; tokenizer: None decodes ids only
        (stop token: the model's eos); decode: the default (and bounding) decoding parameters of requests."""
        engine = engine or EngineConfig()
        mcfg = model.cfg
        self.block = mcfg.block_size
        if decode.block_size not in (None, self.block):
            raise ConfigError(f"decode config block_size={decode.block_size} but the model was trained with "
                              f"block_size={self.block}: remove block_size or set it to {self.block}")
        weight = next(model.parameters())
        self.device = engine.torch_device(weight.device)
        self.model = model.to(self.device, engine.torch_dtype(weight.dtype)).eval()
        self.tokenizer, self.cfg, self.engine_cfg = tokenizer, decode, engine
        self.n_buf = decode.buffer_size
        self.max_length = min(decode.max_length, mcfg.max_position_embeddings)
        self.mask_id = mcfg.mask_token_id
        stops = tokenizer.stop_token_ids if tokenizer is not None else mcfg.eos_token_ids
        self._stop_set = frozenset(stops)
        self.policy = policy_for(decode.strategy)(self.block, self.mask_id)
        self.buf = BatchBuffers(engine.max_batch_rows, self.n_buf, self.block, self.mask_id, self.device)
        # the last block may straddle the generation limit, hence + block
        self.runner = ModelRunner(self.model, self.buf, self.policy, engine, self.max_length + self.block)
        self.kv = CacheManager(self.runner.cache, engine.prefix_caching)
        self.stats = EngineStats()
        self.scheduler = Scheduler(self.kv, self.buf, engine.batch_buckets, engine.prefill_budget, self.stats)
        self.warmup_s = self.runner.warmup(self.scheduler.buckets)  # compile and capture every shape before serving
        self.limits = EngineLimits(mcfg.vocab_size, self.mask_id, self.block, self.n_buf, decode.strategy,
                                   self.max_length, self.kv.page, self.kv.capacity)

    # ----------------------------------------------------------------- requests
    def resolve_params(self, params: Params) -> DecodeConfig:
        """A request's DecodeConfig: the engine's, a full DecodeConfig, or a mapping of overrides."""
        return resolve_params(params, self.cfg, self.limits)

    def check_request(self, prompt_ids: Sequence[int], params: Params = None, constraint: ConstraintSpec | None = None
                      ) -> tuple[list[int], RequestParams]:
        """The one request check (`mbd.decoding.validate`) against this engine's limits: what `add_request` and
        `generate` do before they admit a request, and what the HTTP ingress does against the limits its replica
        reports. Raises RequestError naming the field; a constraint that cannot be honoured raises ConstraintError
        (a ValueError naming its field)."""
        ids, p = validate_request(prompt_ids, params, self.cfg, self.limits)
        self.compile_constraint(constraint)
        return ids, p

    def compile_constraint(self, constraint: ConstraintSpec | None) -> None:
        """A constraint compiled once, with the engine's one GrammarVocab (which caches it for the request's
        matcher); ConstraintError (or RequestError without a tokenizer) naming its field."""
        validate_constraint(constraint, self.guide().vocab if constraint is not None and self.tokenizer else None)

    def guide(self) -> Guide:
        """Structured output's side of the policy (mbd.decoding.guided), over this model's vocabulary."""
        if self.runner.guide is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer (tokenizer.json)")
            vocab = GrammarVocab(self.tokenizer.tok, self.model.cfg.vocab_size, sorted(self._stop_set))
            self.runner.guide = Guide(vocab, self.block, self.mask_id)
        return self.runner.guide

    def add_request(self, prompt_ids: list[int], params: Params = None, request_id: str | None = None,
                    constraint: ConstraintSpec | None = None, resumed: resume.Resume | None = None) -> str:
        """Check a request (`check_request`) and queue it; `constraint`: structured output (what it may commit);
        `resumed`: go on from where another engine's stream of it stands (`mbd.decoding.resume`)."""
        return self._add(prompt_ids, params, request_id, constraint, resumed).id

    def _add(self, prompt_ids: Sequence[int], params: Params, request_id: str | None,
             constraint: ConstraintSpec | None = None, resumed: resume.Resume | None = None) -> Request:
        ids, p = validate_request(prompt_ids, params, self.cfg, self.limits)
        return self.admit(ids, p, request_id, constraint, resumed)

    def admit(self, ids: list[int], p: RequestParams, request_id: str | None = None,
              constraint: ConstraintSpec | None = None, resumed: resume.Resume | None = None) -> Request:
        """Queue a CHECKED request: `validate_request`'s prompt ids and parameters against this engine's limits
        (a served engine's come from the ingress, which checked them against the limits its replica reported;
        a re-admitted one carries the same). Nothing is checked again; a constraint is compiled here, once."""
        self.compile_constraint(constraint)
        req = Request(request_id or uuid.uuid4().hex, ids, p, self.block,
                      semi_max_masked=self.policy.semi_max_masked(p.tau_semi))
        if constraint is not None:
            self.guide().start(req, constraint)
        if self.engine_cfg.trace:
            req.trace = []
        if p.temperature > 0:
            req.generator = torch.Generator(device=self.device).manual_seed(p.seed)
        if p.logprobs:
            req.logprobs = {}
            req.top_logprobs = {} if p.top_logprobs else None
        if resumed is not None:
            resume.apply(req, resumed, self.block)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request; its row is freed (and an "abort" output emitted) next step."""
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def num_free_rows(self) -> int:
        return self.scheduler.num_free_rows()

    # ----------------------------------------------------------------- the step: schedule -> run -> postprocess
    def step(self) -> list[StepOutput]:
        """Schedule (admit, map pages, preempt), prefill whole prompts when no row is decoding, then one decode
        forward whose rows are postprocessed on the host. While rows decode, prompts are prefilled in
        block-aligned chunks of at most `prefill_budget` tokens that ride in the decode forward, so admitting
        a long prompt never stalls decoding."""
        with torch.inference_mode():
            plan = self.scheduler.schedule()
            outs = [self._finish(req, "abort", []) for req in plan.aborted]
            for req in plan.prefill:
                self._prefill(req)
            if self.scheduler.running:
                t0 = time.perf_counter()
                batch = self.runner.fit(self.scheduler.decode_batch())
                outs += self.postprocess(batch, self.runner.run(batch), t0)
        return outs

    def _prefill(self, req: Request) -> None:
        t = time.perf_counter()
        self.runner.prefill(req.row, req.known[req.committed: req.aligned_len], req.committed)
        self.stats.prefills += 1
        self.stats.prefill_tokens += req.aligned_len - req.committed
        self.scheduler.activate(req)
        self.stats.prefill_s += time.perf_counter() - t

    def postprocess(self, batch: DecodeBatch, rows: dict[int, RowOutput], t0: float) -> list[StepOutput]:
        """The host half of a step: commit the prompt chunks that rode along, then each decoding request's
        bookkeeping (`_advance`); finished requests free their rows and pages."""
        self.scheduler.commit_chunks(batch)
        B = self.block
        self.stats.positions_run += self.runner.step_positions
        self.stats.resident_positions += B * sum(r.n_res for r in batch.requests)
        self.stats.decode_rows += len(batch.requests)
        self.stats.active_blocks += sum(r.n_res - r.n_tc for r in batch.requests)
        self.stats.logit_rows += batch.rows * batch.active * B
        outs = [self._advance(req, rows[req.row], batch.slots) for req in batch.requests]
        for req in batch.requests:
            if req.finished:
                self.scheduler.release(req.row)
        dt = time.perf_counter() - t0
        for req in batch.requests:
            req.step_time_s += dt
        self.stats.steps += 1
        self.stats.step_s += dt
        if self.runner.guide is not None:
            self.stats.grammar_s, self.runner.guide.seconds = self.stats.grammar_s + self.runner.guide.seconds, 0.0
        return outs

    def _advance(self, req: Request, out: RowOutput, slots: int) -> StepOutput:
        """One request after a forward: which slots became final (emitted), commit the re-run TO_CACHE slots,
        then the policy's plan (finish, activate the next slot)."""
        B = self.block
        if out.failed:
            req.nfe += 1
            req.n_res = req.n_tc = 0
            return self._finish(req, "error", [], NO_DISTRIBUTION)
        filled, unchanged = self.policy.counts(out.masked_in, out.accepted, out.revised, out.confident)
        if out.fix is not None:
            filled, unchanged = merge_counts(out.fix, filled, unchanged)
        if req.trace is not None:  # skipped DUMMY slots: all masks
            req.trace.append(step_entry(out.states, out.masked_in + [B] * (self.n_buf - slots), req.committed, B))
        req.nfe += 1
        base, n_res, pre_tc, toks = req.committed, req.n_res, req.n_tc, out.tokens
        if req.logprobs is not None and out.conf is not None:
            req.logprobs.update((base + i, math.log(c)) for i, c in enumerate(out.conf[:n_res * B]) if c > 0)
            if req.top_logprobs is not None and out.top is not None:
                req.top_logprobs.update((base + q, top[: req.params.top_logprobs])
                                        for q, top in out.top if out.conf[q] > 0)
        post_tc = self.policy.final_count(req.params, pre_tc, n_res, filled, unchanged)
        new = self._emit(req, toks, base, pre_tc, post_tc)
        if base + post_tc * B > len(req.known):
            req.known += toks[len(req.known) - base: post_tc * B]
        eos_seen = req.eos or (not req.params.ignore_eos
                               and not self._stop_set.isdisjoint(toks[max(0, req.prompt_len - base): n_res * B]))
        if pre_tc:
            self.scheduler.commit(req, pre_tc * B)
        plan = self.policy.plan(req.params, n_res=n_res, pre_tc=pre_tc, post_tc=post_tc,
                                filled_last=filled[n_res - 1], unchanged_last=unchanged[n_res - 1],
                                eos_seen=eos_seen, nfe=req.nfe, committed=req.committed)
        req.n_res, req.n_tc = n_res - pre_tc + plan.activate, post_tc - pre_tc
        if plan.finish is None:
            # none once the output ended (a stop token, the length limit) while its last blocks are stored
            whole = new and len(req.known) == req.prompt_len + len(req.output)
            ckpt = resume.take(req, toks[pre_tc * B: n_res * B]) if whole else None
            return StepOutput(req.id, new, False, None, req.nfe, req.num_generated, self._logprobs(req, new),
                              self._top(req, new), req.cached_tokens or 0,
                              self._provisional(req, toks, base, post_tc, n_res), checkpoint=ckpt)
        if plan.finish == "max_nfe":
            new = new + self._emit_partial(req, toks, base, post_tc, n_res)
        req.n_res = req.n_tc = 0
        return self._finish(req, plan.finish if plan.finish == "max_nfe" else ("eos" if req.eos else "length"), new)

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

    def _finish(self, req: Request, reason: str, new: list[int], error: str | None = None) -> StepOutput:
        req.finish_reason = reason
        req.t_finished = time.perf_counter()
        self.scheduler.finish(req)
        return StepOutput(req.id, new, True, reason, req.nfe, req.num_generated, self._logprobs(req, new),
                          self._top(req, new), req.cached_tokens or 0, error=error)

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
