"""The HTTP ingress deployment (CPU, cheap): checks and tokenizes requests, starts one decoder request per
choice, detokenizes committed blocks into text, applies stop strings and answers in JSON or SSE.

Both endpoints run one path (`_generate`); what differs between them (encoding the prompts, the JSON they write)
is a `Render` (serve_app/render.py). A request's rules are checked once, in `_generate` (the schema's by the
request model, the rest by `RequestConverter`), and a decoder's answer is mapped to HTTP once
(`errors.engine_failure`). Recovery is one layer per failure: an engine process that dies is the decoder
replica's to recover (its requests resume on a new one); the ingress only restarts a request whose replica is
gone (`_replica_gone`) before its client got anything.

Each replica builds its own FastAPI app (`__serve_build_asgi_app__`, serve_app/routes.py) from its own config,
so nothing a replica holds is module-global.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Any, Callable

from fastapi import FastAPI
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from pipelines.ray_private import by_grpc
from actors.trace import Trace
from mbd.checkpoint_files import read_model_config
from mbd.decoding.constraint_spec import ConstraintSpec
from mbd.decoding.outputs import StepOutput
from mbd.decoding.validate import EngineLimits, RequestParams
from mbd.detokenize import TextStream
from mbd.tokenizer import Tokenizer
from serve_app import sse
from serve_app.choices import TIMEOUT, Choice, latencies, mbd_stats, merge, timed_out, usage
from serve_app.config import ServeConfig
from serve_app.convert import RequestConverter
from serve_app.errors import engine_failure, unavailable
from serve_app.metrics import IngressMetrics
from serve_app.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, \
    SamplingFields, now
from serve_app.render import INLINE_COST, ChatRender, CompletionRender

log = logging.getLogger("ray.serve")
HEALTH_TIMEOUT_S = 2.0  # how long /health waits for a decoder replica to say how its engine is


def _replica_gone(e: BaseException) -> bool:
    """The request's replica itself is gone (killed, its node lost): the one failure the ingress recovers from."""
    return isinstance(e, RayActorError)


async def _first(gen: DeploymentResponseGenerator) -> tuple[StepOutput, float]:
    """The stream's first item and when it arrived (a handle may raise BackPressureError before it returns an
    awaitable)."""
    return await gen.__anext__(), time.perf_counter()


@serve.deployment
@serve.ingress()
class OpenAIIngress:
    def __init__(self, decoder: DeploymentHandle, cfg: ServeConfig):
        # Serve's replica-to-replica gRPC path (pipelines/ray_private.py): the handle arrives with the driver's
        # options, so it is set here.
        self.decoder = by_grpc(decoder)
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

    async def sync(self, cost: int, fn: Callable, *args: Any) -> Any:
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
        return await self._generate(CompletionRender(self, req))

    async def chat(self, req: ChatCompletionRequest) -> Any:
        return await self._generate(ChatRender(self, req))

    # ---- generation ----

    async def _generate(self, r: CompletionRender | ChatRender) -> Any:
        """The one path of both endpoints: the request's checks, its choices started, then SSE or the whole
        response; `r` says how its endpoint encodes the prompts and writes its JSON."""
        req, t0 = r.req, time.perf_counter()
        deadline = None if req.timeout is None else asyncio.get_running_loop().time() + req.timeout
        self.trace.mark(r.rid, "recv")
        await self._limits()
        self.convert.check_fields(req)
        prompts, fields = await r.prompts()
        params, constraint = self.convert.engine_request(req, prompts, fields)
        choices, texts = await self._run(r.rid, req, prompts, params, constraint, deadline)
        buf = req.buffer_size or self.cfg.decode.buffer_size
        if req.stream:
            return sse.EventStream(r, choices, prompts, self.sync, buf,
                                   on_close=lambda completed: self._closed(completed, choices, prompts, t0))
        self._record(choices, prompts, t0)
        return r.whole(choices, texts, usage(prompts, choices), mbd_stats(choices, buf))

    async def _run(self, rid: str, req: SamplingFields, prompts: list[list[int]], params: list[RequestParams],
                   constraint: ConstraintSpec | None, deadline: float | None) -> tuple[list[Choice], list[str]]:
        """The one place a request is started again: its choices started (`_start`) and, unless it streams,
        collected (`_collect`); when a replica is gone before the client got anything (a streaming request's
        first blocks, a whole response), every choice is started again, under fresh ids (a replica that only
        looked dead may still hold them) on whichever replica Serve routes it to, at most decoder.replica_retries
        times: decoder.replica_retries + 1 starts in all. The same seeds give the same tokens."""
        attempt = 0
        while True:
            try:
                choices = await self._start(rid if not attempt else f"{rid}~{attempt}", req, prompts, params,
                                            constraint, deadline)
                return (choices, []) if req.stream else (choices, await self._collect(choices))
            except Exception as e:  # noqa: BLE001 - mapped once, by `errors.engine_failure`
                if attempt >= self.cfg.decoder.replica_retries or not _replica_gone(e):
                    log.warning("request %s failed: %r", rid, e)
                    raise engine_failure(e, self.cfg.decoder.retry_after_s) from e
                log.warning("replica died before request %s was answered; starting it again: %r", rid, e)
            attempt += 1
            await asyncio.sleep(self.cfg.decoder.retry_after_s)  # Serve notices the death, or starts a replica

    def _closed(self, completed: bool, choices: list[Choice], prompts: list[list[int]], t0: float) -> None:
        """A streamed response ended: recorded if every choice was sent, else its open choices are cancelled."""
        if completed:
            self._record(choices, prompts, t0)
        self._gone(choices)

    def _gone(self, choices: list[Choice]) -> None:
        """The client went away: cancel every choice still open (its pieces may never have started, so nothing
        else would) and count them as aborted."""
        left = [c for c in choices if c.open]
        for c in left:
            c.open = False
            c.cancel()
        self.metrics.abort("client_disconnect", len(left))

    async def _start(self, rid: str, req: SamplingFields, prompts: list[list[int]], params: list[RequestParams],
                     constraint: ConstraintSpec | None, deadline: float | None) -> list[Choice]:
        """Start n engine requests per prompt (choice index i = prompt * n + k, seed = seed + k, engine request id
        rid.i) and wait for the first block of each: it decides the HTTP status (200, 400, 500 or 503). A choice
        whose first block has not come by the deadline starts finished, with finish_reason "timeout"."""
        # blocks one by one only when someone looks at them: an SSE client, stop strings that may end early, or a
        # deadline that may keep what came before it
        per_block = req.stream or bool(req.stop_list()) or deadline is not None
        ids = [f"{rid}.{i}" for i in range(len(prompts) * req.n)]
        self.trace.mark(rid, "call")
        tasks = [asyncio.ensure_future(self._open(prompts[i // req.n], dataclasses.replace(
            params[i // req.n], seed=params[i // req.n].seed + i % req.n), per_block, ids[i], constraint, deadline))
            for i in range(len(ids))]
        try:
            opened = await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:  # the client went away: the choices that did start are cancelled too
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is None:
                    t.result()[0].cancel()
            self.metrics.abort("client_disconnect", len(tasks))
            raise
        failed = next((f for f in opened if isinstance(f, BaseException)), None)
        if failed is not None:
            for f in opened:
                if not isinstance(f, BaseException):  # cancelling a refused request re-raises its BackPressureError
                    f[0].cancel()
            raise failed
        stops = req.stop_list()
        return [Choice(ids[i], i, prompts[i // req.n], TextStream(self.tok, stops), g, g.cancel, first, t_first,
                       self.trace, deadline)
                for i, (g, (first, t_first)) in enumerate(opened)]  # type: ignore[misc]

    async def _open(self, prompt: list[int], params: RequestParams, per_block: bool, eid: str,
                    constraint: ConstraintSpec | None = None, deadline: float | None = None
                    ) -> tuple[DeploymentResponseGenerator, tuple[StepOutput, float]]:
        """One engine request, its first output and when that arrived (at the deadline: a finished "timeout"
        output, the request cancelled). Whatever ends the wait otherwise (the client gone, an error) cancels the
        request wherever it is: in Serve's queue, the replica or the engine. Started once: `_run` decides whether
        a request whose replica is gone is started again."""
        gen = self.decoder.generate.remote(prompt_ids=prompt, params=params, per_block=per_block, rid=eid,
                                           constraint=constraint)
        try:
            async with asyncio.timeout_at(deadline):
                return gen, await _first(gen)
        except TimeoutError:
            gen.cancel()
            return gen, (timed_out(StepOutput(eid, [], False, None, 0, 0)), time.perf_counter())
        except BaseException:
            gen.cancel()
            raise

    async def _collect(self, choices: list[Choice]) -> list[str]:
        """The whole text of every choice. Nothing reaches the client before it is complete, so an error here
        (its replica gone mid-way) lets `_run` decode the request again from the start elsewhere."""
        texts = [""] * len(choices)
        try:
            async with aclosing(merge([c.pieces(self.sync) for c in choices])) as pieces:
                async for p in pieces:
                    texts[p.index] += p.text
        except asyncio.CancelledError:  # the client went away
            self._gone(choices)
            raise
        for c in choices:
            self.trace.mark(c.rid, "done", c.sent)
        return texts

    def _record(self, choices: list[Choice], prompts: list[list[int]], t0: float) -> None:
        self.metrics.abort("deadline", sum(c.finish_reason == TIMEOUT for c in choices))
        u, t = usage(prompts, choices), time.perf_counter()
        ttft, itl = latencies(choices, t0)
        self.metrics.finished(u.prompt_tokens, u.completion_tokens, sum(c.last.nfe for c in choices), ttft, t - t0,
                              itl)
