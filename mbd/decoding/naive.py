"""Naive dynamic MultiBD (alg:naive_multibd), the reference the Block Buffer engine must agree with.

One request at a time; the running-set is materialised as a [1, |R_s| * B] input whose length changes
every time a block is appended or committed (exactly what prevents CUDA Graphs). It makes the same
decisions through the same `Policy`, bounded by the request's buffer_size, and has the same cache
semantics: a TO_CACHE block is re-run in the next forward, whose K/V are then committed. With
`recompute=True` it uses no KV cache at all and runs the whole sequence every step (the reference for
"KV-cached decoding equals full recomputation").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from mbd.config import DecodeConfig
from mbd.decoding.policy import ACTIVE, TO_CACHE, Sampler, policy_for
from mbd.decoding.state import RequestParams
from mbd.model import KVCache
from mbd.model.attention import Cached, Masked
from mbd.model.masks import block_causal_dense


@dataclass
class ReferenceResult:
    token_ids: list[int]
    nfe: int
    finish_reason: str
    num_generated: int
    active_counts: list[int] = field(default_factory=list)  # ACTIVE slots in each forward


class Reference:
    """Shared setup of the single-request references: params, policy, prefill, forward, output cut."""

    def __init__(self, model: nn.Module, cfg: DecodeConfig, stop_ids: Sequence[int], recompute: bool = False):
        self.model, self.cfg, self.recompute = model.eval(), cfg, recompute
        mcfg = model.cfg
        self.mcfg, self.block, self.mask_id = mcfg, mcfg.block_size, mcfg.mask_token_id
        self.max_length = min(cfg.max_length, mcfg.max_position_embeddings)
        self.policy = policy_for(cfg.strategy)(self.block, self.mask_id)
        self.stop_ids = set(stop_ids)
        self.device = next(model.parameters()).device
        self.merge: torch.Tensor | None = None  # DMax token merge weights of the running tokens (`update`)

    def start(self, prompt: list[int]) -> tuple[RequestParams, list[int], KVCache | None, torch.Tensor]:
        """Prefill the block-aligned prompt part; the first block holds the prompt tail then masks."""
        p = RequestParams.resolve(self.cfg, len(prompt), self.max_length)
        aligned = len(prompt) // self.block * self.block
        cache = None
        if not self.recompute:
            cache = KVCache(self.mcfg, 1, self.max_length + self.block, margin=p.buffer_size * self.block,
                            dtype=next(self.model.parameters()).dtype, device=self.device)
            if aligned:
                self.forward(prompt[:aligned], [], cache)
                cache.commit(0, aligned)
        tail = prompt[aligned:]
        first = torch.tensor([tail + [self.mask_id] * (self.block - len(tail))], device=self.device)
        return p, prompt[:aligned], cache, first

    def forward(self, committed: list[int], running: list[int] | torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """Logits of the `running` tokens placed after `committed` (with a cache: `committed` is in it)."""
        ids = torch.as_tensor(running, device=self.device).view(1, -1) if len(running) else None
        L = len(committed)
        conf = self.merge if ids is not None and self.merge is not None else None
        if cache is None:
            head = torch.tensor(committed, device=self.device, dtype=torch.long).view(1, -1)
            full = head if ids is None else torch.cat([head, ids], 1)
            pos = torch.arange(full.shape[1], device=self.device)[None]
            mask = block_causal_dense(pos, full.shape[1], torch.tensor([full.shape[1]], device=self.device), self.block)
            if conf is not None:
                conf = torch.cat([torch.ones(1, L, device=self.device), conf], 1)
            return self.model(full, pos, Masked(mask), token_conf=conf)[:, L:]
        if ids is None:  # prefill: `committed` is the input
            ids, L = torch.tensor(committed, device=self.device)[None], 0
        pos = torch.arange(L, L + ids.shape[1], device=self.device)[None]
        mask = block_causal_dense(pos, cache.size, torch.tensor([L + ids.shape[1]], device=self.device), self.block)
        return self.model(ids, pos, Cached(cache, mask, pos), token_conf=conf)

    def update(self, p: RequestParams, logits, tokens, n_tc: int, first_pos: int, prompt_len: int, gen):
        """One policy update of a running-set of n = tokens.shape[1] / B blocks (the first n_tc TO_CACHE).
        Returns the new tokens, the TO_CACHE count, the (filled, unchanged) counts of the last block and
        whether a stop token is among the generated tokens."""
        dev, n = self.device, tokens.shape[1] // self.block
        state = torch.tensor([[TO_CACHE] * n_tc + [ACTIVE] * (n - n_tc)], device=dev)
        fixed = (torch.arange(tokens.shape[1], device=dev) + first_pos < prompt_len)[None]
        t2t = torch.tensor([[p.tau_t2t]], device=dev) if p.tau_t2t is not None else None
        samplers = [Sampler(0, p.temperature, gen, p.top_p, p.top_k)] if gen is not None else []
        dec = self.policy.update(logits, tokens, state, torch.tensor([[[p.tau_m2t]]], device=dev),
                                 torch.tensor([[self.policy.semi_max_masked(p.tau_semi)]], device=dev), fixed, t2t, samplers)
        row = [None if x is None else x[0].tolist() for x in (dec.revised, dec.confident)]
        filled, unchanged = self.policy.counts(dec.masked_in[0].tolist(), dec.accepted[0].tolist(), *row)
        post_tc = self.policy.final_count(p, n_tc, n, filled, unchanged)
        if self.policy.token_merge:  # a token M2T filled now enters the next forward soft (DMax)
            self.merge = torch.where((tokens == self.mask_id) & (dec.tokens != self.mask_id), dec.conf.float(), 1.0)
        ids = dec.tokens[0].tolist()
        stop = any(t in self.stop_ids for t, f in zip(ids, fixed[0].tolist()) if not f)
        return dec.tokens, post_tc, filled[-1], unchanged[-1], stop

    def generator(self, p: RequestParams) -> torch.Generator | None:
        return torch.Generator(device=self.device).manual_seed(p.seed) if p.temperature > 0 else None

    def finalize(self, p: RequestParams, all_ids: list[int], prompt_len: int, nfe: int, finish: str,
                 active_counts: list[int]) -> ReferenceResult:
        gen = all_ids[prompt_len: p.gen_end]
        if finish == "max_nfe" and self.mask_id in gen:
            gen = gen[: gen.index(self.mask_id)]
        eos = next((i for i, t in enumerate(gen) if t in self.stop_ids), None)
        if eos is not None:
            gen = gen[:eos]
        reason = finish if finish == "max_nfe" else ("eos" if eos is not None else "length")
        return ReferenceResult(gen, nfe, reason, len(gen), active_counts)

    def stop_in(self, ids: list[int], first_pos: int, prompt_len: int, gen_end: int) -> bool:
        return any(t in self.stop_ids for i, t in enumerate(ids) if prompt_len <= first_pos + i < gen_end)


class NaiveMultiBD(Reference):
    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int]) -> ReferenceResult:
        prompt = list(prompt_ids)
        B, dev = self.block, self.device
        p, committed, cache, running = self.start(prompt)  # running: the running-set R_s
        gen = self.generator(p)
        n_tc, nfe, eos_committed, active_counts = 0, 0, False, []
        while True:
            n = running.shape[1] // B
            logits = self.forward(committed, running, cache)
            nfe += 1
            active_counts.append(n - n_tc)
            first_pos = len(committed)
            running, post_tc, filled, unchanged, stop = self.update(p, logits, running, n_tc, first_pos, len(prompt), gen)
            if n_tc:  # this forward re-ran them: commit and drop them from the running-set
                done_ids = running[0, : n_tc * B].tolist()
                eos_committed |= self.stop_in(done_ids, first_pos, len(prompt), p.gen_end)
                committed = committed + done_ids
                running = running[:, n_tc * B:]
                if cache is not None:
                    cache.commit(0, n_tc * B)
            plan = self.policy.plan(p, n_res=n, pre_tc=n_tc, post_tc=post_tc, filled_last=filled,
                                    unchanged_last=unchanged, eos_seen=eos_committed or stop, nfe=nfe,
                                    committed=len(committed))
            if plan.finish is not None:
                return self.finalize(p, committed + running[0].tolist(), len(prompt), nfe, plan.finish, active_counts)
            n_tc = post_tc - n_tc
            if plan.activate:  # grow the running-set: the input gets longer
                running = torch.cat([running, torch.full((1, B), self.mask_id, device=dev)], 1)
