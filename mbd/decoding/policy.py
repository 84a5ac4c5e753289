"""The MultiBD decision rules, shared by the Block Buffer engine and the SingleBD / naive references.

`update` is the per-forward part (M2T acceptance, T2T revision), vectorised over [rows, slots, block] so
that it costs the same few tensor ops for any batch and reduces each slot to counts (masked, accepted,
revised); `counts`, `final_count` (TO_CACHE marking) and `plan` (finish, activation) are the per-request
host part, plain integer arithmetic on those counts.

Exact semantics. Progress and stability pass their thresholds as alg:optimized_multibd writes them, strictly
(`passes`: x > tau), with one stated rule: a complete block (progress 1) or a fully stable one (stability 1)
passes a threshold of 1.0, the only reading under which tau = 1.0 does not switch the rule off. The authors'
Diffulex (mbd-lms branch, `DllmBlock.is_semi_complete` / `should_add_block`) tests >= everywhere, which agrees
at 1.0 and differs only where x equals tau (at B = 4, tau_add 0.5 activates at 2 of 4 tokens there, here at 3;
docs/fidelity.md).
- progress(b) = non-mask tokens / B (prompt-tail tokens count); stability(b) = tokens that were already
  filled BEFORE this step and that this step left unchanged / tokens filled before this step (1 when none was
  filled), as the authors' Diffulex `same_token_ratio`: tokens M2T fills in this very step are not
  counted as unstable, so a block that fills in one step can still trigger the next one.
- M2T: in each ACTIVE slot accept masked positions with confidence > tau_m2t, where confidence is the
  probability of the predicted token (greedy: the max probability; sampling: the sampled token's probability
  under the tempered distribution). If none is accepted and the preceding slot is semi-complete
  (progress passes tau_semi, measured on the tokens the model just saw) or the slot is the first resident one,
  accept the single most confident masked position. The mask token's logit is -inf, so it is never produced.
- T2T (tau_t2t set): filled, non-prompt positions of ACTIVE slots whose prediction differs from the current
  token with confidence > tau_t2t are replaced (positions accepted by M2T this step are not revised).
- Complete: no mask left (with T2T also unchanged by this step). A complete ACTIVE slot whose preceding
  resident slots are all TO_CACHE (or complete in this same step) becomes TO_CACHE: its tokens are final.
- Activation (at most one per step): if no resident block is left, the next block starts; otherwise the
  next DUMMY slot is activated when the last resident block's progress passes tau_add and its stability
  passes tau_stable (if set), no stop token is in the buffer or output, a DUMMY slot is free within the request's
  buffer_size, and the block starts before the generation limit.
- Finish: all resident blocks complete and (a stop token was generated or the next block would start past
  the generation limit), once the forward that stores the last of them has run (and counted), as the authors'
  engine does: a request ends when its last block is IN_CACHE, not when it is TO_CACHE. A request that reaches
  max_nfe before that store forward ends without it; otherwise after max_nfe forwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from mbd.decoding.state import RequestParams, SlotState

ACTIVE, TO_CACHE = int(SlotState.ACTIVE), int(SlotState.TO_CACHE)


@dataclass
class Decision:
    """New tokens and per-slot counts; `counts` turns the counts into (filled, unchanged) on the host."""

    tokens: torch.Tensor  # [R, Q] after M2T / T2T
    masked_in: torch.Tensor  # [R, S] mask tokens the model saw (trace: the slot's mask ratio * B)
    accepted: torch.Tensor  # [R, S] masked positions filled by M2T
    revised: torch.Tensor | None  # [R, S] positions replaced by T2T (None: T2T off in the whole batch)
    conf: torch.Tensor | None = None  # [R, Q] probability of each position's prediction (see `predict`)
    confident: torch.Tensor | None = None  # [R, S] 1 where every position was confident (DMax's early commit)
    failed: torch.Tensor | None = None  # [R, 1] 1 where an ACTIVE position had no valid distribution (`predict`)


class Kept(NamedTuple):
    """Of a slot's tokens filled before a step (`prefilled`), those the step left unchanged (`kept`);
    `confident`: every position was confident (DMax's early commit, see `DMaxPolicy`)."""

    kept: int
    prefilled: int
    confident: bool = False

    @property
    def stability(self) -> float:
        return self.kept / self.prefilled if self.prefilled else 1.0


@dataclass(frozen=True)
class Plan:
    finish: str | None  # None, "done" (eos or length: the caller tells which from the output) or "max_nfe"
    activate: bool


@dataclass
class Sampler:
    """Temperature sampling for one row, reproducible from the request's seed whatever the batch holds,
    optionally restricted to the top_k most likely tokens (0: all) and then to the smallest set whose
    probability reaches top_p (1.0: all), as in vLLM. The sampled token's confidence is its probability
    under that restricted, renormalised distribution."""

    row: int
    temperature: float
    generator: torch.Generator
    top_p: float = 1.0
    top_k: int = 0

    def step_generator(self) -> torch.Generator:
        """A generator for this step's draws, seeded by ONE draw from the request's generator: the forward
        covers as many positions as the fullest row of the batch has, and positions past the request's own
        must not consume its random stream (else its samples would depend on what else is batched)."""
        seed = int(torch.randint(0, 2**62, (1,), generator=self.generator, device=self.generator.device))
        return torch.Generator(device=self.generator.device).manual_seed(seed)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[Q, V] logits -> the distribution this row samples from: a valid one for every setting the schema
        admits (temperature 0 < t <= max, even denormal; top_p in (0, 1], even denormal; any top_k), because
        the row's best token always keeps its mass. Only a position with no finite logit at all (a grammar or
        a model that left nothing) has none: its row is zeros, and `Policy.predict` fails that request."""
        z = logits.float()
        ok = torch.isfinite(z)  # -inf: the mask token or a grammar's ban; NaN / +inf: a broken forward
        z = torch.where(ok, z, float("-inf"))
        top = z.amax(-1, keepdim=True)
        # shifted so the best token sits at 0: a temperature that underflows float32 (0) or overflows it (inf)
        # then gives -inf / -0 for the others and exactly 0 for the best, never 0/0
        gap = (z - top).clamp_min(torch.finfo(z.dtype).min)  # <= 0 and finite where allowed (not -inf)
        z = torch.where(z == top, 0.0, gap / self.temperature)
        z = torch.where(ok, z, float("-inf"))
        if 0 < self.top_k < z.shape[-1]:
            kth = z.topk(self.top_k, -1).values[:, -1:]
            z = z.masked_fill(z < kth, float("-inf"))
        p = torch.where(ok.any(-1, keepdim=True), z.softmax(-1), 0.0)
        if self.top_p < 1.0:
            sp, idx = p.sort(-1, descending=True)
            drop = (sp.cumsum(-1) - sp) >= self.top_p  # mass before a token already reaches top_p
            drop[:, 0] = False  # the most probable token is always kept (a top_p that rounds to 0 keeps it alone)
            p = p.scatter(-1, idx, sp.masked_fill(drop, 0.0))
            p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
        return p


class Policy:
    token_merge = False  # DMax's soft input for just-filled tokens (`DMaxPolicy`)

    def __init__(self, block_size: int, mask_token_id: int):
        self.block = block_size
        self.mask_id = mask_token_id
        self._pos_in_block: dict[torch.device, torch.Tensor] = {}

    def semi_max_masked(self, tau_semi: float) -> int:
        """Most mask tokens a block may hold and still be semi-complete (its progress `passes` tau_semi),
        computed with the same float arithmetic as every other progress test; -1 if no block qualifies."""
        return max((m for m in range(self.block + 1) if passes((self.block - m) / self.block, tau_semi)), default=-1)

    def update(self, logits: torch.Tensor, tokens: torch.Tensor, state: torch.Tensor, tau_m2t: torch.Tensor,
               semi_max_masked: torch.Tensor, fixed: torch.Tensor | None = None, tau_t2t: torch.Tensor | None = None,
               samplers: list[Sampler] = ()) -> Decision:
        """Token updates of one forward. logits [R,Q,V] over tokens [R,Q] in slots with `state` [R,S];
        tau_m2t [R,1,1]; semi_max_masked [R,1] (see `semi_max_masked`); fixed [R,Q] marks prompt tokens
        (None: none resident); tau_t2t [R,1] (> 1 disables a row) or None. Few, batch-wide tensor ops:
        on CPU their count, not their size, is the engine's overhead. `logits` is modified in place."""
        R, Q, _ = logits.shape
        S, B = state.shape[1], self.block
        conf, x0 = self.predict(logits, samplers)

        masked = tokens.view(R, S, B) == self.mask_id
        active = (state == ACTIVE).unsqueeze(-1)
        score = torch.where(masked & active, conf.view(R, S, B), -1.0)  # -1: not a candidate
        accept = score > tau_m2t
        top, best = score.max(-1, keepdim=True)
        masked_in = masked.sum(-1)
        # the preceding slot is semi-complete (the first slot has none: padded with 0 masks)
        semi = F.pad(masked_in[:, :-1], (1, 0)) <= semi_max_masked
        # fallback: a candidate exists (top >= 0), none passed tau_m2t (top <= tau), context semi-complete
        need = (top >= 0) & (top <= tau_m2t) & semi.unsqueeze(-1)
        accept |= (self._arange(best.device) == best) & need
        new = torch.where(accept.view(R, Q), x0, tokens)
        revised = None
        if tau_t2t is not None:
            revise = (~masked & active).view(R, Q) & (x0 != tokens) & (conf > tau_t2t)
            if fixed is not None:
                revise &= ~fixed
            new = torch.where(revise, x0, new)
            revised = revise.view(R, S, B).sum(-1)
        return Decision(new, masked_in, accept.sum(-1), revised, conf, failed=_failed(conf, active))

    def predict(self, logits: torch.Tensor, samplers: list[Sampler] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """(confidence, predicted token) [R, Q] of every position; the mask token is never predicted
        (`logits` is modified in place). A position with no valid distribution (no finite logit, or its
        sampler failed) has confidence NaN: `update` reports its row as failed rather than the step dying."""
        logits.select(-1, self.mask_id).fill_(float("-inf"))
        conf, x0 = logits.float().softmax(-1).max(-1)
        for s in samplers:
            try:
                p = s.probs(logits[s.row])
                empty = p.sum(-1) == 0
                x = torch.multinomial(p.masked_fill(empty[:, None], 1.0), 1, generator=s.step_generator())
                x0[s.row] = x[:, 0]
                conf[s.row] = p.gather(1, x)[:, 0].masked_fill(empty, float("nan"))
            except RuntimeError:  # one request's sampling is that request's error, never the engine's
                conf[s.row] = float("nan")
        return conf, x0

    def counts(self, masked_in: list[int], accepted: list[int], revised: list[int] | None,
               confident: list[int] | None = None) -> tuple[list[int], list[Kept]]:
        """Per slot: filled = non-mask tokens after the update; unchanged = the tokens filled before the
        update that it left alone, out of those (M2T only fills masks, T2T only replaces filled tokens)."""
        B = self.block
        filled = [B - m + a for m, a in zip(masked_in, accepted)]
        revised = revised if revised is not None else [0] * len(masked_in)
        return filled, [Kept(B - m - r, B - m) for m, r in zip(masked_in, revised)]

    def final_count(self, p: RequestParams, n_tc: int, n_res: int, filled: list[int], unchanged: list[Kept]) -> int:
        """TO_CACHE slots after an update: the TO_CACHE prefix extended by the complete ACTIVE slots that
        follow it (complete = no mask; with T2T also no token changed, i.e. all B filled before and kept)."""
        k = n_tc
        while k < n_res and filled[k] == self.block and (p.tau_t2t is None or unchanged[k].kept == self.block):
            k += 1
        return k

    def plan(self, p: RequestParams, *, n_res: int, pre_tc: int, post_tc: int, filled_last: int,
             unchanged_last: Kept, eos_seen: bool, nfe: int, committed: int) -> Plan:
        """Host decisions after a forward. n_res / pre_tc: resident / TO_CACHE slots at forward time
        (the pre_tc ones are committed by this forward); post_tc: TO_CACHE slots after the update;
        filled_last / unchanged_last: counts of the last resident slot (see `counts`); committed: committed
        length after this step's commit."""
        left = n_res - pre_tc
        allowed = committed + left * self.block < p.gen_end
        if post_tc == n_res and (eos_seen or not allowed):  # every block is final: done once they are stored
            return Plan("done" if left == 0 or nfe >= p.max_nfe else None, False)
        if nfe >= p.max_nfe:
            return Plan("max_nfe", False)
        if eos_seen or not allowed or left >= p.buffer_size:
            return Plan(None, False)
        if left == 0:
            return Plan(None, True)
        if p.tau_add is None or not passes(filled_last / self.block, p.tau_add):
            return Plan(None, False)
        return Plan(None, p.tau_stable is None or passes(unchanged_last.stability, p.tau_stable))

    def _arange(self, device: torch.device) -> torch.Tensor:
        if device not in self._pos_in_block:
            self._pos_in_block[device] = torch.arange(self.block, device=device)
        return self._pos_in_block[device]


class DMaxPolicy(Policy):
    """DMax's native SingleBD decoding (`DecodeConfig.strategy: dmax`, the DMax "SingleBD (Native)" rows),
    written from the rules of the authors' Diffulex `LLaDA2DMaxSampler` (mbd-lms branch):

    - M2T: the masked positions of the ACTIVE block are taken in position order and the leading run whose
      confidence is >= tau_m2t is filled (note >=, not >); if the first masked position is below tau_m2t it
      alone is filled, so every step fills at least one token. No semi-complete rule (one block).
    - T2T: filled, non-prompt positions whose prediction differs are replaced when confidence > tau_t2t;
      DMax revises them all (its configs: tau_t2t 0).
    - Final: no mask left and either nothing changed in this step, or every position is confident
      (>= DMAX_CONFIDENT; positions filled before the step count as confident, as DMax's fast path does),
      so a block whose masks were all filled confidently commits in the same step.

    The all-confident flag is one more per-slot count (`Decision.confident`), read by `counts`.

    Token merge (`token_merge`): a token M2T filled in a step enters the next forward as the confidence-weighted
    mix of its embedding and the mask embedding (`mbd.model.base.merge_embeddings`, weight = the confidence it was
    accepted with); every other position (revised or older tokens, masks, the prompt) enters as itself, as the
    authors' fast path gives those confidence 1. The weights live in `BatchBuffers.token_conf`."""

    DMAX_CONFIDENT = 0.9
    token_merge = True

    def update(self, logits: torch.Tensor, tokens: torch.Tensor, state: torch.Tensor, tau_m2t: torch.Tensor,
               semi_max_masked: torch.Tensor, fixed: torch.Tensor | None = None, tau_t2t: torch.Tensor | None = None,
               samplers: list[Sampler] = ()) -> Decision:
        if tau_t2t is None:
            raise ValueError("strategy dmax needs tau_t2t (DMax revises every changed token: tau_t2t 0)")
        R, Q, _ = logits.shape
        S, B = state.shape[1], self.block
        conf, x0 = self.predict(logits, samplers)
        c = conf.view(R, S, B)
        masked = tokens.view(R, S, B) == self.mask_id
        cand = masked & (state == ACTIVE).unsqueeze(-1)
        before_low = torch.cumsum(cand & (c < tau_m2t), -1) == 0  # positions before the first low-confidence mask
        accept = cand & before_low
        first = cand & (torch.cumsum(cand.int(), -1) == 1)
        accept |= first & ~accept.any(-1, keepdim=True)
        new = torch.where(accept.view(R, Q), x0, tokens)
        revise = (~masked & (state == ACTIVE).unsqueeze(-1)).view(R, Q) & (x0 != tokens) & (conf > tau_t2t)
        if fixed is not None:
            revise &= ~fixed
        new = torch.where(revise, x0, new)
        confident = torch.where(masked, c, 1.0).ge(self.DMAX_CONFIDENT).all(-1).long()
        return Decision(new, masked.sum(-1), accept.sum(-1), revise.view(R, S, B).sum(-1), conf, confident,
                        _failed(conf, (state == ACTIVE).unsqueeze(-1)))

    def counts(self, masked_in: list[int], accepted: list[int], revised: list[int] | None,
               confident: list[int] | None = None) -> tuple[list[int], list[Kept]]:
        if revised is None or confident is None:
            raise ValueError("strategy dmax needs its revised counts and confidence flags (tau_t2t set)")
        B = self.block
        filled = [B - m + a for m, a in zip(masked_in, accepted)]
        return filled, [Kept(B - m - v, B - m, c == 1) for m, v, c in zip(masked_in, revised, confident)]

    def final_count(self, p: RequestParams, n_tc: int, n_res: int, filled: list[int], unchanged: list[Kept]) -> int:
        k = n_tc
        while k < n_res and filled[k] == self.block and (unchanged[k].kept == self.block or unchanged[k].confident):
            k += 1
        return k


def passes(x: float, tau: float) -> bool:
    """alg:optimized_multibd's `x > tau` for a progress or stability x in [0, 1]; x = 1 also passes tau = 1.0
    (a complete or fully stable block), so that 1.0 means "complete" rather than "never"."""
    return x > tau or x == 1.0 == tau


def _failed(conf: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """[R, 1]: rows with a NaN confidence (no valid distribution) at a position of an ACTIVE slot."""
    R, S = active.shape[:2]
    return (conf.isnan().view(R, S, -1) & active).flatten(1).any(-1, keepdim=True)


def policy_for(strategy: str) -> type[Policy]:
    """The decision rules of a `DecodeConfig.strategy`."""
    return {"block_buffer": Policy, "dmax": DMaxPolicy}[strategy]
