"""Server-sent events: how the pieces of a streaming request become `data:` events.

The endpoint says what one chunk looks like (`Render`: `chunk`, `tail`, `heads`); this module owns the order
(heads, chunks as text is released, then usage and the MBD statistics), the in-band error when generation fails
after the status line went out, and the closing `[DONE]`.
"""

from __future__ import annotations

import logging
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable, Protocol, Sequence

from fastapi.responses import StreamingResponse

from serve_app.choices import Choice, Piece, Sync, mbd_stats, merge, usage
from serve_app.errors import engine_failure
from serve_app.protocol import ErrorBody, ErrorResponse, MBDStats, SamplingFields, Usage

log = logging.getLogger("ray.serve")
DONE = "data: [DONE]\n\n"


def event(obj: Any) -> str:
    return f"data: {obj.model_dump_json()}\n\n"


class Render(Protocol):
    """What an endpoint says its chunks look like (serve_app/render.py)."""

    req: SamplingFields

    def heads(self, choices: list[Choice]) -> Sequence[Any]: ...

    def chunk(self, p: Piece) -> Any: ...

    def tail(self, u: Usage | None, stats: MBDStats) -> Any: ...


class EventStream(StreamingResponse):
    """The SSE response of a streaming request. `on_close(completed)` runs once it ends, however it ends
    (completed: every choice's pieces were sent; not if generation failed or the client went away, even before
    the events began, when no `finally` of theirs would run)."""

    def __init__(self, r: Render, choices: list[Choice], prompts: list[list[int]], sync: Sync, buffer_size: int,
                 on_close: Callable[[bool], None]):
        super().__init__(self._events(r, choices, prompts, sync, buffer_size), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close, self.completed = on_close, False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close(self.completed)

    async def _events(self, r: Render, choices: list[Choice], prompts: list[list[int]], sync: Sync,
                      buffer_size: int) -> AsyncIterator[str]:
        """Per-choice chunks as text is released (each leaves at once; only a choice's finishing chunk waits for
        the next one, since the last of them carries the MBD statistics), then (stream_options.include_usage) a
        chunk with no choices and the usage. A failure mid-way ends every unfinished choice with finish_reason
        "error" and an error event saying what it was (`errors.engine_failure`, in-band: no status line)."""
        req, finished, last = r.req, set[int](), None
        sent: Choice = choices[0]  # the choice of `last`
        continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats
        try:
            for h in r.heads(choices):
                if continuous:
                    h.usage = usage(prompts, choices, so_far=True)
                yield event(h)
            async with aclosing(merge([c.pieces(sync) for c in choices])) as pieces:
                async for p in pieces:
                    ev = r.chunk(p)
                    if continuous:
                        ev.usage = usage(prompts, choices, so_far=True)
                    if p.finish_reason is None:  # only a choice's last chunk may have to carry the statistics
                        yield event(ev)
                        choices[p.index].mark_sent()
                        continue
                    finished.add(p.index)
                    if last is not None:
                        yield event(last)
                        sent.mark_sent()
                    last, sent = ev, choices[p.index]
            self.completed = True
            stats = mbd_stats(choices, buffer_size)
            if req.stream_options is not None and req.stream_options.include_usage:
                if last is not None:
                    yield event(last)
                yield event(r.tail(usage(prompts, choices), stats))
            elif last is not None:
                last.mbd = stats
                yield event(last)
            if last is not None:
                sent.mark_sent()
        except Exception as e:  # noqa: BLE001 - the status line is sent already: report in-band
            log.exception("generation failed mid-stream")
            err = engine_failure(e, retry_after_s=0.0)
            if last is not None:
                yield event(last)
            for c in choices:
                if c.index not in finished:
                    yield event(r.chunk(Piece(c.index, "", [], None, "error")))
            yield event(ErrorResponse(error=ErrorBody(message=err.message, type="server_error", code=err.code)))
        yield DONE
