"""One choice = one engine request seen from the ingress: its decoder stream, released text and token accounting.

The decoder streams the engine's `StepOutput`s (committed token ids); a `Choice` turns them into text `Piece`s
(stop strings applied, detokenization off the event loop), and `merge` interleaves the pieces of several choices
(n > 1, prompt lists). Leaving a stream early (client gone, stop string hit) aborts its request in the engine.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from actors.trace import Trace
from mbd.decoding.outputs import StepOutput
from mbd.detokenize import TextStream
from serve_app.protocol import MBDStats, PromptTokensDetails, Usage

TIMEOUT = "timeout"  # the finish reason of a request whose `timeout` passed first
Sync = Callable[..., Awaitable]  # sync(cost, fn, *args): fn(*args), off the event loop when the cost is large


@dataclass
class Piece:
    """Text released for one choice, with the tokens (and log-probabilities) that produced it: what the SSE
    writer sends, the engine's StepOutputs after detokenization and stop strings (a stop string may hold
    tokens back or cut them, so these are not the StepOutput's tokens)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None = None  # set on the choice's last piece
    provisional: list[list[int]] | None = None  # not-yet-final blocks after `committed` engine tokens
    committed: int = 0
    top_logprobs: list[list[tuple[int, float]]] | None = None  # of token_ids, with top_logprobs / logprobs=k


class Choice:
    """One engine request (id `rid`): `outputs` is its decoder stream after the `first` output (already
    awaited, at `t_first` on time.perf_counter's clock), `cancel` aborts it."""

    def __init__(self, rid: str, index: int, prompt: list[int], text: TextStream, outputs: AsyncIterator[StepOutput],
                 cancel: Callable[[], None], first: StepOutput, t_first: float, trace: Trace,
                 deadline: float | None = None):
        """deadline: the event loop's time at which the request's `timeout` ends it (None: never)."""
        self.rid, self.index, self.prompt, self.text, self.trace = rid, index, prompt, text, trace
        self.outputs, self.cancel, self.deadline = outputs, cancel, deadline
        self.open = not first.finished  # its engine request may still generate (neither finished nor cancelled)
        self.first = self.last = first
        self.t_first = self.t_last = t_first  # when its first and its latest output arrived
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.sent = 0  # tokens already reported in pieces

    @property
    def finish_reason(self) -> str:
        if self.last.finish_reason == TIMEOUT:
            return TIMEOUT
        return "stop" if self.text.stopped or self.last.finish_reason == "eos" else "length"

    @property
    def token_ids(self) -> list[int]:
        return self.text.token_ids[: self.text.returned_tokens]

    def _piece(self, text: str, upto: int, finish: str | None) -> Piece:
        ids = self.text.token_ids[self.sent:upto]
        lps = self.logprobs[self.sent:upto] if self.last.new_logprobs is not None else None
        tops = self.top_logprobs[self.sent:upto] if self.last.new_top_logprobs is not None else None
        self.sent = max(self.sent, upto)
        return Piece(self.index, text, ids, lps, finish, top_logprobs=tops)

    async def pieces(self, sync: Sync) -> AsyncIterator[Piece]:
        """Pieces until the engine finishes or a stop string is hit (detokenization runs through `sync`: a large
        output off the event loop); leaving early (client gone) aborts the request in the engine."""
        done, received = False, 0
        try:
            o: StepOutput | None = self.first
            while o is not None:
                received += len(o.new_token_ids)
                self.trace.mark(self.rid, "delta", received)
                self.last = o
                self.logprobs += o.new_logprobs or []
                self.top_logprobs += o.new_top_logprobs or []
                text, upto = await sync(len(o.new_token_ids), self._push, o.new_token_ids)
                if text or o.provisional:
                    p = self._piece(text, upto, None)
                    p.provisional, p.committed = o.provisional, received
                    yield p
                done = o.finished
                if done or self.text.stopped:
                    break
                o = await self._next()
                if o is not None:
                    self.t_last = time.perf_counter()
            tail, upto = await sync(0, self._finish)
            yield self._piece(tail, upto, self.finish_reason)
        finally:
            if self.open:
                self.open = False
                self.cancel()

    async def _next(self) -> StepOutput | None:
        """The stream's next output; once the deadline passes, a finished one with finish_reason "timeout" (its
        engine request cancelled)."""
        try:
            async with asyncio.timeout_at(self.deadline):
                out = await anext(self.outputs, None)
        except TimeoutError:
            self.open = False
            self.cancel()
            return timed_out(self.last)
        self.open = out is not None and not out.finished
        return out

    def mark_sent(self) -> None:
        """The client's event with this choice's tokens so far is leaving (for the time breakdown)."""
        self.trace.mark(self.rid, "sent", self.sent)

    def _push(self, ids: list[int]) -> tuple[str, int]:
        return self.text.push(ids), self.text.released_tokens

    def _finish(self) -> tuple[str, int]:
        return self.text.finish(), self.text.returned_tokens


def timed_out(last: StepOutput) -> StepOutput:
    """The output that ends a request at its deadline, after `last` (the engine's latest for it)."""
    return StepOutput(last.request_id, [], True, TIMEOUT, last.nfe, last.num_generated,
                      [] if last.new_logprobs is not None else None,
                      [] if last.new_top_logprobs is not None else None, last.cached_tokens)


async def merge(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[Piece]:
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


def usage(prompts: list[list[int]], choices: list[Choice], so_far: bool = False) -> Usage:
    """Prompt tokens once per prompt (cached ones: the most any of its choices found in the prefix cache);
    completion tokens: those returned (cut at a stop string), or with so_far those sent in the stream up to now."""
    n_prompt = sum(len(p) for p in prompts)
    n = sum(c.sent if so_far else c.text.returned_tokens for c in choices)
    per = max(1, len(choices) // max(1, len(prompts)))  # choice i answers prompt i // n
    cached = sum(max((c.last.cached_tokens for c in choices[i * per:(i + 1) * per]), default=0)
                 for i in range(len(prompts)))
    return Usage(prompt_tokens=n_prompt, completion_tokens=n, total_tokens=n_prompt + n,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def latencies(choices: list[Choice], t0: float) -> tuple[float, list[float]]:
    """The request's time to first token (its earliest choice's first output, from `t0`) and each choice's
    inter-token latency: from its own first output to its last, over the tokens after the first ones (a choice
    whose tokens all came at once has none). Per choice: n parallel choices do not divide each other's gaps."""
    itl = [(c.t_last - c.t_first) / later for c in choices
           if (later := c.last.num_generated - len(c.first.new_token_ids)) > 0]
    return min(c.t_first for c in choices) - t0, itl


def mbd_stats(choices: list[Choice], buffer_size: int) -> MBDStats:
    nfe, gen = sum(c.last.nfe for c in choices), sum(c.last.num_generated for c in choices)
    return MBDStats(nfe=nfe, tpf=round(gen / nfe, 4) if nfe else 0.0, num_generated=gen, buffer_size=buffer_size)
