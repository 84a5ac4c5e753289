"""OpenAI-compatible request/response schemas (the subset that makes sense for a block-diffusion LM).

Requests are strict: wrong types are not coerced and unknown fields are rejected, so a client that asks for
something we do not do (`logprobs`, `top_p`, ...) hears about it instead of getting silently different output.
The MultiBD knobs (buffer_size and the tau_* thresholds) are extra top-level fields (`extra_body` in the
`openai` client); the deployment bounds them further (see `serve_app.app`).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

Unit = Field(default=None, ge=0.0, le=1.0)


class StrictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictRequest):
    include_usage: bool = True


class SamplingFields(StrictRequest):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # MultiBD extras
    buffer_size: int | None = Field(default=None, ge=1)
    tau_add: float | None = Unit
    tau_semi: float | None = Unit
    tau_stable: float | None = Unit
    tau_m2t: float | None = Unit
    tau_t2t: float | None = Unit
    return_token_ids: bool = False

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    prompt: str | list[int]


class ChatMessage(StrictRequest):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)


# ---- responses (plain models; built by the server, never parsed from clients) ----


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class MBDStats(BaseModel):
    """Per-request decoding statistics: NFE (forward passes) and TPF = generated tokens / NFE."""

    nfe: int
    tpf: float
    num_generated: int
    buffer_size: int
    token_ids: list[int] | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


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


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"] | None = None


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


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: Literal["stop", "length"] | None = None


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
    """FastAPI/pydantic request errors as one OpenAI-style 400 that names the first offending field."""
    err = exc.errors()[0]
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
