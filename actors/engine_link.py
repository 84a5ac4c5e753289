"""The engine host's request side (a base of `EngineHost`, actors/engine_host.py): the handlers' `generate`, the
reader thread that hands each step's outputs to their handlers and reports the engine process's end, and the
questions the replica answers (health, limits, stats). It changes no state but RESTARTING on an exit; every other
transition is the host's supervisor's."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import subprocess
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from multiprocessing.connection import Connection

import ray

from actors.launch import Launched
from actors.messages import Abort, Add, AskStats, EngineDead, Failed, RequestFailed, Running, StatsReply, Stepped
from actors.streams import Exited, Stream, hand_over
from mbd.config import DecodeConfig
from mbd.decoding.constraint_spec import ConstraintSpec
from mbd.decoding.outputs import StepOutput
from mbd.decoding.validate import EngineLimits, RequestError

log = logging.getLogger("ray.serve")
STATS_TIMEOUT_S = 10.0  # how long `stats()` waits for the engine process (at most a step)
SERVING, TRYING, RESTARTING, FAILED, STOPPED = "serving", "trying", "restarting", "failed", "stopped"
HEALTH = {SERVING: "ok", TRYING: "ok", RESTARTING: "restarting", FAILED: "failed", STOPPED: "failed"}


class EngineLink:
    def __init__(self, on_step: Callable[[dict[str, float]], None] | None):
        """on_step: called from the reader thread with the engine's stats after steps (at most every
        `engine_process.ON_STEP_S`)."""
        self._on_step = on_step
        self._asks: dict[int, queue.SimpleQueue] = {}
        self._ask_ids = itertools.count()

    def _attach(self, new: Launched) -> None:
        """Talk to the engine process `new` from now on (its reader thread starts)."""
        self._proc, self._conn, self._limits, self._workers = new.proc, new.conn, new.limits, new.workers
        self._reader = threading.Thread(target=self._read, args=(new.proc, new.conn), name="mbd-engine-reader",
                                        daemon=True)
        self._reader.start()

    def _read(self, proc: subprocess.Popen, conn: Connection) -> None:
        """One engine process's messages until it ends; then its exit goes to the supervisor."""
        why, in_step, failed = "connection closed", (), None
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError) as e:
                why = f"{why} ({type(e).__name__})" if failed is None else why
                break
            if isinstance(msg, Running):
                in_step = msg.request_ids
            elif isinstance(msg, Stepped):
                for r in msg.refused:
                    self._refuse(r.request_id, RequestError(r.error.field, f"request refused by the engine: {r.error}",
                                                            r.error.code))
                self._publish(msg.outputs)
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
            for ask in self._asks.values():  # questions it will never answer
                ask.put({})
            if self._stopping.is_set():
                return
            self.state = RESTARTING  # from now on handlers leave their requests to the supervisor
        self._outbox.put(Exited(proc, conn, why, in_step, failed))

    def _publish(self, outs: Sequence[StepOutput]) -> None:
        items = []
        with self._lock:
            self.counts.generated += sum(len(o.new_token_ids) for o in outs)
            for o in outs:
                s = self._streams.get(o.request_id)
                if s is None:  # it left (aborted) before the engine heard of it
                    self.counts.discarded += len(o.new_token_ids)
                    continue
                if not (o.new_token_ids or o.finished or o.provisional):
                    continue
                if o.finished:  # an engine that only fails requests has not shown it can serve
                    self._left(o.request_id, served=o.finish_reason != "error")
                if (item := s.note(o)) is not None:
                    items.append((s, item))
        hand_over(items)

    def _refuse(self, rid: str, e: BaseException) -> None:
        with self._lock:
            s = self._streams.get(rid)
            if s is not None:
                self._left(rid, served=False)
        if s is not None:
            hand_over([(s, e)])

    # ---- the handlers' side (asyncio) ----

    async def generate(self, prompt_ids: list[int], params: DecodeConfig, per_block: bool = True,
                       rid: str | None = None, constraint: ConstraintSpec | None = None
                       ) -> AsyncIterator[StepOutput]:
        """Yield what the engine committed since the last yield, merged, until the request finishes
        (per_block=False: one StepOutput, the whole generation); leaving early (client gone) aborts it. The
        engine checks the request when it admits it; a refusal raises RequestError naming the field. While the
        engine process restarts (or suspects are tried), the request waits."""
        rid = rid or uuid.uuid4().hex
        self.trace.mark(rid, "arrive")
        s = Stream(asyncio.get_running_loop(), asyncio.Queue(), Add(rid, prompt_ids, params, constraint), per_block)
        with self._lock:  # registered under the lock the supervisor takes: sent now, or by `_next_trial`
            if self.state in (FAILED, STOPPED):
                raise EngineDead(f"engine loop is not running: {self._error}")
            if rid in self._streams:
                raise ValueError(f"request id {rid} is already live")
            self._streams[rid] = s
            if self.state == SERVING:
                s.on_engine = True
                self._outbox.put(s.add)
        finished = False
        try:
            while not finished:
                items = [await s.queue.get()]
                while not s.queue.empty():
                    items.append(s.queue.get_nowait())
                if err := next((it for it in items if isinstance(it, BaseException)), None):
                    raise err
                out = items[0]
                for it in items[1:]:
                    out = out.merge(it)
                finished = out.finished
                if out.finish_reason == "error":
                    raise RequestFailed(out.error)
                yield out
        finally:
            if not finished:
                self._abort(rid)

    def _abort(self, rid: str) -> None:
        with self._lock:
            s = self._streams.get(rid)
            if s is not None:
                self._left(rid, served=False)
                if s.on_engine:
                    self._outbox.put(Abort(rid))
                self.counts.aborted += 1

    # ---- what the replica answers ----

    def check(self) -> None:
        """Serve's health check: raise once the host gave up (or its reader or supervisor thread died). A dead
        tensor-parallel rank takes its engine process down, so that the supervisor restarts every rank."""
        if self.state == FAILED:
            raise EngineDead(f"engine loop is not running: {self._error}")
        if not self._supervisor.is_alive() and not self._stopping.is_set():
            raise EngineDead("the engine's supervisor thread has stopped")
        if self.state in (SERVING, TRYING) and not self._reader.is_alive():
            raise EngineDead("the engine's reader thread has stopped")
        if self._workers and self.state in (SERVING, TRYING):
            done, _ = ray.wait([ref for _, ref in self._workers], num_returns=len(self._workers), timeout=0)
            if done:
                log.error("a tensor-parallel rank exited; stopping its engine process to restart every rank")
                self._killed.add(self._proc.pid)
                self._proc.kill()

    def engine_state(self) -> str:
        """"ok" (serving, or trying suspects while others wait), "restarting" or "failed"."""
        return HEALTH[self.state]

    def limits(self) -> EngineLimits:
        """What this replica's engine can serve (the ingress checks requests against it before routing them)."""
        return self._limits

    def stats(self) -> dict[str, float]:
        """A snapshot for operators and tests: open streams, the supervision counts, and the engine's stats (asked
        of the engine process, as of its last step; absent while it restarts)."""
        c = self.counts
        base = {"streams": len(self._streams), "aborted": c.aborted, "generated": c.generated,
                "discarded": c.discarded, "engine_restarts": c.restarts,
                "readmitted": c.readmitted, "resumed": c.resumed, "quarantined": c.quarantined, "trials": c.trials}
        answer: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            if self.state not in (SERVING, TRYING):
                return base
            ask = next(self._ask_ids)
            self._asks[ask] = answer
            self._outbox.put(AskStats(ask))
        try:
            return base | answer.get(timeout=STATS_TIMEOUT_S)
        except queue.Empty:
            return base
        finally:
            with self._lock:
                del self._asks[ask]
