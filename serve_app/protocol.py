"""OpenAI-compatible request/response schemas, as the OpenAI API and vLLM define them.

Requests are strict: wrong types are not coerced and unknown fields are rejected, so a client that asks for
something we do not do hears about it instead of getting silently different output. Every value rule a field
has is written on its model here, so the OpenAPI schema states it and the same model enforces it (a 400 naming
the field): fields OpenAI has whose values we cannot all honour are narrowed to those we can (`echo` only false,
penalties only 0, content parts only text). `serve_app.routes.deployment_models` narrows them further to one deployment's
bounds. What a schema cannot state (rules across fields, a prompt's length in tokens, a grammar that must
compile) is checked by the ingress and listed in the schema's text (docs/serving.md, "The API schema").
The MultiBD knobs (buffer_size and the tau_* thresholds) are extra top-level fields (`extra_body` in the
`openai` client).

Log-probabilities: a diffusion LM has no left-to-right next-token distribution. `logprobs` reports, for each
returned token, its log-probability under the distribution it was accepted from, i.e. the model's softmax
(mask token excluded) at the forward where M2T filled that position or T2T last revised it; with
temperature > 0 the sampling distribution after temperature, top_k and top_p.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_serializer

from serve_app.schema_rules import PROMPT_RULE, SHARED_CHECKS, Int, Seed, needs, server_checks

Unit = Field(default=None, ge=0.0, le=1.0)


def _unicode(text: str) -> str:
    """Lone surrogates (JSON '\\ud800') parse into a str that no tokenizer or UTF-8 encoder accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode ({e.reason} at character {e.start})") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_unicode)]


ZERO_ONLY = "only 0 (no penalty): a diffusion LM decodes blocks in parallel, so no token history penalty applies"


class StrictRequest(BaseModel):
    # JSON has no NaN or Infinity: Python's json module reads them, the schema's "number" does not admit them
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _json_bool(v: Any) -> Any:
    """A literal boolean is a JSON boolean: Literal[False] alone compares by ==, so 0 would pass as false."""
    if not isinstance(v, bool):
        raise ValueError("must be a boolean")
    return v


class StreamOptions(StrictRequest):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far
    # ours: chunks also carry the Block Buffer's not-yet-final blocks (`provisional`), for interfaces that show
    # diffusion; the content stays committed text only
    include_provisional: bool = False


class JSONSchemaFormat(StrictRequest):
    """OpenAI's `response_format.json_schema`; the schema is enforced exactly whether `strict` is set or not."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(StrictRequest):
    """`json_schema` is required with type json_schema (the ingress checks it, naming the field)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}}, "then": {"required": ["json_schema"]}})
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(StrictRequest):
    """vLLM's `structured_outputs` (its older top-level `guided_*` fields are accepted too): one of them."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[NonEmptyText] | None = Field(default=None, min_length=1)
    grammar: str | None = None


def prompt_type(token_id: Any = Int(ge=0), max_prompts: int | None = None) -> Any:
    """`prompt`: a string, token ids, or a list of either (up to `max_prompts` prompts), none of them empty."""
    ids = Annotated[list[token_id], Field(min_length=1)]
    return NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=max_prompts)] | ids | \
        Annotated[list[ids], Field(min_length=1, max_length=max_prompts)]


class SamplingFields(StrictRequest):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: Int(ge=1) | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Int(ge=-1) | None = Field(default=None, description="-1 or 0: all tokens (vLLM)")
    seed: Seed | None = None
    stop: NonEmptyText | list[NonEmptyText] | None = None
    n: Int(ge=1) = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = Field(default=None, ge=0, le=0, description=ZERO_ONLY)
    frequency_penalty: float | None = Field(default=None, ge=0, le=0, description=ZERO_ONLY)
    # MultiBD extras
    buffer_size: Int(ge=1) | None = None
    tau_add: float | None = Unit
    tau_semi: float | None = Unit
    tau_stable: float | None = Unit
    tau_m2t: float | None = Unit
    tau_t2t: float | None = Unit
    return_token_ids: bool = False
    timeout: float | None = Field(default=None, gt=0, le=86_400, description=(
        "seconds from arrival after which the request ends with finish_reason \"timeout\" and what was generated "
        "so far (LiteLLM's field); its engine work stops within a step"))
    # structured output (docs/structured-output.md): OpenAI's response_format, vLLM's shapes
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[NonEmptyText] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def token_limit(self) -> tuple[int | None, str]:
        """The requested generation limit and the field it came from."""
        return self.max_tokens, "max_tokens"

    def wants_logprobs(self) -> bool:
        return False

    def top_count(self) -> int:
        """How many most-likely alternatives to report per token."""
        return 0


class CompletionRequest(SamplingFields):
    model_config = server_checks(prompt=PROMPT_RULE)
    prompt: prompt_type()  # type: ignore[valid-type]
    logprobs: Int(ge=0, le=20) | None = None
    echo: Annotated[Literal[False], BeforeValidator(_json_bool)] = Field(default=False, description="only false: a diffusion LM does not score its prompt")

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def top_count(self) -> int:
        return self.logprobs or 0


class ContentPart(StrictRequest):
    """One part of a message's content: this model reads only {"type": "text", "text": ...} parts."""

    type: Literal["text"]
    text: Text


class ChatMessage(StrictRequest):
    role: Literal["system", "user", "assistant"]
    content: Text | list[ContentPart]
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    model_config = server_checks(needs("logprobs", {"properties": {"top_logprobs": {"type": "integer", "minimum": 1}},
                                                     "required": ["top_logprobs"]}, True),
                                 messages=f"the chat-rendered prompt: {PROMPT_RULE}",
                                 max_tokens=f"{SHARED_CHECKS['max_tokens']}; equal to max_completion_tokens when both "
                                            "are sent", max_completion_tokens=SHARED_CHECKS["max_tokens"])
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int(ge=1) | None = Field(default=None, description="OpenAI's newer name of max_tokens")
    logprobs: bool = False
    top_logprobs: Int(ge=0, le=20) | None = None

    def token_limit(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def wants_logprobs(self) -> bool:
        return self.logprobs

    def top_count(self) -> int:
        return self.top_logprobs or 0


# ---- responses (plain models; built by the server, never parsed from clients) ----


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache (their prefill was skipped)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class MBDStats(BaseModel):
    """Per-request decoding statistics, summed over the choices: NFE (forward passes) and
    TPF = generated tokens / NFE."""

    nfe: int
    tpf: float
    num_generated: int
    buffer_size: int


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


# "error": the stream failed mid-way (see the error event); "timeout": the request's `timeout` passed first
FinishReason = Literal["stop", "length", "error", "timeout"]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class ProvisionalBlock(BaseModel):
    """A Block Buffer block (or the part of one after the committed text) that is not final yet."""

    token_ids: list[int | None]  # None: still masked
    text: str  # the filled tokens decoded one by one; a masked position shows as MASK_GLYPH


class Provisional(BaseModel):
    """With stream_options.include_provisional: what follows the committed text right now. `committed_tokens`:
    the tokens committed before these blocks; the blocks may still change (and masked ones will fill)."""

    committed_tokens: int
    blocks: list[ProvisionalBlock]


MASK_GLYPH = "\u2591"


class WithProvisional(BaseModel):
    """A choice that may carry `provisional`: the field is left out unless set, so default responses and streams
    keep OpenAI's shape exactly."""

    provisional: Provisional | None = None

    @model_serializer(mode="wrap")
    def _drop_unset_provisional(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("provisional", 0) is None:
            del out["provisional"]
        return out


class CompletionChoice(WithProvisional):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    token_ids: list[int] | None = None  # with return_token_ids (vLLM's name)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    mbd: MBDStats | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict[str, Any]] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    mbd: MBDStats


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(WithProvisional):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    mbd: MBDStats | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mbd"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class APIError(Exception):
    """An OpenAI-style error: HTTP status, message, the offending request field (`param`), type and code."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


def field_path(loc: tuple[Any, ...]) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'; pydantic's union-member tags are dropped."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_]\w*", part) and part not in {"str", "int", "float", "bool", "list"}:
            out += f".{part}" if out else part
    return out or None


def from_validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI/pydantic request errors as one OpenAI-style 400 that names the first offending field (within a
    union, a value error of the member whose type matched beats the other members' type mismatches)."""
    errors = exc.errors()
    err = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    if err["type"] == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}", "body")
    param = field_path(tuple(err["loc"]))
    if err["type"] == "extra_forbidden":
        return APIError(400, f"unsupported field '{param}': this server does not implement it", param)
    if err["type"] == "missing":
        return APIError(400, f"missing required field '{param}'" if param else "missing JSON request body", param)
    if param is None and err["type"].endswith("_type"):
        return APIError(400, f"request body must be a JSON object: {err['msg']}", "body")
    return APIError(400, f"invalid value for '{param}': {err['msg']} (got {err.get('input')!r:.100})", param)
