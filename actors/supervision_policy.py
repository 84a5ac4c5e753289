"""How a decoder replica supervises its engine process, as policy (the mechanics: actors/replica_supervisor.py):
which exits are evidence against the requests of the engine's step, how suspects are tried until one is convicted
or all are cleared, and when a crash loop gives up. Pure logic on request ids and times, so it is unit-tested alone.

Evidence: an engine process that died by itself (an exception, a fault) in a step is evidence against every
request of that step, whatever each had produced before (a request can crash on its 6th step as well as its
1st). Not when the replica killed it, a signal from outside ended it (SIGKILL, the OOM killer, SIGTERM), or a
tensor-parallel rank ended first.

Trials (`Trials`): the requests of such a step are split in halves, queued as suspect groups. A group is tried
alone (new requests wait) until every member finished (all cleared) or the engine dies by itself again. Then the
members of the dying step are the new suspects: one alone in its step is convicted (it crashed the engine beside
nobody, on a trial after the crash that made it a suspect); two or more are split in halves again, so the culprit
among n is found in about log2(n) + 1 restarts; a crash during a trial never convicts a request that was not alone
in the step. A request that crashes only beside another is never convicted: alone it runs clean.

Give-up (`ExitLog`): the k-th counted exit within `window_s` is restarted after `delay(k)`; one more than `limit`
and the replica gives up (its requests get a retryable 503, Serve replaces it). Counted: exits in normal
operation and failed starts; not counted: crashes during trials (the culprit is being looked for), and an exit
explained by a later conviction once the engine has shown it can serve (a request completed in the window). So
ten poisonous requests within a minute are ten convictions, not a crash loop, while an engine that cannot run
at all still gives up. Imports no torch: the serve config reads `EngineRestarts`.
"""

from __future__ import annotations

import collections
import signal
from collections.abc import Iterable
from typing import Callable

from pydantic import Field

from actors.messages import Failed
from mbd.config import StrictModel

# signals another process sends (the kernel's OOM killer included): an exit by one of them says nothing of the step
OUTSIDE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


class EngineRestarts(StrictModel):
    """How a replica restarts its engine process when it exits: the k-th exit within `window_s` is restarted after
    `delay(k)` (the first at once, then backoff_s, 2 x backoff_s, ...), at most `limit` times; one more exit in the
    window and the replica gives up (a crash loop stops). Which exits count: `ExitLog`."""

    limit: int = Field(default=3, ge=0, description="counted restarts within window_s; 0: a counted exit is fatal")
    window_s: float = Field(default=60.0, gt=0, description="exits older than this no longer count")
    backoff_s: float = Field(default=1.0, ge=0, description="back-off before the second restart in the window")

    def delay(self, k: int) -> float:
        """Seconds to wait before the k-th restart in the window (k >= 1)."""
        return 0.0 if k <= 1 else self.backoff_s * 2 ** (k - 2)


def exit_status(code: int | None) -> str:
    """A process's exit status in words: 'exit code 1', 'killed by SIGKILL'."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def died_by_itself(code: int, killed_by_host: bool, rank_lost: bool, raised: bool = False) -> bool:
    """Whether an engine process's exit (`code`: Popen's returncode) is its own doing: it reported an exception
    of its own (`raised`: a `Failed` that is not a failed collective; however it ended afterwards, even killed by
    the host for exiting slowly), or a fault (SIGSEGV, SIGABRT, an exit code) that neither the host nor an outside
    signal nor a lost rank explains."""
    if raised:
        return not rank_lost
    return not killed_by_host and not rank_lost and not (code < 0 and -code in OUTSIDE_SIGNALS)


def rank_lost(failed: Failed | None, rank_ended: Callable[[], bool]) -> bool:
    """Whether a tensor-parallel rank ended first, from rank 0's own last word: its `Failed` says whether a
    collective failed; only when it sent none (it was killed, or its connection broke) does a rank whose loop
    ended (`rank_ended`, asked only then) count. A rank that ends after rank 0 is no evidence: its collective
    fails within moments of rank 0's exit."""
    return failed.collective if failed is not None else rank_ended()


class Trials:
    """The suspect groups still to try, in order, and the one on trial (see the module docstring)."""

    def __init__(self) -> None:
        self.queue: collections.deque[list[str]] = collections.deque()
        self.current: set[str] | None = None  # the group on trial; None: no trial running

    def suspect(self, step: Iterable[str]) -> None:
        """The engine died by itself in normal operation with `step` in it: its halves are tried (a single
        request is tried alone: its first crash beside nobody is not yet a conviction)."""
        group = list(dict.fromkeys(step))
        half = len(group) // 2
        self.queue.extend(part for part in (group[:half], group[half:]) if part)

    def start(self) -> set[str] | None:
        """The next group to try (None: none left; the host serves everyone)."""
        self.current = set(self.queue.popleft()) if self.queue else None
        return self.current

    def cleared(self, rid: str) -> bool:
        """A member of the current trial finished (or left): True when that ends the trial, all cleared."""
        if self.current is None or rid not in self.current:
            return False
        self.current.discard(rid)
        if self.current:
            return False
        self.current = None
        return True

    def crashed(self, step: Iterable[str]) -> str | None:
        """The engine died by itself during the current trial with `step` in it: the convicted request if it was
        alone in the step (of the trial's live members); else the step's members are split in halves, tried
        first, and the members that were not in the step are tried after them as a group of their own."""
        current, self.current = self.current or set(), None
        group = [r for r in dict.fromkeys(step) if r in current]
        if len(group) == 1:
            current.discard(group[0])
            if current:
                self.queue.appendleft(sorted(current))
            return group[0]
        half = len(group) // 2
        for part in (sorted(current - set(group)), group[half:], group[:half]):
            if part:
                self.queue.appendleft(part)
        return None

    def retry(self) -> None:
        """The engine ended during the trial without evidence (an outside kill): try the same group again."""
        if self.current:
            self.queue.appendleft(sorted(self.current))
        self.current = None

    def forget(self, rid: str) -> None:
        """A request left (finished, aborted, failed) while queued for a trial."""
        for g in self.queue:
            if rid in g:
                g.remove(rid)
        self.queue = collections.deque(g for g in self.queue if g)


def judge(trials: Trials, exits: ExitLog, step: list[str], by_itself: bool, now: float) -> str | None:
    """An engine process ended with `step` (the live requests of its step) in it, by itself or not: the trials and
    the exit log take note; returns the request convicted, if any (alone in a step that died on its trial)."""
    if by_itself and trials.current is not None and any(r in trials.current for r in step):
        culprit = trials.crashed(step)  # a trial crash does not count toward giving up
        if culprit is not None:
            exits.explain(culprit, now)
        return culprit
    trials.retry()
    exits.add(now, step if by_itself else ())
    if by_itself:
        trials.suspect(step)
    return None


class ExitLog:
    """The counted exits within the restart window, each with the requests of its step (see the module
    docstring: what counts toward giving up)."""

    def __init__(self, restarts: EngineRestarts):
        self.restarts = restarts
        self.exits: collections.deque[tuple[float, frozenset[str]]] = collections.deque()
        self.served_at = float("-inf")  # when a request last completed: the engine has shown it can serve

    def add(self, now: float, step: Iterable[str] = ()) -> int:
        """Count an exit (or a failed start: no step); returns the counted exits in the window."""
        self.exits.append((now, frozenset(step)))
        return self.count(now)

    def count(self, now: float) -> int:
        while self.exits and self.exits[0][0] < now - self.restarts.window_s:
            self.exits.popleft()
        return len(self.exits)

    def explain(self, rid: str, now: float) -> None:
        """`rid` was convicted: the exits of steps it was in are its doing, not the engine's, if the engine has
        served a request within the window (else it may be the engine that cannot run: they keep counting)."""
        if now - self.served_at <= self.restarts.window_s:
            self.exits = collections.deque(e for e in self.exits if rid not in e[1])

    def gives_up(self, now: float) -> bool:
        return self.count(now) > self.restarts.limit
