"""How a decoder replica supervises its engine process, as policy (the mechanics are actors/engine_host.py):
how often it restarts it, and whether an exit is evidence against the requests in the engine's step.

A request is a suspect only when the engine died by itself while running a step it was in: not when the replica
killed the process (a lost tensor-parallel rank, a broken connection, shutdown), not when a signal from outside
ended it (SIGKILL of the process group, an operator's SIGTERM), not when a rank ended first. Suspects are tried
one at a time, each beside none but requests already cleared, until its first output (surviving a step clears
it, so a replica is not held to one request at a time for whole generations); it is failed (`RequestQuarantined`)
only if the engine dies by itself again on its trial, within the restart window, as a job system bisects a
crash-looping batch. Imports no torch: the serve config
reads `EngineRestarts`.
"""

from __future__ import annotations

import signal
from typing import Callable

from pydantic import Field

from actors.messages import Failed
from mbd.config import StrictModel

# signals another process sends (the kernel's OOM killer included): an exit by one of them says nothing of the step
OUTSIDE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


class EngineRestarts(StrictModel):
    """How a replica restarts its engine process when it exits: the k-th exit within `window_s` is restarted after
    `delay(k)` (the first at once, then backoff_s, 2 x backoff_s, ...), at most `limit` times; one more exit in the
    window and the replica gives up (a crash loop stops). A request's suspicion expires with the window too."""

    limit: int = Field(default=3, ge=0, description="restarts within window_s; 0: an engine exit is fatal")
    window_s: float = Field(default=60.0, gt=0, description="exits (and suspicions) older than this no longer count")
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


def died_by_itself(code: int, killed_by_host: bool, rank_lost: bool) -> bool:
    """Whether an engine process's exit (`code`: Popen's returncode) is its own doing: an exception (exit code),
    a fault (SIGSEGV, SIGABRT, ...), and neither the host nor an outside signal nor a lost rank ended it."""
    return not killed_by_host and not rank_lost and not (code < 0 and -code in OUTSIDE_SIGNALS)


def rank_lost(failed: Failed | None, rank_ended: Callable[[], bool]) -> bool:
    """Whether a tensor-parallel rank ended first, from rank 0's own last word: its `Failed` says whether a
    collective failed; only when it sent none (it was killed, or its connection broke) does a rank whose loop
    ended (`rank_ended`, asked only then) count. A rank that ends after rank 0 is no evidence: its collective
    fails within moments of rank 0's exit."""
    return failed.collective if failed is not None else rank_ended()


def convicted(alone: bool, suspected_at: float | None, now: float, window_s: float) -> bool:
    """A suspect is failed when the engine died by itself with it the only suspect in the step (`alone`: the
    others there were cleared), after it was already suspected within the window (its trial crashed too)."""
    return alone and suspected_at is not None and now - suspected_at <= window_s
