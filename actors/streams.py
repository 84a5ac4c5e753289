"""A decoder replica's requests as its engine host holds them (`Stream`), how their outputs reach their
handlers' event loops (`hand_over`), and what the host's supervisor thread is told besides ops (`Exited`, `Next`)."""

from __future__ import annotations

import asyncio
import subprocess
from dataclasses import dataclass
from multiprocessing.connection import Connection

from actors.messages import Add, Failed
from mbd.decoding.outputs import StepOutput


@dataclass(eq=False)
class Stream:
    """One request: what re-admits it to a new engine process, and its way back to its handler. With
    per_block=False the reader thread merges its outputs and hands over only the finished whole, so a
    non-streaming request costs its event loop one wake-up."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    add: Add
    per_block: bool = True
    held: StepOutput | None = None  # merged outputs not yet handed over (per_block=False)
    sent: bool = False  # its `Add` is in the outbox of the current engine process
    produced: bool = False  # its handler got output: an engine exit fails it instead of re-running it
    suspected: float | None = None  # when the engine last died by itself in a step it was in (time.monotonic)


@dataclass
class Exited:
    """An engine process ended (put in the outbox by its reader)."""

    proc: subprocess.Popen
    conn: Connection
    why: str
    in_step: tuple[str, ...]  # the requests of the step it was running (its last `Running`)
    failed: Failed | None = None  # its last word, when it raised


@dataclass
class Next:
    """A suspect's trial ended (cleared by its first output, or finished): send what waited for it."""


def hand_over(items: list[tuple[Stream, "StepOutput | BaseException"]]) -> None:
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


def put_all(batch: list[tuple[asyncio.Queue, "StepOutput | BaseException"]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


@dataclass
class Counts:
    """What `stats()` reports of the supervision."""

    aborted: int = 0
    restarts: int = 0
    kept: int = 0  # requests without output yet when their engine process exited: kept for the next one
    readmitted: int = 0  # requests sent to a new engine process (kept ones and those that arrived meanwhile)
    lost: int = 0  # streams that had produced output when their engine process exited: failed
    quarantined: int = 0  # requests failed as suspects: their trial killed the engine again
