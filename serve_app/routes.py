"""The FastAPI application of one ingress replica: the OpenAI routes bound to that replica, its error handling
and middlewares (serve_app/errors.py), and an OpenAPI document that lists the status codes we really send."""

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse

from mbd.config import ModelConfig, read_json
from serve_app import errors
from serve_app.errors import RESPONSES
from serve_app.protocol import Bounds, ModelList, deployment_models

if TYPE_CHECKING:
    from serve_app.ingress import OpenAIIngress


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema without the 422 it adds to every route: validation errors are answered as 400."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for ops in schema.get("paths", {}).values():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def bounds(ing: "OpenAIIngress") -> Bounds:
    """The deployment's bounds on requests: its serve config and its model's config.json."""
    cfg = ing.cfg
    model = ModelConfig.from_hf(read_json(cfg.model.resolved_path() / "config.json"))
    return Bounds(model=cfg.model.name, max_tokens=cfg.decode.max_new_tokens, buffer_size=cfg.decode.buffer_size,
                  max_temperature=cfg.limits.max_temperature, max_choices=cfg.limits.max_choices,
                  vocab_size=model.vocab_size, mask_id=model.mask_token_id)


def http_app(ing: "OpenAIIngress", api_key: str | None) -> FastAPI:
    # the request models are this deployment's (annotations are evaluated here, so they can be local names)
    CompletionRequest, ChatCompletionRequest = deployment_models(bounds(ing))
    app = FastAPI(title="mbd-lm", description="OpenAI-compatible API for Multi-Block Diffusion LMs")
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    errors.install(app, api_key, ing.cfg.http.max_body_bytes, ing.metrics)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the HTTP path is up; the body says how the decoder is (`OpenAIIngress.health`)."""
        return JSONResponse({"status": await ing.health()})

    @app.get("/v1/models", responses={k: RESPONSES[k] for k in (401,)})
    async def models() -> ModelList:
        return await ing.models()

    @app.post("/v1/completions", responses=RESPONSES)
    async def completions(req: CompletionRequest) -> Any:
        return await ing.completions(req)

    @app.post("/v1/chat/completions", responses=RESPONSES)
    async def chat(req: ChatCompletionRequest) -> Any:
        return await ing.chat(req)

    return app
