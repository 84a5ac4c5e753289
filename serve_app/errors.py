"""What the HTTP front door answers before and around the endpoints: OpenAI-style JSON errors for every status
(400 naming the field, 401, 404, 413, 503 with Retry-After), the request-body limit and the API key check.

Everything here is configured per application (`install(app, ...)`), never through module-global state, so
two applications in one process (or one Serve instance) keep their own keys and limits.
"""

from __future__ import annotations

import hmac
import math
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ray.serve.exceptions import BackPressureError

from actors.messages import RequestFailed, RequestQuarantined
from mbd.decoding.validate import RequestError
from serve_app.convert import bad_request
from serve_app.metrics import IngressMetrics
from serve_app.protocol import APIError, ErrorResponse, from_validation_error

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
ERRORS = {400: "invalid request (error.param names the field)", 401: "missing or wrong API key",
          404: "unknown model or route", 413: "request body larger than http.max_body_bytes",
          500: "this request crashed the engine on its trial, or the engine could not decode it (not retried)",
          503: "decoder at capacity or unavailable (Retry-After)"}
RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "the whole response as JSON; with stream=true server-sent `data:` events, each one JSON "
                         "object (a chunk, or an ErrorResponse after a failure mid-stream), then `data: [DONE]`",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}},
    **{code: {"model": ErrorResponse, "description": text} for code, text in ERRORS.items()},
}


def generation_responses(whole: type) -> dict[int | str, dict[str, Any]]:
    """The documented answers of a generation endpoint whose whole (non-streaming) response is `whole`."""
    return RESPONSES | {200: RESPONSES[200] | {"model": whole}}


def overloaded(retry_after_s: float) -> APIError:
    return APIError(503, "the server is at capacity; retry later", None, "server_error", "overloaded",
                    {"Retry-After": str(math.ceil(retry_after_s))})


def unavailable(message: str, retry_after_s: float) -> APIError:
    return APIError(503, message, None, "server_error", headers={"Retry-After": str(math.ceil(retry_after_s))})


def internal(message: str) -> APIError:
    """A failure the client should not retry as it is (no Retry-After)."""
    return APIError(500, message, None, "server_error")


def engine_failure(e: BaseException, retry_after_s: float) -> APIError:
    """The one mapping of what a decoder replica answered into HTTP: its refusal of a field (400), a request
    convicted of crashing the engine or that the engine could not decode (500: the same request would fail the
    same way), at capacity (503 overloaded), else unavailable (503: the replica gave up or is gone; retry)."""
    root = getattr(e, "cause", None) or e  # a RayTaskError keeps the decoder's own exception as `cause`
    if isinstance(root, RequestError):
        return bad_request(root)
    if isinstance(root, (RequestQuarantined, RequestFailed)):
        return internal(str(root))
    if isinstance(e, BackPressureError):
        return overloaded(e.retry_after_s if e.retry_after_s is not None else retry_after_s)
    return unavailable("decoder unavailable; retry the request", retry_after_s)


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 before it is parsed (by its
    Content-Length, or while a chunked body is read)."""

    def __init__(self, inner: Any, limit: int, metrics: IngressMetrics | None):
        self.inner, self.limit, self.metrics = inner, limit, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.inner(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            return await _answer(self._too_large(), self.metrics)(scope, receive, send)
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.limit:
                raise StarletteHTTPException(413, self._too_large().message)
            return msg

        await self.inner(scope, counted, send)

    def _too_large(self) -> APIError:
        return APIError(413, f"request body exceeds {self.limit} bytes (http.max_body_bytes)", "body",
                        code="request_too_large")


class AuthAndCount:
    """ASGI middleware: the bearer-token check for /v1/* (before the body is read), and the per-endpoint
    request counter (by the status line this app sends)."""

    def __init__(self, inner: Any, api_key: str | None, metrics: IngressMetrics | None):
        self.inner, self.metrics = inner, metrics
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.inner(scope, receive, send)
        path: str = scope["path"]
        status = 500

        async def counted(msg: dict) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            if self.expected is not None and "/v1/" in path:
                given = dict(scope.get("headers") or []).get(b"authorization", b"")
                if not hmac.compare_digest(given, self.expected):
                    err = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                   None, "authentication_error", "invalid_api_key")
                    return await _answer(err, self.metrics)(scope, receive, counted)
            await self.inner(scope, receive, counted)
        finally:
            if self.metrics is not None:
                self.metrics.request(next((e for e in ENDPOINTS if path.endswith(e)), "other"), status)


def _answer(err: APIError, metrics: IngressMetrics | None) -> JSONResponse:
    """The error's response, a 4xx counted by the field it names (`mbd_requests_refused`)."""
    if metrics is not None:
        metrics.refusal(err.status, err.param)
    return err.response()


def _http_error(exc: StarletteHTTPException) -> APIError:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, str(exc.detail), "body" if exc.status_code == 413 else None, kind,
                    headers=exc.headers)  # a 405's Allow header among them


def install(app: FastAPI, api_key: str | None, max_body_bytes: int, metrics: IngressMetrics | None) -> None:
    """The error handlers and middlewares of one application. Ray Serve's own 503 (overload) handler is never
    reached: the ingress turns every refusal by the decoder into an APIError where it makes the call."""

    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _answer(exc, metrics)

    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _answer(from_validation_error(exc), metrics)

    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _answer(_http_error(exc), metrics)

    app.add_exception_handler(APIError, api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, invalid)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_middleware(BodyLimit, limit=max_body_bytes, metrics=metrics)
    app.add_middleware(AuthAndCount, api_key=api_key, metrics=metrics)  # outermost: runs first
