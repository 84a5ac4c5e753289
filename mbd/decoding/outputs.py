"""What the engine reports: per request per step (`StepOutput`, also the one record a served request's tokens
travel in, from the engine process to the SSE writer), per finished request (`GenerationResult`), and over its
lifetime (`EngineStats`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel

if TYPE_CHECKING:
    from mbd.decoding.resume import Checkpoint


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one step produced for one request (a dataclass, not pydantic: built for every request every step)."""

    request_id: str
    new_token_ids: list[int]  # tokens that became final in this step
    finished: bool
    finish_reason: str | None  # "eos" | "length" | "max_nfe" | "abort" | "error" | None
    nfe: int
    num_generated: int
    new_logprobs: list[float] | None = None  # with params.logprobs: the log-probability of each new token
    new_top_logprobs: list[list[tuple[int, float]]] | None = None  # with params.top_logprobs: per new token
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage.prompt_tokens_details)
    # with params.provisional: the resident tokens after the final ones (masks included), per block (the first may
    # be partial: a prompt's tail), from the end of the output so far; None when not asked for
    provisional: list[list[int]] | None = None
    error: str | None = None  # finish_reason "error": why this request (alone) could not go on
    # after a step that emitted tokens to a request that goes on: where a new engine can resume it exactly
    checkpoint: "Checkpoint | None" = None

    def merge(self, later: "StepOutput") -> "StepOutput":
        """This output and the `later` one of the same request as one: what several steps produced, for a reader
        that takes them at once (a served request's handler; a request that wants only the whole result)."""
        lps = None if later.new_logprobs is None else (self.new_logprobs or []) + later.new_logprobs
        tops = None if later.new_top_logprobs is None else (self.new_top_logprobs or []) + later.new_top_logprobs
        return StepOutput(self.request_id, self.new_token_ids + later.new_token_ids, later.finished,
                          later.finish_reason, later.nfe, later.num_generated, lps, tops, later.cached_tokens,
                          later.provisional, later.error,
                          later.checkpoint if later.new_token_ids else self.checkpoint)


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
    grammar_s: float = 0.0  # of step_s, the grammar matchers' (masks before the decision, settling after)
    prefills: int = 0  # prompts prefilled on their own (no row was decoding)
    prefill_s: float = 0.0
    prefill_tokens: int = 0  # prompt tokens run through the model, alone or as chunks of decode steps
    chunked_steps: int = 0  # decode steps that also carried prompt chunks
    # query positions of decode forwards: sdpa (packed) runs the decoding rows' resident slots end to end, padded to
    # `token_bucket`; the flex / compiled layout runs batch bucket x slots x B
    positions_run: int = 0
    resident_positions: int = 0  # of those, positions of resident (ACTIVE / TO_CACHE) slots of decoding rows
    logit_rows: int = 0  # positions whose logits the head computed (ACTIVE windows, padding included)
    prefix_query_tokens: int = 0  # block-aligned prompt tokens looked up in the prefix cache at admission
    prefix_hit_tokens: int = 0  # of those, tokens whose K/V came from cached pages (their prefill was skipped)
    preemptions: int = 0  # requests sent back to the queue because the KV page pool ran out
    decode_rows: int = 0  # decoding requests summed over decode steps (padding rows excluded)
    active_blocks: int = 0  # ACTIVE (predicted) blocks summed over the decoding requests of decode steps

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
