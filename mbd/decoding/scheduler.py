"""Continuous batching: a FIFO of waiting requests and a fixed set of batch slots (rows).

Requests are admitted into the lowest free row so that occupied rows stay packed at the front and the
runner can use the smallest batch bucket, and only when their KV pages fit; a finished or aborted request
frees its row for the next one on the following step. When the page pool runs out mid-decode the youngest
running request is preempted: back to the front of the queue, its Block Buffer kept, its committed tokens
prefilled again on readmission.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from mbd.decoding.state import Request


class Scheduler:
    def __init__(self, rows: int):
        self.rows = rows
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # row -> request
        self.by_id: dict[str, Request] = {}
        self._aborted: list[Request] = []

    def add(self, req: Request) -> None:
        if req.id in self.by_id:
            raise ValueError(f"request_id {req.id!r} is already in use; pass a unique request_id")
        self.waiting.append(req)
        self.by_id[req.id] = req

    def abort(self, request_id: str) -> bool:
        """Mark a request aborted; the engine frees it on the next step. False if it is unknown or done."""
        req = self.by_id.get(request_id)
        if req is None or req.finished:
            return False
        if not req.aborted:
            req.aborted = True
            self._aborted.append(req)
        return True

    def free_rows(self) -> list[int]:
        return [r for r in range(self.rows) if r not in self.running]

    def admit(self, fits: Callable[[Request, int], bool]) -> list[Request]:
        """Move waiting requests, first come first served, into free rows (lowest first) while `fits(req, row)`
        (the engine maps the request's KV pages there, or says the pool cannot hold it yet). Call
        `take_aborted` first."""
        admitted = []
        for row in self.free_rows():
            if not self.waiting or not fits(self.waiting[0], row):
                break
            req = self.waiting.popleft()
            req.row = row
            self.running[row] = req
            admitted.append(req)
        return admitted

    def youngest(self) -> Request:
        """The most recently admitted running request (the one preempted first)."""
        return next(reversed(self.running.values()))

    def preempt(self, req: Request) -> None:
        """Send a running request back to the front of the queue (it is the oldest waiting one)."""
        del self.running[req.row]
        req.row = -1
        self.waiting.appendleft(req)

    def take_aborted(self) -> list[Request]:
        """Remove and return every aborted request (running or waiting)."""
        gone, self._aborted = self._aborted, []
        for req in gone:
            if self.running.get(req.row) is req:
                del self.running[req.row]
        if gone:
            self.waiting = deque(r for r in self.waiting if not r.aborted)
        return gone

    def finish(self, req: Request) -> None:
        if self.running.get(req.row) is req:
            del self.running[req.row]
        self.by_id.pop(req.id, None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def rows_needed(self) -> int:
        return max(self.running) + 1 if self.running else 0
