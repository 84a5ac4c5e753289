"""OpenAI-compatible Ray Serve application: a FastAPI ingress in front of autoscaled decoder replicas.

- `OpenAIIngress` (CPU, cheap) validates and tokenizes requests, detokenizes committed blocks into text,
  applies stop strings and speaks HTTP/SSE. Nothing malformed gets past it.
- `Decoder` hosts the Block Buffer engine (actors/decoder.py): one replica = one placement group =
  tensor_parallel_size ranks. It streams each request's committed blocks back to the ingress.

Splitting them lets GPU replicas scale on `target_ongoing_requests` while HTTP stays on CPU, and lets the
decoder's `max_queued_requests` back-pressure surface as a clean 503 with Retry-After.
`serve run serve_app.app:build_app config=configs/serve/tiny.yaml` or `mbd serve --config ...`.
"""

import asyncio
import hmac
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.decoder import Delta, EngineHost
from actors.tp_worker import ModelSpec
from mbd.config import DecodeConfig, EngineConfig, ModelConfig, read_json
from mbd.detokenize import TextStream
from mbd.tokenizer import Tokenizer, TokenizerError
from serve_app.config import DEFAULT_MAX_BODY, ServeConfig, load_serve_config
from serve_app.metrics import DecoderMetrics, IngressMetrics
from serve_app.protocol import (APIError, AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, CompletionChoice,
                                CompletionLogprobs, CompletionRequest, CompletionResponse, DeltaMessage, ErrorBody,
                                ErrorResponse, MBDStats, ModelCard, ModelList, SamplingFields, TokenLogprob, Usage,
                                field_path, from_validation_error, new_id, now)

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health")
MBD_FIELDS = ("buffer_size", "tau_add", "tau_semi", "tau_stable", "tau_m2t", "tau_t2t")


# ---------------------------------------------------------------- decoder deployment


@serve.deployment
class Decoder:
    """Engine host replica: streams each request's committed blocks. With `per_block=False` they are merged into
    one final Delta, so a non-streaming request costs one Ray stream item instead of one per block."""

    def __init__(self, spec: ModelSpec, decode: DecodeConfig, engine: EngineConfig):
        self.metrics = DecoderMetrics()
        self.host = EngineHost(spec, decode, engine, on_step=self.metrics.update)

    async def generate(self, prompt_ids: list[int], params: DecodeConfig, per_block: bool = True
                       ) -> AsyncIterator[Delta]:
        self.host.validate(prompt_ids, params)
        merged = Delta()
        async for d in self.host.generate(prompt_ids, params):
            if per_block:
                yield d
            else:
                merged = merged.merge(d)
        if not per_block:
            yield merged

    def check_health(self) -> None:
        self.host.check()

    def stats(self) -> dict[str, float]:
        return self.host.stats() | {"pid": os.getpid()}

    def __del__(self) -> None:
        if hasattr(self, "host"):
            self.host.shutdown()


ERRORS = {400: "invalid request (error.param names the field)", 401: "missing or wrong API key",
          404: "unknown model or route", 413: "request body larger than http.max_body_bytes",
          503: "decoder at capacity or unavailable (Retry-After)"}
RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": {"type": "string"},
                                            "description": "with stream=true: server-sent `data:` events"}}},
    **{code: {"model": ErrorResponse, "description": text} for code, text in ERRORS.items()},
}

class _App(FastAPI):
    def add_exception_handler(self, exc_class_or_status_code: Any, handler: Callable) -> None:
        """Ray Serve installs a plain-text BackPressureError handler when the replica starts; ours (OpenAI-style
        JSON with Retry-After, registered below) stays, whichever layer under the ingress refused the request."""
        if exc_class_or_status_code is BackPressureError and BackPressureError in self.exception_handlers:
            return
        super().add_exception_handler(exc_class_or_status_code, handler)


app = _App(title="mbd-lm", description="OpenAI-compatible API for Multi-Block Diffusion LMs")
log = logging.getLogger("ray.serve")


def _openapi() -> dict[str, Any]:
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


app.openapi = _openapi  # type: ignore[method-assign]


class BodyLimit:
    """ASGI middleware: a request body over `app.state.max_body_bytes` is answered 413 before it is parsed
    (by its Content-Length, or while a chunked body is read)."""

    def __init__(self, inner: Any):
        self.inner = inner

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.inner(scope, receive, send)
        limit: int = getattr(app.state, "max_body_bytes", DEFAULT_MAX_BODY)
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            return await self._too_large(limit).response()(scope, receive, send)
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > limit:
                raise StarletteHTTPException(413, self._too_large(limit).message)
            return msg

        await self.inner(scope, counted, send)

    @staticmethod
    def _too_large(limit: int) -> APIError:
        return APIError(413, f"request body exceeds {limit} bytes (http.max_body_bytes)", "body",
                        code="request_too_large")


app.add_middleware(BodyLimit)


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


@app.exception_handler(BackPressureError)
async def _overloaded(_: Request, exc: BackPressureError) -> JSONResponse:
    retry = exc.retry_after_s if exc.retry_after_s is not None else 1
    return APIError(503, "the server is at capacity; retry later", None, "server_error", "overloaded",
                    {"Retry-After": str(math.ceil(retry))}).response()


@app.exception_handler(RequestValidationError)
async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    return from_validation_error(exc).response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, str(exc.detail), "body" if exc.status_code == 413 else None, kind).response()


@app.middleware("http")
async def _auth_and_count(request: Request, call_next: Callable) -> Any:
    """Bearer-token check for /v1/* (before body parsing), and the per-endpoint request counter."""
    key: str | None = getattr(request.app.state, "api_key", None)
    path = request.url.path
    if key and "/v1/" in path:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            response = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                None, "authentication_error", "invalid_api_key").response()
        else:
            response = await call_next(request)
    else:
        response = await call_next(request)
    metrics: IngressMetrics | None = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.request(next((e for e in ENDPOINTS if path.endswith(e)), "other"), response.status_code)
    return response


# ---------------------------------------------------------------- ingress


def _sse_event(obj: Any) -> str:
    return f"data: {obj.model_dump_json()}\n\n"


def _root(e: BaseException) -> BaseException:
    """The decoder's own exception inside Ray's wrapper (a RayTaskError keeps it as `cause`)."""
    return getattr(e, "cause", None) or e


async def _first(gen: DeploymentResponseGenerator) -> Delta:
    """The stream's first item (a handle may raise BackPressureError before it returns an awaitable)."""
    return await gen.__anext__()


@dataclass
class Piece:
    """Text released for one choice, with the tokens (and log-probabilities) that produced it."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None = None  # set on the choice's last piece


class _Choice:
    """One choice = one engine request: its decoder stream, text, token accounting and statistics."""

    def __init__(self, index: int, prompt: list[int], text: TextStream, gen: DeploymentResponseGenerator,
                 first: Delta):
        self.index, self.prompt, self.text, self.gen = index, prompt, text, gen
        self.first = self.last = first
        self.logprobs: list[float] = []
        self.sent = 0  # tokens already reported in pieces

    @property
    def finish_reason(self) -> str:
        return "stop" if self.text.stopped or self.last.finish_reason == "eos" else "length"

    @property
    def token_ids(self) -> list[int]:
        return self.text.token_ids[: self.text.returned_tokens]

    def _piece(self, text: str, upto: int, finish: str | None) -> Piece:
        ids = self.text.token_ids[self.sent:upto]
        lps = self.logprobs[self.sent:upto] if self.last.logprobs is not None else None
        self.sent = max(self.sent, upto)
        return Piece(self.index, text, ids, lps, finish)

    async def pieces(self, sync: Callable) -> AsyncIterator[Piece]:
        """Pieces until the engine finishes or a stop string is hit (detokenization runs through `sync`,
        off the event loop); leaving early (client gone) aborts the request in the engine."""
        done = False
        try:
            d: Delta | None = self.first
            while d is not None:
                self.last = d
                self.logprobs += d.logprobs or []
                text, upto = await sync(self._push, d.token_ids)
                if text:
                    yield self._piece(text, upto, None)
                done = d.finished
                if done or self.text.stopped:
                    break
                d = await anext(self.gen, None)
            tail, upto = await sync(self._finish)
            yield self._piece(tail, upto, self.finish_reason)
        finally:
            if not done:
                self.gen.cancel()

    def _push(self, ids: list[int]) -> tuple[str, int]:
        return self.text.push(ids), self.text.released_tokens

    def _finish(self) -> tuple[str, int]:
        return self.text.finish(), self.text.returned_tokens


async def _merge(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[Piece]:
    """The pieces of several choices as they come; closing it closes every stream (aborting its request)."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for x in only:
                yield x
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(s: AsyncIterator[Piece]) -> None:
        try:
            async with aclosing(s):
                async for x in s:
                    await q.put(x)
            await q.put(None)
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await q.put(e)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            x = await q.get()
            if x is None:
                left -= 1
            elif isinstance(x, Exception):
                raise x
            else:
                yield x
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@serve.deployment
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, decoder: DeploymentHandle, cfg: ServeConfig):
        self.decoder = decoder.options(stream=True)
        self.cfg = cfg
        path = cfg.model.resolved_path()
        self.model_cfg = ModelConfig.from_hf(read_json(path / "config.json"))
        self.tok = Tokenizer.from_dir(path, self.model_cfg)
        self.name = cfg.model.name
        self.max_len = min(cfg.decode.max_length, self.model_cfg.max_position_embeddings)
        self.metrics = IngressMetrics()
        # tokenization and detokenization run here, so that one huge prompt cannot stall the event loop
        self.pool = ThreadPoolExecutor(cfg.ingress.tokenizer_threads, thread_name_prefix="mbd-tokenize")
        app.state.api_key = cfg.http.api_key or os.environ.get("MBD_API_KEY") or None
        app.state.max_body_bytes = cfg.http.max_body_bytes
        app.state.metrics = self.metrics

    async def _sync(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ---- endpoints ----

    @app.get("/health")
    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models", responses={k: RESPONSES[k] for k in (401,)})
    async def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.name, created=now(), max_model_len=self.max_len)])

    @app.post("/v1/completions", responses=RESPONSES)
    async def completions(self, req: CompletionRequest) -> Any:
        t0 = time.perf_counter()
        self._check_model(req)
        if req.echo:
            raise APIError(400, "echo is not supported: a diffusion LM does not score its prompt", "echo")
        if req.logprobs:
            raise APIError(400, f"logprobs={req.logprobs} asks for top alternatives, which are not available: "
                                "logprobs=0 returns each token's own log-probability", "logprobs")
        prompts = await self._sync(self._encode_prompts, req.prompt)
        choices = await self._start(req, prompts)
        rid, created = new_id("cmpl"), now()

        def logprobs(c: _Choice, p: Piece, offset: int) -> CompletionLogprobs | None:
            if p.logprobs is None:
                return None
            tokens = [self.tok.decode([t], skip_special_tokens=False) for t in p.token_ids]
            offsets = [offset + sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
            return CompletionLogprobs(tokens=tokens, token_logprobs=p.logprobs, text_offset=offsets,
                                      top_logprobs=[{}] * len(tokens) if req.logprobs == 0 else None)

        if req.stream:
            offsets = [0] * len(choices)

            def chunk(p: Piece) -> CompletionResponse:
                lp = logprobs(choices[p.index], p, offsets[p.index])
                offsets[p.index] += sum(len(t) for t in lp.tokens) if lp else 0
                return CompletionResponse(id=rid, created=created, model=self.name, choices=[CompletionChoice(
                    index=p.index, text=p.text, logprobs=lp, finish_reason=p.finish_reason,
                    token_ids=p.token_ids if req.return_token_ids else None)])

            def tail(usage: Usage | None, stats: MBDStats) -> CompletionResponse:
                return CompletionResponse(id=rid, created=created, model=self.name, choices=[], usage=usage, mbd=stats)

            return self._event_stream(self._events(req, choices, prompts, t0, chunk, tail))
        texts = await self._collect(choices, prompts, t0)
        out = []
        for c, text in zip(choices, texts):
            full = Piece(c.index, text, c.token_ids, c.logprobs[: len(c.token_ids)] if req.logprobs is not None
                         else None)
            out.append(CompletionChoice(index=c.index, text=text, logprobs=logprobs(c, full, 0),
                                        finish_reason=c.finish_reason,
                                        token_ids=full.token_ids if req.return_token_ids else None))
        return CompletionResponse(id=rid, created=created, model=self.name, choices=out,
                                  usage=self._usage(prompts, choices), mbd=self._stats(req, choices))

    @app.post("/v1/chat/completions", responses=RESPONSES)
    async def chat(self, req: ChatCompletionRequest) -> Any:
        t0 = time.perf_counter()
        self._check_model(req)
        if req.top_logprobs:
            raise APIError(400, f"top_logprobs={req.top_logprobs} asks for top alternatives, which are not "
                                "available: logprobs=true returns each token's own log-probability", "top_logprobs")
        messages = self._messages(req)
        ids = await self._sync(self._encode_chat, messages)
        prompts = [ids]
        choices = await self._start(req, prompts)
        rid, created = new_id("chatcmpl"), now()

        def logprobs(p: Piece) -> ChatLogprobs | None:
            if p.logprobs is None:
                return None
            tokens = [self.tok.decode([t], skip_special_tokens=False) for t in p.token_ids]
            return ChatLogprobs(content=[TokenLogprob(token=t, logprob=lp, bytes=list(t.encode()))
                                         for t, lp in zip(tokens, p.logprobs)])

        if req.stream:
            def chunk(p: Piece) -> ChatCompletionChunk:
                return ChatCompletionChunk(id=rid, created=created, model=self.name, choices=[ChatChunkChoice(
                    index=p.index, delta=DeltaMessage(content=p.text) if p.text or not p.finish_reason else
                    DeltaMessage(), logprobs=logprobs(p), finish_reason=p.finish_reason,
                    token_ids=p.token_ids if req.return_token_ids else None)])

            def tail(usage: Usage | None, stats: MBDStats) -> ChatCompletionChunk:
                return ChatCompletionChunk(id=rid, created=created, model=self.name, choices=[], usage=usage,
                                           mbd=stats)

            heads = [ChatCompletionChunk(id=rid, created=created, model=self.name, choices=[
                ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))]) for c in choices]
            return self._event_stream(self._events(req, choices, prompts, t0, chunk, tail, heads))
        texts = await self._collect(choices, prompts, t0)
        out = []
        for c, text in zip(choices, texts):
            full = Piece(c.index, text, c.token_ids, c.logprobs[: len(c.token_ids)] if req.logprobs else None)
            out.append(ChatChoice(index=c.index, message=AssistantMessage(content=text), logprobs=logprobs(full),
                                  finish_reason=c.finish_reason,
                                  token_ids=full.token_ids if req.return_token_ids else None))
        return ChatCompletionResponse(id=rid, created=created, model=self.name, choices=out,
                                      usage=self._usage(prompts, choices), mbd=self._stats(req, choices))

    # ---- validation ----

    def _encode_prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        """One token list per prompt (a string, a token-id list, or a list of either)."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts, fields = [prompt], ["prompt"]
        else:
            prompts, fields = list(prompt), [f"prompt[{i}]" for i in range(len(prompt))]
        if not prompts:
            raise APIError(400, "'prompt' is empty: send at least one token", "prompt")
        if len(prompts) > self.cfg.limits.max_choices:
            raise APIError(400, f"'prompt' has {len(prompts)} prompts; at most {self.cfg.limits.max_choices} "
                                "(limits.max_choices) fit in one request", "prompt")
        out = []
        for p, field in zip(prompts, fields):
            ids = self.tok.encode(p) if isinstance(p, str) else list(p)
            self._check_ids(ids, field)
            out.append(ids)
        return out

    def _messages(self, req: ChatCompletionRequest) -> list[dict[str, str]]:
        """Messages with plain-string content: text parts are joined, any other part type is refused."""
        out = []
        for i, m in enumerate(req.messages):
            content = m.content
            if not isinstance(content, str):
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        what = "a text part without 'text'" if part.type == "text" else f"type '{part.type}'"
                        raise APIError(400, f"messages[{i}].content[{j}]: content part {what} is not supported: this "
                                            "model reads only {'type': 'text', 'text': ...} parts",
                                       f"messages[{i}].content[{j}].type")
                content = "".join(part.text or "" for part in content)
            out.append({"role": m.role, "content": content})
        return out

    def _encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        try:
            ids = self.tok.encode_chat(messages)
        except TokenizerError as e:
            raise APIError(400, str(e), "messages") from e
        self._check_ids(ids, "messages")
        return ids

    def _check_ids(self, ids: list[int], field: str) -> None:
        if not ids:
            raise APIError(400, f"'{field}' is empty: send at least one token", field)
        bad = next((t for t in ids if not 0 <= t < self.model_cfg.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"'{field}' has token id {bad} outside [0, {self.model_cfg.vocab_size})", field)
        if self.model_cfg.mask_token_id in ids:
            raise APIError(400, f"'{field}' contains the mask token (id {self.model_cfg.mask_token_id}), which is "
                                "reserved for diffusion decoding", field)
        if len(ids) >= self.max_len:
            raise APIError(400, f"'{field}' is {len(ids)} tokens; this model's context is {self.max_len} tokens, "
                                f"so at most {self.max_len - 1} prompt tokens fit", field, code="context_length_exceeded")

    def _check_model(self, req: SamplingFields) -> None:
        if req.model != self.name:
            raise APIError(404, f"model '{req.model}' does not exist; this server serves '{self.name}' "
                                "(see GET /v1/models)", "model", "not_found_error", "model_not_found")

    def _params(self, req: SamplingFields, n_prompt: int) -> DecodeConfig:
        """Per-request DecodeConfig: the deployment's, overridden by the request within the deployment's bounds."""
        d, lim = self.cfg.decode, self.cfg.limits
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name) not in (None, 0):
                raise APIError(400, f"{name}={getattr(req, name)} is not supported: a diffusion LM decodes blocks in "
                                    "parallel, so no token history penalty applies; only 0 is accepted", name)
        room = self.max_len - n_prompt
        cap = min(d.max_new_tokens, room)
        limit, field = req.token_limit()
        if req.max_tokens is not None and limit != req.max_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens differ: send one of them", "max_tokens")
        max_tokens = limit if limit is not None else min(lim.default_max_tokens or cap, cap)
        if max_tokens > d.max_new_tokens:
            raise APIError(400, f"{field}={max_tokens} exceeds this deployment's limit of {d.max_new_tokens}", field)
        if max_tokens > room:
            raise APIError(400, f"prompt ({n_prompt} tokens) + {field} ({max_tokens}) exceeds the context "
                                f"length {self.max_len}", field, code="context_length_exceeded")
        if req.temperature is not None and req.temperature > lim.max_temperature:
            raise APIError(400, f"temperature={req.temperature} exceeds the maximum {lim.max_temperature}",
                           "temperature")
        if req.buffer_size is not None and req.buffer_size > d.buffer_size:
            raise APIError(400, f"buffer_size={req.buffer_size} exceeds the deployment's Block Buffer of "
                                f"{d.buffer_size} slots", "buffer_size")
        if any(not s for s in req.stop_list()):
            raise APIError(400, "'stop' strings must not be empty", "stop")
        update: dict[str, Any] = {k: getattr(req, k) for k in MBD_FIELDS if getattr(req, k) is not None}
        update |= {"max_new_tokens": max_tokens, "ignore_eos": req.ignore_eos, "logprobs": req.wants_logprobs()}
        update |= {k: getattr(req, k) for k in ("temperature", "top_p", "seed") if getattr(req, k) is not None}
        if req.top_k is not None:
            update["top_k"] = max(req.top_k, 0)  # vLLM's -1 = all tokens = our 0
        try:
            return DecodeConfig.model_validate(d.model_dump() | update)
        except ValidationError as e:
            err = e.errors()[0]
            param = field_path(tuple(err["loc"])) or "buffer_size"
            raise APIError(400, f"invalid decoding parameters: {err['msg']}", param) from e

    # ---- generation ----

    async def _start(self, req: SamplingFields, prompts: list[list[int]]) -> list[_Choice]:
        """Start n engine requests per prompt (choice index = prompt * n + k, seed = seed + k) and wait for the
        first block of each: it decides the HTTP status (200, 400 or 503)."""
        if len(prompts) * req.n > self.cfg.limits.max_choices:
            raise APIError(400, f"{len(prompts)} prompt(s) x n={req.n} choices exceed the limit of "
                                f"{self.cfg.limits.max_choices} (limits.max_choices)", "n")
        params = self._params(req, max(len(p) for p in prompts))
        # blocks one by one only when someone looks at them: an SSE client, or stop strings that may end early
        per_block = req.stream or bool(req.stop_list())
        gens = [self.decoder.generate.remote(ids, params.model_copy(update={"seed": params.seed + k}), per_block)
                for ids in prompts for k in range(req.n)]
        firsts = await asyncio.gather(*(_first(g) for g in gens), return_exceptions=True)
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is not None:
            for g, f in zip(gens, firsts):
                if not isinstance(f, BaseException):  # cancelling a refused request re-raises its BackPressureError
                    g.cancel()
            if isinstance(failed, ValueError):  # the decoder's own validation (the checks above should catch it)
                raise APIError(400, str(_root(failed))) from failed
            if isinstance(failed, BackPressureError):
                retry = failed.retry_after_s if failed.retry_after_s is not None else self.cfg.decoder.retry_after_s
                raise APIError(503, "the server is at capacity; retry later", None, "server_error", "overloaded",
                               {"Retry-After": str(math.ceil(retry))}) from failed
            log.error("decoder unavailable: %r", failed)  # a failed or restarting replica: the client should retry
            raise APIError(503, "decoder unavailable; retry later", None, "server_error",
                           headers={"Retry-After": str(math.ceil(self.cfg.decoder.retry_after_s))}) from failed
        stops = req.stop_list()
        return [_Choice(i, prompts[i // req.n], TextStream(self.tok, stops), g, f)
                for i, (g, f) in enumerate(zip(gens, firsts))]

    async def _collect(self, choices: list[_Choice], prompts: list[list[int]], t0: float) -> list[str]:
        texts = [""] * len(choices)
        try:
            async with aclosing(_merge([c.pieces(self._sync) for c in choices])) as pieces:
                async for p in pieces:
                    texts[p.index] += p.text
        except Exception as e:  # noqa: BLE001 - replica died mid-request; details stay in the server log
            log.exception("generation failed")
            raise APIError(503, "generation failed; retry the request", None, "server_error",
                           headers={"Retry-After": str(math.ceil(self.cfg.decoder.retry_after_s))}) from e
        self._record(choices, prompts, t0)
        return texts

    async def _events(self, req: SamplingFields, choices: list[_Choice], prompts: list[list[int]], t0: float,
                      chunk: Callable[[Piece], Any], tail: Callable[[Usage | None, MBDStats], Any],
                      heads: list[Any] = ()) -> AsyncIterator[str]:
        """The SSE stream: per-choice chunks as text is released, then (stream_options.include_usage) a chunk
        with no choices and the usage; the MBD statistics ride on the last chunk. A failure mid-way ends every
        unfinished choice with finish_reason "error" and an error event (details stay in the server log)."""
        finished: set[int] = set()
        last: Any = None
        continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats
        try:
            for h in heads:
                if continuous:
                    h.usage = self._usage(prompts, choices, so_far=True)
                yield _sse_event(h)
            async with aclosing(_merge([c.pieces(self._sync) for c in choices])) as pieces:
                async for p in pieces:
                    if p.finish_reason is not None:
                        finished.add(p.index)
                    if last is not None:
                        yield _sse_event(last)
                    last = chunk(p)
                    if continuous:
                        last.usage = self._usage(prompts, choices, so_far=True)
            self._record(choices, prompts, t0)
            stats = self._stats(req, choices)
            if req.stream_options is not None and req.stream_options.include_usage:
                if last is not None:
                    yield _sse_event(last)
                yield _sse_event(tail(self._usage(prompts, choices), stats))
            elif last is not None:
                last.mbd = stats
                yield _sse_event(last)
        except Exception:  # noqa: BLE001 - the status line is sent already: report in-band
            log.exception("generation failed mid-stream")
            if last is not None:
                yield _sse_event(last)
            for c in choices:
                if c.index not in finished:
                    yield _sse_event(chunk(Piece(c.index, "", [], None, "error")))
            err = ErrorResponse(error=ErrorBody(message="generation failed; retry the request", type="server_error"))
            yield _sse_event(err)
        yield "data: [DONE]\n\n"

    @staticmethod
    def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _record(self, choices: list[_Choice], prompts: list[list[int]], t0: float) -> None:
        u = self._usage(prompts, choices)
        self.metrics.finished(u.prompt_tokens, u.completion_tokens, sum(c.last.nfe for c in choices),
                              (time.perf_counter() - t0) * 1e3)

    @staticmethod
    def _usage(prompts: list[list[int]], choices: list[_Choice], so_far: bool = False) -> Usage:
        """Prompt tokens once per prompt; completion tokens: those returned (cut at a stop string), or with
        so_far those sent in the stream up to now."""
        n_prompt = sum(len(p) for p in prompts)
        n = sum(c.sent if so_far else c.text.returned_tokens for c in choices)
        return Usage(prompt_tokens=n_prompt, completion_tokens=n, total_tokens=n_prompt + n)

    def _stats(self, req: SamplingFields, choices: list[_Choice]) -> MBDStats:
        nfe, gen = sum(c.last.nfe for c in choices), sum(c.last.num_generated for c in choices)
        buf = req.buffer_size or self.cfg.decode.buffer_size
        return MBDStats(nfe=nfe, tpf=round(gen / nfe, 4) if nfe else 0.0, num_generated=gen, buffer_size=buf)


# ---------------------------------------------------------------- application


def build_app(args: dict[str, Any]) -> serve.Application:
    """`serve run serve_app.app:build_app config=PATH`: the whole application from one serve YAML
    (args may also carry a ready ServeConfig under 'serve_config', as `mbd serve` and the tests do)."""
    cfg = args.get("serve_config")
    if cfg is None:
        if "config" not in args:
            raise ValueError("build_app needs args 'config': path to a configs/serve/*.yaml file")
        cfg = load_serve_config(args["config"])
    spec = cfg.model.model_copy(update={"path": str(cfg.model.resolved_path())})
    cfg = cfg.model_copy(update={"model": spec})
    for f in ("config.json", "tokenizer.json"):
        if not (spec.resolved_path() / f).is_file():
            raise FileNotFoundError(f"model.path: {spec.path} has no {f} (expected a HuggingFace-format model dir)")
    dec = cfg.decoder
    rank_res = {"CPU": spec.num_cpus_per_rank} | ({"GPU": spec.num_gpus_per_rank} if spec.num_gpus_per_rank else {})
    decoder = Decoder.options(
        ray_actor_options={"num_cpus": spec.num_cpus_per_rank, "num_gpus": spec.num_gpus_per_rank},
        placement_group_bundles=[rank_res] * spec.tensor_parallel_size,
        placement_group_strategy="STRICT_PACK",
        max_ongoing_requests=dec.max_ongoing_requests,
        max_queued_requests=dec.max_queued_requests,
        backpressure_config={"retry_after_s": dec.retry_after_s},
        autoscaling_config=dec.autoscaling.model_dump() | {"initial_replicas": max(1, dec.autoscaling.min_replicas)},
        health_check_period_s=dec.health_check_period_s,
        health_check_timeout_s=dec.health_check_timeout_s,
        logging_config={"enable_access_log": False},  # an internal hop: the ingress logs the HTTP request
    ).bind(spec, cfg.decode, cfg.engine)
    ing = cfg.ingress
    return OpenAIIngress.options(
        num_replicas=ing.num_replicas, max_ongoing_requests=ing.max_ongoing_requests,
        ray_actor_options={"num_cpus": ing.num_cpus},
    ).bind(decoder, cfg)
