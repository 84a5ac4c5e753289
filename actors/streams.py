"""A decoder replica's requests as its engine host holds them (`Stream`), how their outputs reach their handlers'
event loops (`hand_over`), and the typed events the host's supervisor thread drains from its inbox (`Exited`,
`TrialOver`, `Added`, `Left`, `RankLost`, `StatsAsked`, `Shutdown`): the other threads change no
supervision state, they post one of these."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Callable

from actors.messages import Add, AskStats, Failed, RequestFailed, Stepped
from mbd.decoding.outputs import StepOutput
from mbd.decoding.resume import Checkpoint, Resume
from mbd.decoding.validate import RequestError


@dataclass(eq=False)
class Stream:
    """One request: what (re-)admits it to an engine process, its way back to its handler, and what the engine
    emitted for it so far with the checkpoint after it (so that a new engine process resumes it where its client
    stands; the outputs handed over carry no checkpoint). With per_block=False the reader merges its outputs and
    hands over only the finished whole (one wake-up of its event loop)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    add: Add
    per_block: bool = True
    on_engine: bool = False  # its Add went to the current engine process
    held: StepOutput | None = None  # merged outputs not handed over yet (per_block=False)
    emitted: list[int] = field(default_factory=list)  # every token the engine emitted for it (handed over or held)
    checkpoint: Checkpoint | None = None  # taken when the last of them was emitted
    last: StepOutput | None = None  # its latest output

    def note(self, o: StepOutput) -> StepOutput | None:
        """Record an output; return what to hand over now (None: held until the request finishes)."""
        self.emitted += o.new_token_ids
        if o.new_token_ids:
            self.checkpoint = o.checkpoint
        if o.checkpoint is not None:  # resume state stays here: the handler, and the ingress over Ray, never read it
            o = dataclasses.replace(o, checkpoint=None)
        self.last = o
        if self.per_block:
            return o
        self.held = self.held.merge(o) if self.held is not None else o
        return self.held if o.finished else None

    async def outputs(self) -> AsyncIterator[StepOutput]:
        """What the host handed over, merged per wake-up, until the request finishes; raises what it handed over
        instead (EngineDead, RequestQuarantined, RequestError) and RequestFailed for an "error" output."""
        finished = False
        while not finished:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            if err := next((it for it in items if isinstance(it, BaseException)), None):
                raise err
            out = items[0]
            for it in items[1:]:
                out = out.merge(it)
            finished = out.finished
            if out.finish_reason == "error":
                raise RequestFailed(out.error)
            yield out

    def readmission(self) -> Add | StepOutput:
        """How a new engine process takes the request on: its Add (resumed from the client's tokens once it has
        some), or, when its output already ended (a stop token, or its checked length limit, reached while its
        last blocks were being stored: no checkpoint after them), the final output the host gives it itself."""
        if not self.emitted:
            return self.add
        if self.checkpoint is not None:
            return dataclasses.replace(self.add, resumed=Resume(list(self.emitted), self.checkpoint))
        o, prompt_len = self.last, len(self.add.prompt_ids)
        limit = self.add.params.gen_end - prompt_len
        # a stop token as the very last token the limit allows reads as "length" here (the engine says "eos")
        end = StepOutput(self.add.request_id, [], True, "length" if len(self.emitted) >= limit else "eos", o.nfe,
                         len(self.emitted), [] if o.new_logprobs is not None else None,
                         [] if o.new_top_logprobs is not None else None, o.cached_tokens)
        return self.note(end) or end


@dataclass
class Exited:
    """An engine process ended (posted by its reader)."""

    proc: subprocess.Popen
    conn: Connection
    why: str
    in_step: tuple[str, ...]  # the requests of the step it was running (its last `Running`)
    failed: Failed | None = None  # its last word, when it raised


@dataclass
class TrialOver:
    """Every request of the group on trial finished: the next group may go (or everyone). Posted by the
    supervisor itself, so that the events already in its inbox come first."""


@dataclass
class Added:
    """A handler registered request `rid`: the supervisor sends it to the engine process now or later."""

    rid: str


@dataclass
class Left:
    """Request `rid` left the host at `at` (time.monotonic()): finished (served: not with an error or a refusal),
    or its client went away (abort: the engine process has it and must drop it)."""

    rid: str
    served: bool
    at: float
    abort: bool = False


@dataclass
class RankLost:
    """The health check saw a tensor-parallel rank of engine process `pid` end: that process must go."""

    pid: int


@dataclass
class StatsAsked:
    """A handler waits for an engine process to answer stats question `ask`; `send` is its link's."""

    send: Callable[[AskStats], None]
    ask: int


@dataclass
class Shutdown:
    """The replica is going away."""


def take_step(streams: dict[str, Stream], counts: Counts, msg: Stepped
              ) -> tuple[list[tuple[Stream, StepOutput | BaseException]], list[tuple[str, bool]]]:
    """A step's refusals and outputs (under the host's lock): what to hand over to whom, and which requests left
    (request id, served: not with an error or a refusal). A finished request leaves `streams`."""
    items: list[tuple[Stream, StepOutput | BaseException]] = []
    left: list[tuple[str, bool]] = []
    for r in msg.refused:
        if (s := streams.pop(r.request_id, None)) is not None:
            items.append((s, RequestError(r.error.field, f"request refused by the engine: {r.error}", r.error.code)))
            left.append((r.request_id, False))
    counts.generated += sum(len(o.new_token_ids) for o in msg.outputs)
    for o in msg.outputs:
        s = streams.get(o.request_id)
        if s is None:  # it left (aborted) before the engine heard of it
            counts.discarded += len(o.new_token_ids)
            continue
        if not (o.new_token_ids or o.finished or o.provisional):
            continue
        if o.finished:  # an engine that only fails requests has not shown it can serve
            del streams[o.request_id]
            left.append((o.request_id, o.finish_reason != "error"))
        if (item := s.note(o)) is not None:
            items.append((s, item))
    return items, left


def readmit(streams: dict[str, Stream], todo: list[Stream], counts: Counts
            ) -> tuple[list[tuple[Stream, Add]], list[tuple[Stream, StepOutput]]]:
    """How a new engine process takes `todo` on (each marked as on it, and counted): the Adds to send, and the
    streams whose output already ended, each with its final output (`Stream.readmission`); those leave `streams`."""
    ops: list[tuple[Stream, Add]] = []
    ended: list[tuple[Stream, StepOutput]] = []
    for s in todo:
        s.on_engine = True
        got = s.readmission()
        (ops if isinstance(got, Add) else ended).append((s, got))
    for s, _ in ended:
        del streams[s.add.request_id]
    counts.readmitted += len(ops)
    counts.resumed += sum(op.resumed is not None for _, op in ops)
    return ops, ended


def hand_over(items: list[tuple[Stream, StepOutput | BaseException]]) -> None:
    """Deliver a step's items to their handlers with one thread-safe call per event loop (each call wakes the
    loop); a closed loop (replica shutting down) drops them."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for s, item in items:
        by_loop.setdefault(s.loop, []).append((s.queue, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(put_all, batch)
        except RuntimeError:
            pass


def put_all(batch: list[tuple[asyncio.Queue, StepOutput | BaseException]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


Event = Exited | TrialOver | Added | Left | RankLost | StatsAsked | Shutdown


@dataclass
class Counts:
    """What `stats()` reports of the supervision; `on_count` hears of restarts and convictions as they happen."""

    on_count: Callable[[str, int], None] | None = field(default=None, repr=False)
    aborted: int = 0
    generated: int = 0  # tokens the engine emitted, for every request (aborted ones included)
    discarded: int = 0  # of those, tokens of requests that had left (aborted) when the engine emitted them
    restarts: int = 0
    readmitted: int = 0  # requests sent to a new engine process (from the start or resumed)
    resumed: int = 0  # of those, requests whose client had tokens: resumed from them
    quarantined: int = 0  # requests convicted of crashing the engine (alone in a step, on their trial)
    trials: int = 0  # suspect groups tried alone

    def add(self, what: str, n: int) -> None:
        setattr(self, what, getattr(self, what) + n)
        if self.on_count is not None:
            self.on_count(what, n)
