"""The FastAPI application of one ingress replica: the OpenAI routes bound to that replica, its request models
bounded by its deployment (so its OpenAPI document says what it accepts), its error handling and middlewares
(serve_app/errors.py), and an OpenAPI document that lists the status codes we really send."""

from dataclasses import dataclass
from typing import Annotated, Any, Protocol

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import Field, create_model
from ray import serve

from mbd.checkpoint_files import read_model_config
from serve_app import errors, exposition
from serve_app.config import ServeConfig
from serve_app.errors import ENDPOINTS, RESPONSES, generation_responses, unavailable
from serve_app.metrics import IngressMetrics
from serve_app.protocol import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                CompletionResponse, ModelList, prompt_type)
from serve_app.schema_rules import Int


class Ingress(Protocol):
    """What the routes call of the ingress (serve_app/ingress.py `OpenAIIngress`, which builds this app)."""

    cfg: ServeConfig
    metrics: IngressMetrics | None

    async def health(self) -> str: ...

    async def models(self) -> ModelList: ...

    async def completions(self, req: CompletionRequest) -> Any: ...

    async def chat(self, req: ChatCompletionRequest) -> Any: ...


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema without the 422 it adds to every route: validation errors are answered as 400."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for ops in schema.get("paths", {}).values():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        _stream_events(schema)
        app.openapi_schema = schema
    return app.openapi_schema


METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Prometheus text exposition format 0.0.4",
          "content": {"text/plain": {"schema": {"type": "string"}}}},
    503: RESPONSES[503] | {"description": "no node's metrics export endpoint answered (Retry-After)"},
}


STREAM_EVENTS = {"/v1/completions": CompletionResponse, "/v1/chat/completions": ChatCompletionChunk}


def _stream_events(schema: dict[str, Any]) -> None:
    """Document each server-sent event of a generation endpoint's stream, as OpenAPI 3.1 tools read an event
    stream's `schema` (per event: its `data` line): JSON (`contentMediaType`) that is one of the endpoint's chunks,
    or the ErrorResponse that reports a failure mid-stream; or the closing `[DONE]`. A chunk model that no route
    returns is added to the components (in its serialized form, as the events are written)."""
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, event in STREAM_EVENTS.items():
        if event.__name__ not in comps:
            own = event.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
            comps.update({k: v for k, v in own.pop("$defs", {}).items() if k not in comps})
            comps[event.__name__] = own
        payload = {"oneOf": [{"$ref": f"#/components/schemas/{event.__name__}"},
                             {"$ref": "#/components/schemas/ErrorResponse"}]}
        content = schema["paths"][path]["post"]["responses"]["200"]["content"]
        content["text/event-stream"]["schema"] = {
            "type": "object", "required": ["data"], "properties": {"event": {"type": "string"}, "data": {"anyOf": [
                {"const": "[DONE]"},
                {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}}}


@dataclass(frozen=True)
class Bounds:
    """One deployment's bounds on a request, known when its app is built: the model it serves, its decode
    config's max_new_tokens and buffer_size, its request limits and the model's vocabulary (`mask_id` is inside
    it but reserved by the decoder)."""

    model: str
    max_tokens: int
    buffer_size: int
    max_temperature: float
    max_choices: int
    vocab_size: int
    mask_id: int


def deployment_models(b: Bounds) -> tuple[type[CompletionRequest], type[ChatCompletionRequest]]:
    """The request models of one deployment: the shared fields bounded by `b`, so that its OpenAPI schema says
    what it accepts and validation enforces the same bounds. `model` is listed, not checked here: another
    model's name is a 404 (`RequestConverter.check_fields`), as OpenAI answers it."""
    token_id = Int(ge=0, lt=b.vocab_size, json_schema_extra={"not": {"const": b.mask_id}})
    limit = (Int(ge=1, le=b.max_tokens) | None, Field(default=None, description="at most decode.max_new_tokens; "
                                                                           "the prompt and these must fit the context"))
    shared: dict[str, Any] = {
        "model": (str, Field(json_schema_extra={"enum": [b.model]})),
        "max_tokens": limit,
        "temperature": (Annotated[float, Field(ge=0.0, le=b.max_temperature)] | None, None),
        "n": (Int(ge=1, le=b.max_choices), Field(default=1, description="prompts x n <= limits.max_choices")),
        "buffer_size": (Int(ge=1, le=b.buffer_size) | None, None),
    }
    completion = create_model("CompletionRequest", __base__=CompletionRequest, **shared,
                              prompt=(prompt_type(token_id, b.max_choices), ...))
    chat = create_model("ChatCompletionRequest", __base__=ChatCompletionRequest, **shared,
                        max_completion_tokens=limit)
    return completion, chat



def bounds(ing: Ingress) -> Bounds:
    """The deployment's bounds on requests: its serve config and its model's config.json."""
    cfg = ing.cfg
    model = read_model_config(cfg.model.resolved_path())
    return Bounds(model=cfg.model.name, max_tokens=cfg.decode.max_new_tokens, buffer_size=cfg.decode.buffer_size,
                  max_temperature=cfg.limits.max_temperature, max_choices=cfg.limits.max_choices,
                  vocab_size=model.vocab_size, mask_id=model.mask_token_id)


def http_app(ing: Ingress, api_key: str | None) -> FastAPI:
    # the request models are this deployment's (annotations are evaluated here, so they can be local names)
    Completion, Chat = deployment_models(bounds(ing))
    app = FastAPI(title="mbd-lm", description="OpenAI-compatible API for Multi-Block Diffusion LMs")
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    errors.install(app, api_key, ing.cfg.http.max_body_bytes, ing.metrics)
    if ing.metrics is not None:
        ing.metrics.declare(ENDPOINTS)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the HTTP path is up; the body says how the decoder is (`OpenAIIngress.health`)."""
        return JSONResponse({"status": await ing.health()})

    @app.get("/metrics", response_class=Response, responses=METRICS_RESPONSES)
    async def metrics() -> Response:
        """This application's `ray_mbd_*` series in Prometheus' text format, gathered from the Ray metrics export
        port of every node (serve_app/exposition.py; docs/serving.md, "Metrics and the dashboard"). No API key,
        as /health and vLLM's /metrics: the series hold counts and latencies, never a request's content."""
        text = await exposition.gather(serve.get_replica_context().app_name)
        if text is None:
            raise unavailable("no node's metrics export endpoint answered", ing.cfg.decoder.retry_after_s)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses={k: RESPONSES[k] for k in (401,)})
    async def models() -> ModelList:
        return await ing.models()

    @app.post("/v1/completions", responses=generation_responses(CompletionResponse))
    async def completions(req: Completion) -> Any:  # type: ignore[valid-type]
        return await ing.completions(req)

    @app.post("/v1/chat/completions", responses=generation_responses(ChatCompletionResponse))
    async def chat(req: Chat) -> Any:  # type: ignore[valid-type]
        return await ing.chat(req)

    return app
