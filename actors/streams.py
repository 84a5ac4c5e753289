"""A decoder replica's requests as its engine host holds them (`Stream`), how their outputs reach their handlers'
event loops (`hand_over`), and what the host's supervisor thread is told besides ops (`Exited`, `TrialOver`)."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from actors.messages import Add, Failed
from mbd.decoding.outputs import StepOutput
from mbd.decoding.resume import Checkpoint, Resume
from mbd.decoding.validate import RequestParams


@dataclass(eq=False)
class Stream:
    """One request: what (re-)admits it to an engine process, its way back to its handler, and what the engine
    emitted for it so far (so that a new engine process resumes it where its client stands). With per_block=False
    the reader merges its outputs and hands over only the finished whole (one wake-up of its event loop)."""

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
        self.last = o
        if self.per_block:
            return o
        self.held = self.held.merge(o) if self.held is not None else o
        return self.held if o.finished else None

    def readmission(self, max_length: int) -> Add | StepOutput:
        """How a new engine process takes the request on: its Add (resumed from the client's tokens once it has
        some), or, when its output already ended (a stop token, or the length limit with `max_length` the
        engine's, reached while its last blocks were being stored: no checkpoint after them), the final output
        the host gives it itself."""
        if not self.emitted:
            return self.add
        if self.checkpoint is not None:
            return dataclasses.replace(self.add, resumed=Resume(list(self.emitted), self.checkpoint))
        o, prompt_len = self.last, len(self.add.prompt_ids)
        limit = RequestParams.resolve(self.add.params, prompt_len, max_length).gen_end - prompt_len
        # a stop token as the very last token the limit allows reads as "length" here (the engine says "eos")
        end = StepOutput(self.add.request_id, [], True, "length" if len(self.emitted) >= limit else "eos", o.nfe,
                         len(self.emitted), [] if o.new_logprobs is not None else None,
                         [] if o.new_top_logprobs is not None else None, o.cached_tokens)
        return self.note(end) or end


@dataclass
class Exited:
    """An engine process ended (put in the outbox by its reader)."""

    proc: subprocess.Popen
    conn: Connection
    why: str
    in_step: tuple[str, ...]  # the requests of the step it was running (its last `Running`)
    failed: Failed | None = None  # its last word, when it raised


@dataclass
class TrialOver:
    """Every request of the group on trial finished: the next group may go (or everyone)."""


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


@dataclass
class Counts:
    """What `stats()` reports of the supervision."""

    aborted: int = 0
    generated: int = 0  # tokens the engine emitted, for every request (aborted ones included)
    discarded: int = 0  # of those, tokens of requests that had left (aborted) when the engine emitted them
    restarts: int = 0
    readmitted: int = 0  # requests sent to a new engine process (from the start or resumed)
    resumed: int = 0  # of those, requests whose client had tokens: resumed from them
    quarantined: int = 0  # requests convicted of crashing the engine (alone in a step, on their trial)
    trials: int = 0  # suspect groups tried alone
