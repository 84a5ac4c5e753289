"""The one request check: prompt ids and decoding parameters against an engine's limits.

The CLI, the eval sweeps, every served replica (`Engine.check_request`) and the HTTP ingress (before a request
reaches a replica) call `validate_request`, so a request is refused for the same reasons, with the same words,
everywhere. Errors are `RequestError`s naming the offending field; `names` maps the engine's field names to the
caller's (the HTTP API says `prompt` and `max_tokens` where the engine says `prompt_ids` and `max_new_tokens`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from mbd.config import DecodeConfig
from mbd.decoding.state import RequestParams

Params = DecodeConfig | Mapping[str, Any] | None


class RequestError(ValueError):
    """A request the engine refuses; `field` names what is wrong in the caller's words (the message does too)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


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


def validate_prompt(prompt_ids: Sequence[int], limits: EngineLimits, names: Mapping[str, str] = {}) -> list[int]:
    """Prompt ids as a list: non-empty ints in [0, vocab_size), never the mask token (the decoder reserves it)."""
    field = names.get("prompt_ids", "prompt_ids")
    ids = list(prompt_ids)
    if not ids:
        raise RequestError(field, f"{field} is empty: a request needs at least one prompt token")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < limits.vocab_size for t in ids):
        raise RequestError(field, f"{field} must be ints in [0, {limits.vocab_size})")
    if limits.mask_id in ids:
        raise RequestError(field, f"{field} contain the mask token id {limits.mask_id}, which the decoder reserves")
    return ids


def resolve_params(params: Params, base: DecodeConfig, limits: EngineLimits,
                   names: Mapping[str, str] = {}) -> DecodeConfig:
    """A request's DecodeConfig: `base` (the engine's), a full DecodeConfig, or a mapping of overrides of `base`;
    buffer_size may not exceed the engine's compiled one, block_size must be the model's, the strategy the
    engine's."""
    if params is None:
        cfg = base
    elif isinstance(params, DecodeConfig):
        cfg = params
    else:
        try:
            cfg = DecodeConfig.model_validate({**base.model_dump(), **dict(params)})
        except ValidationError as e:
            err = e.errors()[0]
            field = names.get(str(err["loc"][0]), str(err["loc"][0])) if err["loc"] else names.get("params", "params")
            raise RequestError(field, f"{field}: {err['msg']} (got {err.get('input')!r})") from e
    if cfg.buffer_size > limits.buffer_size:
        field = names.get("buffer_size", "buffer_size")
        raise RequestError(field, (
            f"{field}={cfg.buffer_size} exceeds the engine's compiled buffer_size={limits.buffer_size}: lower it or "
            f"build the Engine with buffer_size >= {cfg.buffer_size}"))
    if cfg.block_size not in (None, limits.block):
        field = names.get("block_size", "block_size")
        raise RequestError(field, f"{field}={cfg.block_size} differs from the model's block_size={limits.block}")
    if cfg.strategy != base.strategy:
        field = names.get("strategy", "strategy")
        raise RequestError(field, f"{field}={cfg.strategy} differs from the engine's {base.strategy}")
    return cfg


def validate_request(prompt_ids: Sequence[int], params: Params, base: DecodeConfig, limits: EngineLimits,
                     names: Mapping[str, str] = {}) -> tuple[list[int], RequestParams]:
    """The one request check: the prompt (`validate_prompt`), the parameters (`resolve_params`), room to
    generate, and a worst case (prompt + max_new_tokens + a full Block Buffer) that fits the KV pool."""
    ids = validate_prompt(prompt_ids, limits, names)
    cfg = resolve_params(params, base, limits, names)
    limit = min(cfg.max_length, limits.max_length)
    if len(ids) >= limit:
        field = names.get("prompt_ids", "prompt_ids")
        raise RequestError(field, (
            f"{field} has {len(ids)} tokens but max_length is {limit}: shorten the prompt or raise max_length (the "
            "engine's max_length caps every request)"))
    p = RequestParams.resolve(cfg, len(ids), limits.max_length)
    B = limits.block
    need = -(-(-(-p.gen_end // B) * B + p.buffer_size * B) // limits.page_size)
    if need > limits.kv_pages:
        field = names.get("max_new_tokens", "max_new_tokens")
        raise RequestError(field, (
            f"{field}: the request needs up to {need} KV pages (prompt + max_new_tokens + its Block Buffer) but the pool "
            f"holds {limits.kv_pages}: lower max_new_tokens or raise kv_cache_bytes"))
    return ids, p
