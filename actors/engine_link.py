"""One engine process as its replica's host talks to it: the connection (sent on only by the host's supervisor
thread), the reader thread that receives its messages until it ends, and the stats questions waiting for it. The
link changes no supervision state: it hands each step to the host's `on_stepped` and its end to `on_exit`."""

from __future__ import annotations

import itertools
import queue
import subprocess
import threading
from collections.abc import Callable

import ray

from actors.launch import Launched, ranks_ended
from actors.messages import Failed, Running, StatsReply, Stepped, ToEngine
from actors.streams import Exited
from actors.supervision_policy import died_by_itself, rank_lost

RANK_GRACE_S = 2.0  # how long an exit without a `Failed` waits to learn whether a tensor-parallel rank ended
STATS_TIMEOUT_S = 10.0  # how long `stats()` waits for the engine process (at most a step)


class EngineLink:
    def __init__(self, new: Launched, on_stepped: Callable[[Stepped], None], on_exit: Callable[[Exited], None],
                 on_step: Callable[[dict[str, float]], None] | None):
        """on_stepped / on_exit: called from the reader thread with each `Stepped` and, once, with the process's
        end; on_step: with the engine's stats after steps (at most every `engine_process.ON_STEP_S`)."""
        self.proc, self.limits = new.proc, new.limits
        self._conn, self._on_stepped, self._on_exit, self._on_step = new.conn, on_stepped, on_exit, on_step
        self._lock = threading.Lock()  # the asks
        self._asks: dict[int, queue.SimpleQueue] = {}
        self._ask_ids = itertools.count()
        self.ended = False  # the reader saw the process end and reported it
        self.reader = threading.Thread(target=self._read, name="mbd-engine-reader", daemon=True)
        self.reader.start()

    def send(self, op: ToEngine) -> None:
        """Send `op` (the supervisor thread only); a process that is gone is reported by its reader instead."""
        try:
            self._conn.send(op)
        except OSError:
            pass

    def close(self, timeout_s: float) -> None:
        """Wait for the process to end (it was told to stop), killing it after timeout_s; then for the reader."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(timeout=5)

    def stats(self, ask: Callable[[Callable[[ToEngine], None], int], None]) -> dict[str, float]:
        """The engine's stats as of its last step ({} if it does not answer in time, or ended): `ask(send, id)`
        has the supervisor send the question."""
        answer: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            if self.ended:
                return {}
            n = next(self._ask_ids)
            self._asks[n] = answer
        ask(self.send, n)
        try:
            return answer.get(timeout=STATS_TIMEOUT_S)
        except queue.Empty:
            return {}
        finally:
            with self._lock:
                del self._asks[n]

    def _read(self) -> None:
        """The process's messages until it ends; then questions it will never answer get {} and its end is
        reported."""
        why, in_step, failed = "connection closed", (), None
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError) as e:
                why = f"{why} ({type(e).__name__})" if failed is None else why
                break
            if isinstance(msg, Running):
                in_step = msg.request_ids
            elif isinstance(msg, Stepped):
                self._on_stepped(msg)
                if msg.stats is not None and self._on_step is not None:
                    self._on_step(msg.stats)
            elif isinstance(msg, StatsReply):
                with self._lock:
                    ask = self._asks.get(msg.ask)
                if ask is not None:
                    ask.put(msg.stats)
            elif isinstance(msg, Failed):
                why, failed = msg.message, msg
        with self._lock:
            self.ended = True
            for ask in self._asks.values():
                ask.put({})
        self._on_exit(Exited(self.proc, self._conn, why, in_step, failed))


def reap(ex: Exited, killed: set[int], workers: list[tuple[object, ray.ObjectRef]]) -> tuple[int, bool]:
    """The exit code of the process that `ex` reports ended, and whether it died by itself (evidence against its
    step: actors/supervision_policy.py). One whose connection broke but that lives on cannot serve: it is killed,
    and noted in `killed` (its end is no evidence)."""
    try:
        code = ex.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        killed.add(ex.proc.pid)
        ex.proc.kill()
        code = ex.proc.wait()
    ex.conn.close()
    lost = rank_lost(ex.failed, lambda: ranks_ended(workers, RANK_GRACE_S))
    return code, died_by_itself(code, ex.proc.pid in killed, lost, raised=ex.failed is not None)
