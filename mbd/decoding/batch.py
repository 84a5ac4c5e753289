"""What the scheduler hands the runner (`DecodeBatch`) and what one decode forward hands back per row
(`RowOutput`): the named step types between `schedule()`, `runner.run(batch)` and `postprocess`."""

from __future__ import annotations

from dataclasses import dataclass

from mbd.decoding.guided import RowFix
from mbd.decoding.policy import Sampler
from mbd.decoding.state import Request, RowLayout


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens `ids` (block-aligned) of batch row `row`, placed at absolute positions start, start + 1, ..."""

    row: int
    start: int
    ids: list[int]


@dataclass(frozen=True)
class DecodeBatch:
    """One decode forward: rows [0, rows) of the Block Buffers (`rows` a batch bucket), the first `slots`
    slots of each (the most resident slots of any row), logits for a window of `active` slots per row."""

    requests: list[Request]  # the decoding requests, in admission order (each in batch row `req.row`)
    rows: int
    slots: int
    active: int
    layout: list[RowLayout]  # rows [0, rows): the device state the forward must see (uploaded when it changed)
    chunks: list[PrefillChunk]  # prompt chunks of prefilling rows that ride in the forward (chunked prefill)
    chunk_requests: list[Request]  # their requests, in the same order
    home: bool  # rows [0, rows) map only their home pages (`CacheManager.at_home`)
    samplers: list[Sampler]  # rows that sample (temperature > 0)
    fixed: bool  # some row's prompt tail is still in its buffer (prompt tokens are never revised)
    t2t: bool  # some row revises tokens (tau_t2t set)
    logprobs: bool  # some row reports log-probabilities
    trace: bool  # report forward-time slot states
    guided: bool = False  # some row has a grammar (structured output)

    @property
    def max_committed(self) -> int:
        return max(r.committed for r in self.requests)


@dataclass(frozen=True, slots=True)
class RowOutput:
    """One decoding row after the forward and the policy's update, on the host: its tokens and per-slot counts
    over the `slots` slots that were run (slots outside the logits window padded as TO_CACHE before it, as
    all-mask DUMMY after it)."""

    tokens: list[int]  # [slots * B] after M2T / T2T, before TO_CACHE slots are popped
    masked_in: list[int]  # [slots] mask tokens the model saw
    accepted: list[int]  # [slots] masks filled by M2T
    revised: list[int] | None  # [slots] tokens replaced by T2T (None: no row revises)
    states: list[int] | None  # [n_buf] forward-time slot states (with `DecodeBatch.trace`)
    conf: list[float] | None  # [slots * B] probability each changed token was taken with, -1 where unchanged
    fix: RowFix | None = None  # a constrained row: its counts after the grammar settled it
    top: list[tuple[int, list[tuple[int, float]]]] | None = None  # (buffer position, top (id, logprob)) per logit
    confident: list[int] | None = None  # [slots] 1 where every position was confident (DMax's early commit)
    failed: bool = False  # an ACTIVE position had no valid distribution: the request ends with an error
