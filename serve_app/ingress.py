"""The HTTP ingress deployment (CPU, cheap): validates and tokenizes requests, starts one decoder request per
choice, detokenizes committed blocks into text, applies stop strings and answers in JSON or SSE.

Each replica builds its own FastAPI app (`__serve_build_asgi_app__`, serve_app/routes.py) from its own config,
so nothing a replica holds is module-global.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Any, Callable

from fastapi import FastAPI
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from actors.messages import RequestFailed, RequestQuarantined
from actors.trace import Trace
from mbd.checkpoint_files import read_model_config
from mbd.config import DecodeConfig
from mbd.decoding.constraint_spec import ConstraintSpec
from mbd.decoding.outputs import StepOutput
from mbd.decoding.validate import EngineLimits, RequestError
from mbd.detokenize import TextStream
from mbd.tokenizer import Tokenizer
from serve_app import sse
from serve_app.choices import Choice, Piece, latencies, mbd_stats, merge, usage
from serve_app.config import ServeConfig
from serve_app.convert import RequestConverter, bad_request
from serve_app.errors import internal, overloaded, unavailable
from serve_app.metrics import IngressMetrics
from serve_app.protocol import (MASK_GLYPH, AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, CompletionChoice,
                                CompletionLogprobs, CompletionRequest, CompletionResponse, DeltaMessage, MBDStats,
                                ModelCard, ModelList, Provisional, ProvisionalBlock, SamplingFields, TokenLogprob,
                                Usage, new_id, now)

log = logging.getLogger("ray.serve")
INLINE_COST = 1024  # characters or tokens (de)tokenized on the event loop; more go to the tokenizer pool
MESSAGE_COST = 64  # a chat message's own cost in the chat template's render, however short its content
HEALTH_TIMEOUT_S = 2.0  # how long /health waits for a decoder replica to say how its engine is


def _root(e: BaseException) -> BaseException:
    """The decoder's own exception inside Ray's wrapper (a RayTaskError keeps it as `cause`)."""
    return getattr(e, "cause", None) or e


def _replica_gone(e: BaseException) -> bool:
    """The request's replica itself is gone (killed, its node lost): the only failure the ingress recovers from,
    by starting the request elsewhere. An engine process that died is the replica's to recover (it re-runs the
    requests that had sent nothing, actors/engine_host.py); one it gave up on answers 503, a quarantined request
    500."""
    return isinstance(e, RayActorError)


def _size(prompt: str | list) -> int:
    """Characters or token ids in a prompt field (a string, ids, or a list of either)."""
    return len(prompt) if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else \
        sum(_size(p) for p in prompt)


def chat_cost(messages: list[dict[str, Any]]) -> int:
    """What rendering and tokenizing a chat costs, in INLINE_COST's units: its characters, plus MESSAGE_COST per
    message (the template loops over messages: 140k empty ones must not render on the event loop)."""
    return sum(len(m["content"]) + MESSAGE_COST for m in messages)


async def _first(gen: DeploymentResponseGenerator) -> tuple[StepOutput, float]:
    """The stream's first item and when it arrived (a handle may raise BackPressureError before it returns an
    awaitable)."""
    return await gen.__anext__(), time.perf_counter()


@serve.deployment
@serve.ingress()
class OpenAIIngress:
    def __init__(self, decoder: DeploymentHandle, cfg: ServeConfig):
        # Serve's replica-to-replica gRPC path (`_by_reference=False`, what Serve's throughput-optimized mode makes
        # the default) instead of a Ray actor task per request: on the tiny model 106 -> 122 requests/s at 32
        # clients (docs/performance.md). The handle arrives with the driver's options, so it is set here.
        self.decoder = decoder.options(stream=True, _by_reference=False)
        self._decoder = decoder
        self.cfg = cfg
        path = cfg.model.resolved_path()
        self.tok = Tokenizer.from_dir(path, read_model_config(path))
        self.convert = RequestConverter(cfg, self.tok)
        self.name = cfg.model.name
        self.metrics = IngressMetrics(self.name)
        self.trace = Trace("ingress")
        # tokenization and detokenization run here, so that one huge prompt cannot stall the event loop
        self.pool = ThreadPoolExecutor(cfg.ingress.tokenizer_threads, thread_name_prefix="mbd-tokenize")

    def __serve_build_asgi_app__(self) -> FastAPI:
        from serve_app.routes import http_app

        return http_app(self, api_key=self.cfg.http.api_key or os.environ.get("MBD_API_KEY") or None)

    async def _limits(self) -> EngineLimits:
        """The engine's limits, asked of a decoder replica once (every replica serves the same model and config)."""
        if self.convert.limits is None:
            try:
                self.convert.limits = await self._decoder.limits.remote()
            except Exception as e:  # noqa: BLE001 - no replica is up yet
                log.error("decoder unavailable: %r", e)
                raise unavailable("decoder unavailable; retry later", self.cfg.decoder.retry_after_s) from e
        return self.convert.limits

    async def _sync(self, cost: int, fn: Callable, *args: Any) -> Any:
        """fn(*args), inline when its input is small (cost: characters or tokens), else in the tokenizer pool:
        handing a few hundred characters to a pool thread costs more than (de)tokenizing them, while a huge
        prompt must not stall the event loop."""
        if cost <= INLINE_COST:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ---- endpoints ----

    async def health(self) -> str:
        """The engine state of the decoder replica this call reaches: "ok", "restarting" (it is starting a new
        engine process; requests wait for it), "failed" (Serve is replacing it), or "unavailable" when no replica
        answers in time. The ingress itself is up whenever this answers."""
        call = self._decoder.engine_state.remote()
        try:
            return await asyncio.wait_for(call, HEALTH_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - no replica up, or it died: say so, do not fail the probe
            call.cancel()
            log.warning("health: no decoder replica answered: %r", e)
            return "unavailable"

    async def models(self) -> ModelList:
        limits = await self._limits()
        return ModelList(data=[ModelCard(id=self.name, created=now(), max_model_len=limits.max_length)])

    async def completions(self, req: CompletionRequest) -> Any:
        t0, rid, created = time.perf_counter(), new_id("cmpl"), now()
        self.trace.mark(rid, "recv")
        await self._limits()
        self.convert.check_completion(req)
        prompts = await self._sync(_size(req.prompt), self.convert.encode_prompts, req.prompt)
        choices = await self._start(rid, req, prompts)

        def logprobs(p: Piece, offset: int) -> CompletionLogprobs | None:
            if p.logprobs is None:
                return None
            tokens = [self.tok.decode([t], skip_special_tokens=False) for t in p.token_ids]
            offsets = [offset + sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
            tops = [{self._text(i): v for i, v in top} for top in p.top_logprobs or [[]] * len(tokens)]
            return CompletionLogprobs(tokens=tokens, token_logprobs=p.logprobs, text_offset=offsets,
                                      top_logprobs=tops if req.logprobs is not None else None)

        if req.stream:
            offsets = [0] * len(choices)

            def chunk(p: Piece) -> CompletionResponse:
                lp = logprobs(p, offsets[p.index])
                offsets[p.index] += sum(len(t) for t in lp.tokens) if lp else 0
                return CompletionResponse(id=rid, created=created, model=self.name, choices=[CompletionChoice(
                    index=p.index, text=p.text, logprobs=lp, finish_reason=p.finish_reason,
                    token_ids=p.token_ids if req.return_token_ids else None, provisional=self._provisional(p))])

            def tail(u: Usage | None, stats: MBDStats) -> CompletionResponse:
                return CompletionResponse(id=rid, created=created, model=self.name, choices=[], usage=u, mbd=stats)

            return self._stream(req, choices, prompts, t0, chunk, tail)
        choices, texts = await self._collect(rid, req, prompts, choices, t0)
        out = []
        for c, text in zip(choices, texts):
            full = Piece(c.index, text, c.token_ids, c.logprobs[: len(c.token_ids)] if req.logprobs is not None
                         else None, top_logprobs=c.top_logprobs[: len(c.token_ids)] or None)
            out.append(CompletionChoice(index=c.index, text=text, logprobs=logprobs(full, 0),
                                        finish_reason=c.finish_reason,
                                        token_ids=full.token_ids if req.return_token_ids else None))
        return CompletionResponse(id=rid, created=created, model=self.name, choices=out,
                                  usage=usage(prompts, choices), mbd=self._stats(req, choices))

    async def chat(self, req: ChatCompletionRequest) -> Any:
        t0, rid, created = time.perf_counter(), new_id("chatcmpl"), now()
        self.trace.mark(rid, "recv")
        await self._limits()
        self.convert.check_chat(req)
        messages = self.convert.messages(req)
        prompts = [await self._sync(chat_cost(messages), self.convert.encode_chat, messages)]
        choices = await self._start(rid, req, prompts)

        def logprobs(p: Piece) -> ChatLogprobs | None:
            if p.logprobs is None:
                return None
            tokens = [self.tok.decode([t], skip_special_tokens=False) for t in p.token_ids]
            tops = p.top_logprobs or [[]] * len(tokens)
            return ChatLogprobs(content=[TokenLogprob(token=t, logprob=lp, bytes=list(t.encode()), top_logprobs=[
                {"token": self._text(i), "logprob": v, "bytes": list(self._text(i).encode())} for i, v in top])
                for t, lp, top in zip(tokens, p.logprobs, tops)])

        if req.stream:
            def chunk(p: Piece) -> ChatCompletionChunk:
                return ChatCompletionChunk(id=rid, created=created, model=self.name, choices=[ChatChunkChoice(
                    index=p.index, delta=DeltaMessage(content=p.text) if p.text or not p.finish_reason else
                    DeltaMessage(), logprobs=logprobs(p), finish_reason=p.finish_reason,
                    token_ids=p.token_ids if req.return_token_ids else None, provisional=self._provisional(p))])

            def tail(u: Usage | None, stats: MBDStats) -> ChatCompletionChunk:
                return ChatCompletionChunk(id=rid, created=created, model=self.name, choices=[], usage=u, mbd=stats)

            heads = [ChatCompletionChunk(id=rid, created=created, model=self.name, choices=[
                ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))]) for c in choices]
            return self._stream(req, choices, prompts, t0, chunk, tail, heads)
        choices, texts = await self._collect(rid, req, prompts, choices, t0)
        out = []
        for c, text in zip(choices, texts):
            full = Piece(c.index, text, c.token_ids, c.logprobs[: len(c.token_ids)] if req.logprobs else None,
                         top_logprobs=c.top_logprobs[: len(c.token_ids)] or None)
            out.append(ChatChoice(index=c.index, message=AssistantMessage(content=text), logprobs=logprobs(full),
                                  finish_reason=c.finish_reason,
                                  token_ids=full.token_ids if req.return_token_ids else None))
        return ChatCompletionResponse(id=rid, created=created, model=self.name, choices=out,
                                      usage=usage(prompts, choices), mbd=self._stats(req, choices))

    # ---- generation ----

    async def _start(self, rid: str, req: SamplingFields, prompts: list[list[int]]) -> list[Choice]:
        """Start n engine requests per prompt (choice index i = prompt * n + k, seed = seed + k, engine request id
        rid.i) and wait for the first block of each: it decides the HTTP status (200, 400 or 503)."""
        self.convert.check_choices(req, len(prompts))
        params = self.convert.params(req, max(len(p) for p in prompts))
        constraint = self.convert.constraint(req)
        fields = ["messages"] if isinstance(req, ChatCompletionRequest) else \
            ["prompt"] if len(prompts) == 1 else [f"prompt[{i}]" for i in range(len(prompts))]
        for ids, field in zip(prompts, fields):
            self.convert.check_request(ids, params, field, req)
        # blocks one by one only when someone looks at them: an SSE client, or stop strings that may end early
        per_block = req.stream or bool(req.stop_list())
        ids = [f"{rid}.{i}" for i in range(len(prompts) * req.n)]
        self.trace.mark(rid, "call")
        opened = await asyncio.gather(*(self._open(prompts[i // req.n], params.model_copy(
            update={"seed": params.seed + i % req.n}), per_block, ids[i], constraint) for i in range(len(ids))),
            return_exceptions=True)
        failed = next((f for f in opened if isinstance(f, BaseException)), None)
        if failed is not None:
            for f in opened:
                if not isinstance(f, BaseException):  # cancelling a refused request re-raises its BackPressureError
                    f[0].cancel()
            if isinstance(_root(failed), RequestError):  # the engine's check: a constraint it cannot honour
                raise bad_request(_root(failed)) from failed
            if isinstance(_root(failed), (RequestQuarantined, RequestFailed)):  # not retried: it would fail again
                raise internal(str(_root(failed))) from failed
            retry = self.cfg.decoder.retry_after_s
            if isinstance(failed, BackPressureError):
                raise overloaded(failed.retry_after_s if failed.retry_after_s is not None else retry) from failed
            log.error("decoder unavailable: %r", failed)  # a failed or restarting replica: the client should retry
            raise unavailable("decoder unavailable; retry later", retry) from failed
        stops = req.stop_list()
        return [Choice(ids[i], i, prompts[i // req.n], TextStream(self.tok, stops), g, g.cancel, first, t_first,
                       self.trace)
                for i, (g, (first, t_first)) in enumerate(opened)]  # type: ignore[misc]

    async def _open(self, prompt: list[int], params: DecodeConfig, per_block: bool, eid: str,
                    constraint: ConstraintSpec | None = None
                    ) -> tuple[DeploymentResponseGenerator, tuple[StepOutput, float]]:
        """One engine request, its first output and when that arrived. A request whose replica is gone before
        answering (killed, lost with its node) is started again, on whichever replica Serve routes it to, up to
        decoder.replica_retries times (under a fresh id: a replica that only looked dead may still hold it)."""
        attempt = 0
        while True:
            gen = self.decoder.generate.remote(prompt_ids=prompt, params=params, per_block=per_block,
                                               rid=eid if not attempt else f"{eid}~{attempt}", constraint=constraint)
            try:
                return gen, await _first(gen)
            except Exception as e:  # noqa: BLE001 - sorted by _replica_gone
                if attempt >= self.cfg.decoder.replica_retries or not _replica_gone(e):
                    raise
                log.warning("replica died before answering request %s; starting it again: %r", eid, e)
            attempt += 1
            await asyncio.sleep(self.cfg.decoder.retry_after_s)  # Serve notices the death, or starts a replica

    async def _collect(self, rid: str, req: SamplingFields, prompts: list[list[int]], choices: list[Choice],
                       t0: float) -> tuple[list[Choice], list[str]]:
        """The whole text of every choice. Nothing reaches the client before it is complete, so when its replica
        is gone mid-way the request is decoded again from the start elsewhere (the same seeds give the same
        tokens), up to decoder.replica_retries times."""
        for attempt in range(self.cfg.decoder.replica_retries + 1):
            texts = [""] * len(choices)
            try:
                async with aclosing(merge([c.pieces(self._sync) for c in choices])) as pieces:
                    async for p in pieces:
                        texts[p.index] += p.text
                break
            except Exception as e:  # noqa: BLE001 - details stay in the server log
                if attempt < self.cfg.decoder.replica_retries and _replica_gone(e):
                    log.warning("replica died mid-request %s; decoding it again: %r", rid, e)
                    choices = await self._start(f"{rid}~{attempt + 1}", req, prompts)
                    continue
                log.exception("generation failed")
                raise unavailable("generation failed; retry the request", self.cfg.decoder.retry_after_s) from e
        self._record(choices, prompts, t0)
        for c in choices:
            self.trace.mark(c.rid, "done", c.sent)
        return choices, texts

    def _stream(self, req: SamplingFields, choices: list[Choice], prompts: list[list[int]], t0: float,
                chunk: Callable[[Piece], Any], tail: Callable[[Usage | None, MBDStats], Any],
                heads: list[Any] = ()) -> Any:
        buf = req.buffer_size or self.cfg.decode.buffer_size
        return sse.response(sse.events(req, choices, prompts, self._sync, buf, chunk, tail,
                                       lambda: self._record(choices, prompts, t0), heads))

    def _record(self, choices: list[Choice], prompts: list[list[int]], t0: float) -> None:
        u, t = usage(prompts, choices), time.perf_counter()
        ttft, itl = latencies(choices, t0)
        self.metrics.finished(u.prompt_tokens, u.completion_tokens, sum(c.last.nfe for c in choices), ttft, t - t0,
                              itl)

    def _text(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False)

    def _provisional(self, p: Piece) -> Provisional | None:
        """A piece's not-yet-final blocks as the client sees them (masked positions: None / MASK_GLYPH)."""
        if p.provisional is None:
            return None
        mask = self.convert.limits.mask_id
        blocks = [ProvisionalBlock(token_ids=[None if t == mask else t for t in b], text="".join(
            MASK_GLYPH if t == mask else self.tok.decode([t]) for t in b)) for b in p.provisional]
        return Provisional(committed_tokens=p.committed, blocks=blocks)

    def _stats(self, req: SamplingFields, choices: list[Choice]) -> MBDStats:
        return mbd_stats(choices, req.buffer_size or self.cfg.decode.buffer_size)
