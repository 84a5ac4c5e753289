"""OpenAI-compatible Ray Serve application: a FastAPI ingress in front of autoscaled decoder replicas.

- `OpenAIIngress` (CPU, cheap) validates and tokenizes requests, detokenizes committed blocks into text,
  applies stop strings and speaks HTTP/SSE. Nothing malformed gets past it.
- `Decoder` hosts the Block Buffer engine (actors/decoder.py): one replica = one placement group =
  tensor_parallel_size ranks. It streams each request's committed blocks back to the ingress.

Splitting them lets GPU replicas scale on `target_ongoing_requests` while HTTP stays on CPU, and lets the
decoder's `max_queued_requests` back-pressure surface as a clean 503 with Retry-After.
`serve run serve_app.app:build_app config=configs/serve/tiny.yaml` or `mbd serve --config ...`.
"""

import hmac
import math
import os
import time
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.decoder import Delta, EngineHost
from actors.tp_worker import ModelSpec
from mbd.config import DecodeConfig, ModelConfig, read_json
from mbd.tokenizer import Tokenizer, TokenizerError
from serve_app.config import ServeConfig, load_serve_config
from serve_app.metrics import DecoderMetrics, IngressMetrics
from serve_app.protocol import (APIError, AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                ChatCompletionRequest, ChatCompletionResponse, CompletionChoice,
                                CompletionRequest, CompletionResponse, DeltaMessage, ErrorBody, ErrorResponse,
                                MBDStats, ModelCard, ModelList, SamplingFields, Usage, field_path,
                                from_validation_error, new_id, now)
from serve_app.textstream import TextStream

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health")
MBD_FIELDS = ("buffer_size", "tau_add", "tau_semi", "tau_stable", "tau_m2t", "tau_t2t")


# ---------------------------------------------------------------- decoder deployment


@serve.deployment
class Decoder:
    """Engine host replica: streams each request's committed blocks. With `per_block=False` they are merged into
    one final Delta, so a non-streaming request costs one Ray stream item instead of one per block."""

    def __init__(self, spec: ModelSpec, decode: DecodeConfig):
        self.metrics = DecoderMetrics()
        self.host = EngineHost(spec, decode, on_queue_length=self.metrics.set_queue_length)

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


app = FastAPI(title="mbd-lm", description="OpenAI-compatible API for Multi-Block Diffusion LMs")


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


@app.exception_handler(RequestValidationError)
async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    return from_validation_error(exc).response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, str(exc.detail), None, kind).response()


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


async def _after(first: Delta, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    yield first
    async for d in rest:
        yield d


def _root(e: BaseException) -> BaseException:
    """The decoder's own exception inside Ray's wrapper (a RayTaskError keeps it as `cause`)."""
    return getattr(e, "cause", None) or e


class _Run:
    """One request's progress through the decoder stream: text, token counts and engine statistics."""

    def __init__(self, text: TextStream, t0: float, first: Delta):
        self.text = text
        self.t0 = t0
        self.first = first
        self.last = first
        self.first_block_ms: float | None = None

    @property
    def finish_reason(self) -> str:
        return "stop" if self.text.stopped or self.last.finish_reason == "eos" else "length"


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
        app.state.api_key = cfg.http.api_key or os.environ.get("MBD_API_KEY") or None
        app.state.metrics = self.metrics

    # ---- endpoints ----

    @app.get("/health")
    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.name, created=now(), max_model_len=self.max_len)])

    @app.post("/v1/completions")
    async def completions(self, req: CompletionRequest) -> Any:
        t0 = time.perf_counter()
        self._check_model(req)
        ids = self._prompt_ids(req.prompt)
        run, gen = await self._start(req, ids, t0)
        rid, created = new_id("cmpl"), now()

        def chunk(text: str, final: bool) -> CompletionResponse:
            return CompletionResponse(
                id=rid, created=created, model=self.name,
                choices=[CompletionChoice(text=text, finish_reason=run.finish_reason if final else None)],
                usage=self._usage(ids, run) if final and self._with_usage(req) else None,
                mbd=self._stats(req, run) if final else None)

        if req.stream:
            return self._event_stream(self._chunks(run, gen, ids, lambda t: chunk(t, False), lambda: chunk("", True)))
        text = await self._collect(run, gen, ids)
        return CompletionResponse(id=rid, created=created, model=self.name,
                                  choices=[CompletionChoice(text=text, finish_reason=run.finish_reason)],
                                  usage=self._usage(ids, run), mbd=self._stats(req, run))

    @app.post("/v1/chat/completions")
    async def chat(self, req: ChatCompletionRequest) -> Any:
        t0 = time.perf_counter()
        self._check_model(req)
        try:
            ids = self.tok.encode_chat([m.model_dump(exclude_none=True) for m in req.messages])
        except TokenizerError as e:
            raise APIError(400, str(e), "messages") from e
        self._check_ids(ids, "messages")
        run, gen = await self._start(req, ids, t0)
        rid, created = new_id("chatcmpl"), now()

        def chunk(delta: DeltaMessage, final: bool) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=rid, created=created, model=self.name,
                choices=[ChatChunkChoice(delta=delta, finish_reason=run.finish_reason if final else None)],
                usage=self._usage(ids, run) if final and self._with_usage(req) else None,
                mbd=self._stats(req, run) if final else None)

        if req.stream:
            head = chunk(DeltaMessage(role="assistant", content=""), False)
            return self._event_stream(self._chunks(run, gen, ids, lambda t: chunk(DeltaMessage(content=t), False),
                                          lambda: chunk(DeltaMessage(), True), head))
        text = await self._collect(run, gen, ids)
        return ChatCompletionResponse(
            id=rid, created=created, model=self.name,
            choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=run.finish_reason)],
            usage=self._usage(ids, run), mbd=self._stats(req, run))

    # ---- validation ----

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        ids = self.tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_ids(ids, "prompt")
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
        if req.n != 1:
            raise APIError(400, f"n={req.n} is not supported: only n=1; send separate requests instead", "n")
        room = self.max_len - n_prompt
        cap = min(d.max_new_tokens, room)
        max_tokens = req.max_tokens if req.max_tokens is not None else min(lim.default_max_tokens or cap, cap)
        if max_tokens > d.max_new_tokens:
            raise APIError(400, f"max_tokens={max_tokens} exceeds this deployment's limit of {d.max_new_tokens}",
                           "max_tokens")
        if max_tokens > room:
            raise APIError(400, f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the context "
                                f"length {self.max_len}", "max_tokens", code="context_length_exceeded")
        if req.temperature is not None and req.temperature > lim.max_temperature:
            raise APIError(400, f"temperature={req.temperature} exceeds the maximum {lim.max_temperature}",
                           "temperature")
        if req.buffer_size is not None and req.buffer_size > d.buffer_size:
            raise APIError(400, f"buffer_size={req.buffer_size} exceeds the deployment's Block Buffer of "
                                f"{d.buffer_size} slots", "buffer_size")
        if any(not s for s in req.stop_list()):
            raise APIError(400, "'stop' strings must not be empty", "stop")
        update: dict[str, Any] = {k: getattr(req, k) for k in MBD_FIELDS if getattr(req, k) is not None}
        update["max_new_tokens"] = max_tokens
        if req.temperature is not None:
            update["temperature"] = req.temperature
        if req.seed is not None:
            update["seed"] = req.seed
        try:
            return DecodeConfig.model_validate(d.model_dump() | update)
        except ValidationError as e:
            err = e.errors()[0]
            param = field_path(tuple(err["loc"])) or "buffer_size"
            raise APIError(400, f"invalid decoding parameters: {err['msg']}", param) from e

    # ---- generation ----

    async def _start(self, req: SamplingFields, ids: list[int], t0: float) -> tuple[_Run, DeploymentResponseGenerator]:
        params = self._params(req, len(ids))
        # blocks one by one only when someone looks at them: an SSE client, or stop strings that may end early
        gen = self.decoder.generate.remote(ids, params, req.stream or bool(req.stop_list()))
        try:  # the first block (or the whole result) decides the HTTP status: 200, 400 or 503
            first = await gen.__anext__()
        except ValueError as e:  # the decoder's own validation (the checks above should have caught it)
            raise APIError(400, str(_root(e))) from e
        except BackPressureError as e:
            retry = e.retry_after_s if e.retry_after_s is not None else self.cfg.decoder.retry_after_s
            raise APIError(503, "the server is at capacity; retry later", None, "server_error", "overloaded",
                           {"Retry-After": str(math.ceil(retry))}) from e
        except Exception as e:  # noqa: BLE001 - a failed or restarting replica: the client should retry
            gen.cancel()
            raise APIError(503, f"decoder unavailable: {type(e).__name__}", None, "server_error",
                           headers={"Retry-After": str(math.ceil(self.cfg.decoder.retry_after_s))}) from e
        return _Run(TextStream(self.tok, req.stop_list()), t0, first), gen

    async def _deltas(self, run: _Run, gen: DeploymentResponseGenerator) -> AsyncIterator[str]:
        """Text deltas until the engine finishes or a stop string is hit; leaving early aborts the request."""
        done = False
        try:
            async for d in _after(run.first, gen):
                run.last = d
                if d.token_ids and run.first_block_ms is None:
                    run.first_block_ms = (time.perf_counter() - run.t0) * 1e3
                    self.metrics.ttfb.observe(run.first_block_ms)
                text = run.text.push(d.token_ids)
                if text:
                    yield text
                done = d.finished
                if done or run.text.stopped:
                    break
            tail = run.text.finish()
            if tail:
                yield tail
        finally:
            if not done:
                gen.cancel()

    def _record(self, run: _Run, ids: list[int]) -> None:
        self.metrics.finished(len(ids), len(run.text.token_ids), run.last.nfe,
                              (time.perf_counter() - run.t0) * 1e3)

    async def _collect(self, run: _Run, gen: DeploymentResponseGenerator, ids: list[int]) -> str:
        try:
            text = "".join([t async for t in self._deltas(run, gen)])
        except ValueError as e:  # refused by the engine
            raise APIError(400, str(_root(e))) from e
        except Exception as e:  # noqa: BLE001 - replica died mid-request
            raise APIError(503, f"decoder failed during generation: {type(e).__name__}; retry", None,
                           "server_error", headers={"Retry-After": str(math.ceil(self.cfg.decoder.retry_after_s))}) from e
        self._record(run, ids)
        return text

    async def _chunks(self, run: _Run, gen: DeploymentResponseGenerator, ids: list[int],
                      piece: Callable[[str], Any], final: Callable[[], Any], head: Any = None) -> AsyncIterator[str]:
        try:
            if head is not None:
                yield _sse_event(head)
            async for t in self._deltas(run, gen):
                yield _sse_event(piece(t))
            self._record(run, ids)
            yield _sse_event(final())
        except Exception as e:  # noqa: BLE001 - the status line is sent already: report in-band, like OpenAI
            cause = _root(e)
            err = ErrorResponse(error=ErrorBody(message=f"generation failed: {type(cause).__name__}: {cause}",
                                                type="server_error"))
            yield _sse_event(err)
        yield "data: [DONE]\n\n"

    @staticmethod
    def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @staticmethod
    def _with_usage(req: SamplingFields) -> bool:
        return req.stream_options is None or req.stream_options.include_usage or not req.stream

    def _usage(self, ids: list[int], run: _Run) -> Usage:
        n = len(run.text.token_ids)
        return Usage(prompt_tokens=len(ids), completion_tokens=n, total_tokens=len(ids) + n)

    def _stats(self, req: SamplingFields, run: _Run) -> MBDStats:
        nfe, gen = run.last.nfe, run.last.num_generated
        buf = req.buffer_size or self.cfg.decode.buffer_size
        return MBDStats(nfe=nfe, tpf=round(gen / nfe, 4) if nfe else 0.0, num_generated=gen, buffer_size=buf,
                        token_ids=list(run.text.token_ids) if req.return_token_ids else None)


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
    ).bind(spec, cfg.decode)
    ing = cfg.ingress
    return OpenAIIngress.options(
        num_replicas=ing.num_replicas, max_ongoing_requests=ing.max_ongoing_requests,
        ray_actor_options={"num_cpus": ing.num_cpus},
    ).bind(decoder, cfg)
