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
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from actors.decoder import Delta
from mbd.config import ModelConfig, read_json
from mbd.detokenize import TextStream
from mbd.tokenizer import Tokenizer
from serve_app import sse
from serve_app.choices import Choice, Piece, mbd_stats, merge, usage
from serve_app.config import ServeConfig
from serve_app.convert import RequestConverter
from serve_app.errors import overloaded, unavailable
from serve_app.metrics import IngressMetrics
from serve_app.protocol import (APIError, AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, CompletionChoice,
                                CompletionLogprobs, CompletionRequest, CompletionResponse, DeltaMessage, MBDStats,
                                ModelCard, ModelList, SamplingFields, TokenLogprob, Usage, new_id, now)

log = logging.getLogger("ray.serve")


def _root(e: BaseException) -> BaseException:
    """The decoder's own exception inside Ray's wrapper (a RayTaskError keeps it as `cause`)."""
    return getattr(e, "cause", None) or e


async def _first(gen: DeploymentResponseGenerator) -> Delta:
    """The stream's first item (a handle may raise BackPressureError before it returns an awaitable)."""
    return await gen.__anext__()


@serve.deployment
@serve.ingress()
class OpenAIIngress:
    def __init__(self, decoder: DeploymentHandle, cfg: ServeConfig):
        self.decoder = decoder.options(stream=True)
        self.cfg = cfg
        path = cfg.model.resolved_path()
        model_cfg = ModelConfig.from_hf(read_json(path / "config.json"))
        self.tok = Tokenizer.from_dir(path, model_cfg)
        self.convert = RequestConverter(cfg, model_cfg, self.tok)
        self.name = cfg.model.name
        self.max_len = self.convert.max_len
        self.metrics = IngressMetrics()
        # tokenization and detokenization run here, so that one huge prompt cannot stall the event loop
        self.pool = ThreadPoolExecutor(cfg.ingress.tokenizer_threads, thread_name_prefix="mbd-tokenize")

    def __serve_build_asgi_app__(self) -> FastAPI:
        from serve_app.routes import http_app

        return http_app(self, api_key=self.cfg.http.api_key or os.environ.get("MBD_API_KEY") or None)

    async def _sync(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ---- endpoints ----

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.name, created=now(), max_model_len=self.max_len)])

    async def completions(self, req: CompletionRequest) -> Any:
        t0 = time.perf_counter()
        self.convert.check_completion(req)
        prompts = await self._sync(self.convert.encode_prompts, req.prompt)
        choices = await self._start(req, prompts)
        rid, created = new_id("cmpl"), now()

        def logprobs(p: Piece, offset: int) -> CompletionLogprobs | None:
            if p.logprobs is None:
                return None
            tokens = [self.tok.decode([t], skip_special_tokens=False) for t in p.token_ids]
            offsets = [offset + sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
            return CompletionLogprobs(tokens=tokens, token_logprobs=p.logprobs, text_offset=offsets,
                                      top_logprobs=[{}] * len(tokens) if req.logprobs == 0 else None)

        if req.stream:
            offsets = [0] * len(choices)

            def chunk(p: Piece) -> CompletionResponse:
                lp = logprobs(p, offsets[p.index])
                offsets[p.index] += sum(len(t) for t in lp.tokens) if lp else 0
                return CompletionResponse(id=rid, created=created, model=self.name, choices=[CompletionChoice(
                    index=p.index, text=p.text, logprobs=lp, finish_reason=p.finish_reason,
                    token_ids=p.token_ids if req.return_token_ids else None)])

            def tail(u: Usage | None, stats: MBDStats) -> CompletionResponse:
                return CompletionResponse(id=rid, created=created, model=self.name, choices=[], usage=u, mbd=stats)

            return self._stream(req, choices, prompts, t0, chunk, tail)
        texts = await self._collect(choices, prompts, t0)
        out = []
        for c, text in zip(choices, texts):
            full = Piece(c.index, text, c.token_ids, c.logprobs[: len(c.token_ids)] if req.logprobs is not None
                         else None)
            out.append(CompletionChoice(index=c.index, text=text, logprobs=logprobs(full, 0),
                                        finish_reason=c.finish_reason,
                                        token_ids=full.token_ids if req.return_token_ids else None))
        return CompletionResponse(id=rid, created=created, model=self.name, choices=out,
                                  usage=usage(prompts, choices), mbd=self._stats(req, choices))

    async def chat(self, req: ChatCompletionRequest) -> Any:
        t0 = time.perf_counter()
        self.convert.check_chat(req)
        messages = self.convert.messages(req)
        prompts = [await self._sync(self.convert.encode_chat, messages)]
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

            def tail(u: Usage | None, stats: MBDStats) -> ChatCompletionChunk:
                return ChatCompletionChunk(id=rid, created=created, model=self.name, choices=[], usage=u, mbd=stats)

            heads = [ChatCompletionChunk(id=rid, created=created, model=self.name, choices=[
                ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))]) for c in choices]
            return self._stream(req, choices, prompts, t0, chunk, tail, heads)
        texts = await self._collect(choices, prompts, t0)
        out = []
        for c, text in zip(choices, texts):
            full = Piece(c.index, text, c.token_ids, c.logprobs[: len(c.token_ids)] if req.logprobs else None)
            out.append(ChatChoice(index=c.index, message=AssistantMessage(content=text), logprobs=logprobs(full),
                                  finish_reason=c.finish_reason,
                                  token_ids=full.token_ids if req.return_token_ids else None))
        return ChatCompletionResponse(id=rid, created=created, model=self.name, choices=out,
                                      usage=usage(prompts, choices), mbd=self._stats(req, choices))

    # ---- generation ----

    async def _start(self, req: SamplingFields, prompts: list[list[int]]) -> list[Choice]:
        """Start n engine requests per prompt (choice index = prompt * n + k, seed = seed + k) and wait for the
        first block of each: it decides the HTTP status (200, 400 or 503)."""
        self.convert.check_choices(req, len(prompts))
        params = self.convert.params(req, max(len(p) for p in prompts))
        constraint = await self._sync(self.convert.constraint, req)
        # blocks one by one only when someone looks at them: an SSE client, or stop strings that may end early
        per_block = req.stream or bool(req.stop_list())
        gens = [self.decoder.generate.remote(ids, params.model_copy(update={"seed": params.seed + k}), per_block,
                                             constraint) for ids in prompts for k in range(req.n)]
        firsts = await asyncio.gather(*(_first(g) for g in gens), return_exceptions=True)
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is not None:
            for g, f in zip(gens, firsts):
                if not isinstance(f, BaseException):  # cancelling a refused request re-raises its BackPressureError
                    g.cancel()
            if isinstance(failed, ValueError):  # the decoder's own validation (the checks above should catch it)
                raise APIError(400, str(_root(failed))) from failed
            retry = self.cfg.decoder.retry_after_s
            if isinstance(failed, BackPressureError):
                raise overloaded(failed.retry_after_s if failed.retry_after_s is not None else retry) from failed
            log.error("decoder unavailable: %r", failed)  # a failed or restarting replica: the client should retry
            raise unavailable("decoder unavailable; retry later", retry) from failed
        stops = req.stop_list()
        return [Choice(i, prompts[i // req.n], TextStream(self.tok, stops), g, g.cancel, f)
                for i, (g, f) in enumerate(zip(gens, firsts))]

    async def _collect(self, choices: list[Choice], prompts: list[list[int]], t0: float) -> list[str]:
        texts = [""] * len(choices)
        try:
            async with aclosing(merge([c.pieces(self._sync) for c in choices])) as pieces:
                async for p in pieces:
                    texts[p.index] += p.text
        except Exception as e:  # noqa: BLE001 - replica died mid-request; details stay in the server log
            log.exception("generation failed")
            raise unavailable("generation failed; retry the request", self.cfg.decoder.retry_after_s) from e
        self._record(choices, prompts, t0)
        return texts

    def _stream(self, req: SamplingFields, choices: list[Choice], prompts: list[list[int]], t0: float,
                chunk: Callable[[Piece], Any], tail: Callable[[Usage | None, MBDStats], Any],
                heads: list[Any] = ()) -> Any:
        buf = req.buffer_size or self.cfg.decode.buffer_size
        return sse.response(sse.events(req, choices, prompts, self._sync, buf, chunk, tail,
                                       lambda: self._record(choices, prompts, t0), heads))

    def _record(self, choices: list[Choice], prompts: list[list[int]], t0: float) -> None:
        u = usage(prompts, choices)
        self.metrics.finished(u.prompt_tokens, u.completion_tokens, sum(c.last.nfe for c in choices),
                              (time.perf_counter() - t0) * 1e3)

    def _stats(self, req: SamplingFields, choices: list[Choice]) -> MBDStats:
        return mbd_stats(choices, req.buffer_size or self.cfg.decode.buffer_size)
