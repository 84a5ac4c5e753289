"""The one progress line of long jobs (eval sweeps, training, the reproduction): done / total, the job's own
figures (accuracy so far, loss, tokens/s), time elapsed and the ETA from the rate since the line started.

On a terminal the line is redrawn in place; anywhere else (a Ray job's log, a file, `--no-progress`) it is
printed as a full line every `every_s` seconds and once at the end, so a job log shows how far a job got."""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO


def hms(seconds: float) -> str:
    """12 s, 3m05s, 2h07m."""
    s = int(seconds)
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


class ProgressLine:
    def __init__(self, what: str, total: int, done: int = 0, show: bool = True, every_s: float = 30.0,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        """done: already done before this run (resumed work: it counts in done / total, not in the rate);
        show: redraw in place on a terminal (False: full lines only, as in a log)."""
        self.what, self.total, self.done, self.every_s, self.clock = what, total, done, every_s, clock
        self.stream = stream or sys.stderr
        self.redraw = show and self.stream.isatty()
        self.figures: dict[str, str] = {}
        self._start_done, self._t0 = done, clock()
        self._printed = self._t0

    def update(self, n: int = 1, done: int | None = None, **figures: str) -> None:
        """n more done (or `done` in all), with the job's figures as they stand now."""
        self.done = done if done is not None else self.done + n
        self.figures.update(figures)
        now = self.clock()
        if self.redraw:
            self.stream.write("\r\033[K" + self.line())
            self.stream.flush()
        elif now - self._printed >= self.every_s:
            self._printed = now
            print(self.line(), file=self.stream, flush=True)

    def line(self) -> str:
        elapsed = self.clock() - self._t0
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        parts = [f"{self.what}: {self.done}/{self.total}{pct}", *(f"{k} {v}" for k, v in self.figures.items()),
                 f"{hms(elapsed)} elapsed"]
        rate = (self.done - self._start_done) / elapsed if elapsed > 0 else 0.0
        if self.done < self.total and rate > 0:
            parts.append(f"ETA {hms((self.total - self.done) / rate)}")
        return " · ".join(parts)

    def close(self) -> None:
        """The final line (ends the redrawn one)."""
        print(("\r\033[K" if self.redraw else "") + self.line(), file=self.stream, flush=True)
