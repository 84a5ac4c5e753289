"""What a request field may hold, in the JSON Schema words the OpenAPI document uses, and what only the server
can check (listed in the schema under `x-server-checks`). The request models (serve_app/protocol.py) are built
from these, so the schema and the validation are one thing."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, Field


def _integral(value: Any) -> Any:
    """JSON Schema's integer: a number with no fraction (so 2.0 is one), never a bool or a string."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Int(**bounds: Any) -> Any:
    """An integer field type with its bounds (on the type, so that the JSON schema states them)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


# an unsigned 32-bit seed (numpy's range; seed + k for choice k is still one torch accepts): bounds far from
# 2**63 also stay exact in the doubles schema tools compute with
Seed = Int(ge=0, le=2**32 - 1)


# What the server checks that a JSON schema cannot state (rules across fields, lengths in tokens, grammars that
# must compile), by the field its 400 names (`error.param` starts with it); the schema lists them under
# x-server-checks, so a client (or a schema-driven fuzzer) knows which refusals a valid body may still get.
CONSTRAINT_RULE = ("one structured-output constraint per request (response_format, structured_outputs or one "
                   "guided_* field), and it must compile against the model's vocabulary")
SHARED_CHECKS = {
    "max_tokens": "the prompt's tokens + max_tokens fit the context (max_model_len in GET /v1/models; code "
                  "context_length_exceeded) and the KV page pool",
    "n": "prompts x n <= the deployment's limits.max_choices",
    "buffer_size": "above 1 needs tau_add (the request's or the deployment's)",
    **{f: CONSTRAINT_RULE for f in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                                     "guided_choice", "guided_grammar")},
}
PROMPT_RULE = ("in tokens, shorter than the context (max_model_len in GET /v1/models; code context_length_exceeded) "
               "and not empty; text spells no token the decoder reserves (the mask token)")




def needs(field: str, when: dict[str, Any], value: Any) -> dict[str, Any]:
    """JSON Schema for "`field` must be `value` when the body matches `when`" (the ingress checks it)."""
    return {"if": when, "then": {"properties": {field: {"const": value}}, "required": [field]}}


PROVISIONAL_NEEDS_STREAM = needs("stream", {"properties": {"stream_options": {
    "type": "object", "properties": {"include_provisional": {"const": True}}, "required": ["include_provisional"]}},
    "required": ["stream_options"]}, True)


def server_checks(*rules_across_fields: dict[str, Any], **rules: str) -> ConfigDict:
    """The request model's config: strict, and its schema listing the server's checks (`x-server-checks`) and
    the rules across fields that JSON Schema can state (`allOf`)."""
    extra = {"x-server-checks": SHARED_CHECKS | rules, "allOf": [PROVISIONAL_NEEDS_STREAM, *rules_across_fields]}
    return ConfigDict(extra="forbid", strict=True, json_schema_extra=extra)
