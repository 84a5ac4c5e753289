"""The policy's grammar side for a batch: what constrained rows may commit (see `constraints` for the rule);
`runner.run` calls it around the policy's update, `Engine._advance` takes the recounted counts.

Around the policy's per-step decision, for the rows whose request carries a grammar matcher:
- `before` (after the forward, before the decision): masks the logits at each row's frontier to what the
  grammar allows there, so that whenever the policy fills that position (by its own rules: forcing it every
  step cost the tiny model a quarter of its accuracy, docs/structured-output.md) the grammar decides the
  token; and returns the positions before each frontier, which T2T must not revise (`fixed`);
- `after` (after the step's one device-to-host transfer): walks each row's proposals from its frontier
  (`constraints.settle`), writes the rows it changed back into the device tokens (one indexed write), and
  recounts that row's per-slot filled / kept counts from its tokens before and after the step, so that TO_CACHE
  marking and activation see exactly what is left in the buffer.
Matcher time is summed into `seconds` (the matcher's share of step time).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mbd.decoding.constraints import ConstraintSpec, GrammarVocab, Matcher, mask_logits, new_bitmask, settle
from mbd.decoding.policy import Kept
from mbd.decoding.state import Request


@dataclass
class RowFix:
    """A constrained row after `after`: its tokens (slots [0, S)) and per-slot counts."""

    toks: list[int]
    filled: list[int]
    kept: list[Kept]


class Guide:
    def __init__(self, vocab: GrammarVocab, block: int, mask_id: int):
        self.vocab, self.block, self.mask_id = vocab, block, mask_id
        self.seconds = 0.0

    def start(self, req: Request, spec: ConstraintSpec) -> None:
        """Give a request its matcher; its frontier starts after the prompt."""
        req.grammar = self.vocab.matcher(spec)
        req.frontier = req.prompt_len

    def before(self, running: list[tuple[int, Request]], logits: torch.Tensor, pos: torch.Tensor, lo: list[int],
               prompt_len: torch.Tensor) -> torch.Tensor:
        """Mask `logits` [b, A*B, V] (window positions `pos` [b, A*B], absolute) at each constrained row's
        frontier, in place; `lo[row]`: the row's first window slot. Returns `fixed` [b, A*B]: positions before
        the row's frontier (before its prompt's end for a row without a grammar)."""
        t0 = time.perf_counter()
        width = pos.shape[1]
        rows, cols, fronts = [], [], []
        for row, req in running:
            if req.grammar is None:
                continue
            fronts.append((row, req.frontier))
            j = req.frontier - req.committed - lo[row] * self.block
            if 0 <= j < width:
                rows.append(row), cols.append(j)
        frontier = prompt_len.clone()
        if fronts:
            idx, val = zip(*fronts)
            frontier[list(idx)] = torch.tensor(val, device=frontier.device)
        if rows:
            bm = new_bitmask(len(rows), self.vocab.vocab_size)
            by_row = dict(running)
            for i, row in enumerate(rows):
                by_row[row].grammar.fill_mask(bm, i)
            self._stop_only_at_dead_ends(bm)
            r, c = torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)
            logits[r, c] = mask_logits(logits[r, c], bm.to(logits.device))
        self.seconds += time.perf_counter() - t0
        return pos < frontier[:, None]

    def _stop_only_at_dead_ends(self, bm: torch.Tensor) -> None:
        """A state from which the vocabulary cannot go on (no bit set) may only end: its output stops there,
        short of the grammar, rather than the step producing NaNs."""
        for i in torch.nonzero(~bm.any(1)).flatten().tolist():
            for t in self.vocab.stop_ids:
                bm[i, t // 32] |= 1 << (t % 32)

    def after(self, running: list[tuple[int, Request]], summary, slots: int, tokens: torch.Tensor) -> dict[int, RowFix]:
        """Settle every constrained row. The step's `StepSummary` holds each row's tokens after the policy
        ("tokens") and before it ("before"); rows it changes are rewritten there and in `tokens` [b, Q] (the device
        tokens, before the slide)."""
        t0 = time.perf_counter()
        B, q = self.block, slots * self.block
        fixes, rows, cols, vals = {}, [], [], []
        for row, req in running:
            if req.grammar is None:
                continue
            toks, old = summary.row(row, "tokens"), summary.row(row, "before")
            base = req.committed
            limit = min(req.n_res * B, req.params.gen_end - base)
            st = settle(req.grammar, toks, req.frontier - base, limit, self.mask_id)
            req.frontier = base + st.frontier
            for i in (i for i in range(q) if st.tokens[i] != toks[i]):
                rows.append(row), cols.append(i), vals.append(st.tokens[i])
            summary.set_row(row, "tokens", st.tokens)
            fixes[row] = RowFix(st.tokens, *self._recount(old, st.tokens, slots))
        if rows:
            dev = tokens.device
            tokens[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = torch.tensor(vals, device=dev)
        self.seconds += time.perf_counter() - t0
        return fixes

    def _recount(self, old: list[int], new: list[int], slots: int) -> tuple[list[int], list[Kept]]:
        """Per slot: filled = non-mask tokens now; kept = tokens filled before the step and unchanged by it."""
        B, m = self.block, self.mask_id
        filled, kept = [], []
        for s in range(slots):
            o, n = old[s * B:(s + 1) * B], new[s * B:(s + 1) * B]
            pre = sum(t != m for t in o)
            filled.append(sum(t != m for t in n))
            kept.append(Kept(sum(a != m and a == b for a, b in zip(o, n)), pre))
        return filled, kept


def merge_counts(fix: RowFix, filled: list[int], kept: list[Kept]) -> tuple[list[int], list[Kept]]:
    """A constrained row's counts: recounted ones, with the policy's all-confident flag (DMax) kept."""
    return fix.filled, [Kept(k.kept, k.prefilled, p.confident) for k, p in zip(fix.kept, kept)]


__all__ = ["Guide", "Matcher", "RowFix", "merge_counts"]
