"""Resuming a request on another engine exactly where its stream stands (issue #59: streams survive a restart).

A block diffusion decoder commits whole blocks, and the Block Buffer's later blocks depend on the earlier ones'
partial state, so a request cannot resume from its text alone and stay identical to an uninterrupted run. After
every step that emitted tokens to a request that goes on, the engine attaches a `Checkpoint` to that step's
output: the committed length, the resident buffer (as the next forward will see it), the slot counts, the NFE so
far and what the output's logprobs and grammar need. Nothing is emitted between two checkpoints, so an engine
restarted from the last one replays the steps after it: for greedy decoding the tokens that follow are exactly
those of an uninterrupted run (the same forwards on the same state), with sampling the committed text is kept and
the rest drawn afresh (a new generator from the request's seed). `apply` rebuilds the request as a preempted one
(`Scheduler._preempt`): its committed tokens are prefilled again (or found in the prefix cache) and its buffer
is put back. DMax's merge weights of resident tokens are not carried (restored as 1: the tokens themselves).

`usage` of a resumed request: prompt_tokens are the original prompt's, completion_tokens every token the client
got, cached_tokens the first admission's; nfe continues from the checkpoint (the replayed forwards count again).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine host builds `Resume`s and must not load torch
    from mbd.decoding.state import Request


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A request's engine state right after a step that emitted tokens (see the module docstring)."""

    committed: int  # tokens whose K/V are in the cache (block-aligned): prompt + output = committed + n_tc * B
    tokens: list[int]  # the resident slots' tokens, from position `committed` (what `restore_row` puts back)
    n_res: int
    n_tc: int
    nfe: int
    cached_tokens: int
    frontier: int = 0  # with a grammar: the first position its matcher has not accepted
    logprobs: dict[int, float] = field(default_factory=dict)  # of resident tokens not yet emitted
    top_logprobs: dict[int, list[tuple[int, float]]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Resume:
    """What a new engine needs to go on with a request: the tokens its client already got, and the checkpoint
    taken when the last of them was emitted."""

    output: list[int]
    checkpoint: Checkpoint


def take(req: Request, resident: list[int]) -> Checkpoint:
    """The checkpoint of `req` after `Engine._advance` updated it; `resident`: its buffer's tokens after the
    step's TO_CACHE slots were popped (a slot activated by this step is all masks: not listed)."""
    return Checkpoint(req.committed, resident, req.n_res, req.n_tc, req.nfe, req.cached_tokens or 0, req.frontier,
                      dict(req.logprobs or {}), dict(req.top_logprobs or {}))


def apply(req: Request, r: Resume, block: int) -> None:
    """Make a freshly built `req` the request `r` checkpointed: known tokens, counts, buffer and grammar.
    Raises ValueError when the checkpoint does not fit the output (it cannot then be resumed exactly)."""
    c = r.checkpoint
    known = req.prompt_ids + list(r.output)
    if c.committed % block or len(known) != c.committed + c.n_tc * block or len(c.tokens) > c.n_res * block:
        raise ValueError(f"resume: a checkpoint at {c.committed} committed tokens with {c.n_tc} final slots does "
                         f"not fit a prompt of {req.prompt_len} tokens and {len(r.output)} output tokens")
    req.output, req.known, req.aligned_len = list(r.output), known, c.committed
    req.resume = (list(c.tokens), [1.0] * len(c.tokens), c.n_res, c.n_tc)
    req.nfe, req.cached_tokens = c.nfe, c.cached_tokens
    if req.logprobs is not None:
        req.logprobs.update(c.logprobs)
    if req.top_logprobs is not None:
        req.top_logprobs.update(c.top_logprobs)
    if req.grammar is not None:
        seen = known[: c.committed] + list(c.tokens)
        req.grammar.restore(seen[req.prompt_len: c.frontier])
        req.frontier = c.frontier
