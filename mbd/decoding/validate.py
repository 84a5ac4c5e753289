"""The one request check: prompt ids, decoding parameters and a structured-output constraint against an engine's
limits. Every rule a request must pass is written here once: the prompt (ids the model can read, shorter than
the context), the parameters (the Block Buffer the engine compiled, its block and strategy, its max_nfe), room to
generate, a worst case that fits the KV pool, and a grammar that compiles against the model's vocabulary.

A request is checked once, where it enters: the HTTP ingress, against the limits a decoder replica reports, in its
field names, or the engine itself for the CLI and the eval sweeps (`Engine.check_request`, `add_request`). What
passes is a `RequestParams`, which `Engine.admit` queues without checking it again. Errors are `RequestError`s
naming the offending field; `names` maps the engine's field names to the caller's (the HTTP API says `prompt` and
`max_tokens` where the engine says `prompt_ids` and `max_new_tokens`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from mbd.config import DecodeConfig
from mbd.decoding.constraint_spec import ConstraintSpec

if TYPE_CHECKING:  # the check runs at the ingress too, which loads no torch
    from mbd.decoding.constraints import GrammarVocab

Params = DecodeConfig | Mapping[str, Any] | None
CONTEXT = "context_length_exceeded"  # OpenAI's error code for a request that does not fit the context


@dataclass(frozen=True)
class RequestParams:
    """A request's resolved decoding parameters (host side; thresholds None = not used, as in the table)."""

    buffer_size: int
    gen_end: int  # absolute position where generation must stop: min(prompt + max_new_tokens, max_length)
    max_nfe: int
    tau_add: float | None
    tau_semi: float
    tau_stable: float | None
    tau_m2t: float
    tau_t2t: float | None
    temperature: float
    seed: int
    top_p: float = 1.0
    top_k: int = 0
    ignore_eos: bool = False
    logprobs: bool = False
    provisional: bool = False
    top_logprobs: int = 0

    @classmethod
    def resolve(cls, cfg: DecodeConfig, prompt_len: int, max_length: int) -> "RequestParams":
        """A checked request's parameters (`mbd.decoding.validate` refuses a prompt that leaves no room)."""
        limit = min(cfg.max_length, max_length)
        return cls(cfg.buffer_size, min(prompt_len + cfg.max_new_tokens, limit), cfg.max_nfe, cfg.tau_add,
                   cfg.tau_semi, cfg.tau_stable, cfg.tau_m2t, cfg.tau_t2t, cfg.temperature, cfg.seed,
                   cfg.top_p, cfg.top_k, cfg.ignore_eos, cfg.logprobs, cfg.provisional, cfg.top_logprobs)


class RequestError(ValueError):
    """A request the engine refuses; `field` names what is wrong in the caller's words (the message does too),
    `code` (when set) says which kind of refusal it is in OpenAI's words."""

    def __init__(self, field: str | None, message: str, code: str | None = None):
        super().__init__(message)
        self.field, self.code = field, code

    def __reduce__(self) -> tuple:  # crosses process boundaries (the engine process, Ray) with its field
        return RequestError, (self.field, str(self), self.code)


@dataclass(frozen=True)
class EngineLimits:
    """What an engine can serve: its model's vocabulary and block, its compiled Block Buffer and decision rules,
    its length limit and its KV page pool (`Engine.limits`)."""

    vocab_size: int
    mask_id: int
    block: int
    buffer_size: int  # the engine's compiled N_buf: no request may ask for more
    strategy: str
    max_length: int  # min(the engine's max_length, the model's max_position_embeddings)
    page_size: int
    kv_pages: int  # pages one request may hold at most (the whole pool)


def validate_prompt(prompt_ids: Sequence[int], limits: EngineLimits, names: Mapping[str, str] = {},
                    max_length: int | None = None) -> list[int]:
    """Prompt ids as a list: non-empty ints in [0, vocab_size), never the mask token (the decoder reserves it),
    fewer than the context (the engine's max_length, or a request's smaller `max_length`)."""
    field = names.get("prompt_ids", "prompt_ids")
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
        raise RequestError(field, f"{field} must be a list of token ids, got {type(prompt_ids).__name__}")
    ids = list(prompt_ids)
    if not ids:
        raise RequestError(field, f"{field} is empty: a request needs at least one prompt token")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < limits.vocab_size for t in ids):
        raise RequestError(field, f"{field} must be ints in [0, {limits.vocab_size})")
    if limits.mask_id in ids:
        raise RequestError(field, f"{field} contain the mask token id {limits.mask_id}, which the decoder reserves")
    limit = min(max_length or limits.max_length, limits.max_length)
    if len(ids) >= limit:
        raise RequestError(field, f"{field} has {len(ids)} tokens but the context (max_length) is {limit} tokens, "
                                  f"so at most {limit - 1} prompt tokens fit: shorten the prompt", CONTEXT)
    return ids


def resolve_params(params: Params, base: DecodeConfig, limits: EngineLimits,
                   names: Mapping[str, str] = {}) -> DecodeConfig:
    """A request's DecodeConfig: `base` (the engine's), a full DecodeConfig, or a mapping of overrides of `base`;
    buffer_size may not exceed the engine's compiled one, block_size must be the model's, the strategy the
    engine's, max_nfe at most the engine's."""
    if params is None:
        cfg = base
    elif isinstance(params, DecodeConfig):
        cfg = params
    elif isinstance(params, Mapping):
        try:
            cfg = DecodeConfig.model_validate({**base.model_dump(), **dict(params)})
        except ValidationError as e:
            err = e.errors()[0]
            field = names.get(str(err["loc"][0]), str(err["loc"][0])) if err["loc"] else names.get("params", "params")
            raise RequestError(field, f"{field}: {err['msg']} (got {err.get('input')!r})") from e
    else:
        field = names.get("params", "params")
        raise RequestError(field, f"{field} must be a DecodeConfig or a mapping, got {type(params).__name__}")
    if cfg.buffer_size > limits.buffer_size:
        field = names.get("buffer_size", "buffer_size")
        raise RequestError(field, f"{field}={cfg.buffer_size} exceeds the engine's compiled buffer_size="
                                  f"{limits.buffer_size} (the Block Buffer's slots): ask for at most that many")
    if cfg.block_size not in (None, limits.block):
        field = names.get("block_size", "block_size")
        raise RequestError(field, f"{field}={cfg.block_size} differs from the model's block_size={limits.block}")
    if cfg.strategy != base.strategy:
        field = names.get("strategy", "strategy")
        raise RequestError(field, f"{field}={cfg.strategy} differs from the engine's {base.strategy}")
    if cfg.max_nfe > base.max_nfe:
        field = names.get("max_nfe", "max_nfe")
        raise RequestError(field, f"{field}={cfg.max_nfe} exceeds the engine's max_nfe={base.max_nfe}")
    return cfg


def validate_constraint(constraint: ConstraintSpec | None, grammar: GrammarVocab | None) -> None:
    """The grammar rule: a constraint compiles against the model's vocabulary (`grammar`, which caches it for
    the request's matcher), else a ConstraintError (a ValueError) naming the field it came from."""
    if constraint is None:
        return
    if not isinstance(constraint, ConstraintSpec):
        raise RequestError("constraint", f"constraint must be a ConstraintSpec, got {type(constraint).__name__}")
    if grammar is None:
        raise RequestError(constraint.field, f"{constraint.field}: structured output needs the model's tokenizer")
    grammar.compile(constraint)


def validate_request(prompt_ids: Sequence[int], params: Params, base: DecodeConfig, limits: EngineLimits,
                     names: Mapping[str, str] = {}, whole: bool = False) -> tuple[list[int], RequestParams]:
    """The one request check: the parameters (`resolve_params`), the prompt (`validate_prompt`, within the
    request's max_length), room to generate, and a worst case (prompt + max_new_tokens + a full Block Buffer)
    that fits the KV pool. The engine generates up to the context and stops there; `whole` (an API that
    promises max_tokens or an error) refuses a request whose max_new_tokens do not fit the context instead."""
    cfg = resolve_params(params, base, limits, names)
    ids = validate_prompt(prompt_ids, limits, names, cfg.max_length)
    limit = min(cfg.max_length, limits.max_length)
    if whole and len(ids) + cfg.max_new_tokens > limit:
        field = names.get("max_new_tokens", "max_new_tokens")
        raise RequestError(field, f"the prompt ({len(ids)} tokens) + {field} ({cfg.max_new_tokens}) exceeds the "
                                  f"context length {limit}", CONTEXT)
    p = RequestParams.resolve(cfg, len(ids), limits.max_length)
    B = limits.block
    need = -(-(-(-p.gen_end // B) * B + p.buffer_size * B) // limits.page_size)
    if need > limits.kv_pages:
        field = names.get("max_new_tokens", "max_new_tokens")
        raise RequestError(field, f"{field}: the request needs up to {need} KV pages (prompt + max_new_tokens + its "
                                  f"Block Buffer) but the pool holds {limits.kv_pages}: lower max_new_tokens or raise "
                                  "kv_cache_bytes")
    return ids, p
