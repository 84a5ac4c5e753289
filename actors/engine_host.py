"""Engine host: rank 0 of a decoder replica, bridging asyncio request handlers and the engine process, which it
supervises.

The engine loop runs in a process of its own (actors/engine_process.py), so the replica's request handling never
competes with it for the interpreter lock; the replica talks to it through one connection, in the messages of
actors/messages.py. Three kinds of thread touch the host, under one lock (`_lock`: the streams and the state):
- handlers (asyncio, any event loop) register a request and put its `Add` in the outbox;
- a reader thread per engine process receives each step's outputs and hands a request's `StepOutput`s to its
  handler's asyncio.Queue, one thread-safe call per event loop per step; when the process ends it puts the exit
  in the outbox and ends;
- the supervisor thread is the only one that sends to the engine process: it empties the outbox in order (ops,
  and exits), so an `Abort` never overtakes its `Add`, and it restarts the engine process after an exit.

Supervision: an engine process can die while its replica is healthy (a CUDA error, an out-of-memory kill, a bug on
a rare request), and replacing the whole replica would repeat the model load and warm-up. So the supervisor logs
the exit status, fails the streams that had produced output (their clients get a clean error event), keeps every
other request, starts a new engine process (and TP ranks) with the same configuration and re-admits the kept
requests in their order; meanwhile the host is "restarting" and requests that arrive wait with the kept ones. When
the engine died by itself in a step (actors/supervisor.py), the requests of that step are suspects, tried one at a
time before anything else is sent: a suspect runs beside none but those already cleared, and is cleared once its
first output arrives (it survived a step); one whose trial kills the engine again is failed with
`RequestQuarantined`, and the others of that step stay innocent. A crash loop stops: the k-th exit within
`EngineRestarts.window_s` is restarted after a back-off, up to `limit` restarts; then the host is "failed", its
health check fails and Serve replaces the replica. vLLM's V1 server treats a dead engine core as fatal and leaves
the restart to its orchestrator; here the replica owns the engine process, so it restarts it itself.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import subprocess
import threading
import time
import uuid
from multiprocessing.connection import Connection
from typing import AsyncIterator, Callable, Sequence

import ray

from actors.launch import end_workers, launch
from actors.messages import (Abort, Add, AskStats, EngineDead, Failed, RequestFailed, RequestQuarantined, Running,
                             StatsReply, Stepped, Stop, ToEngine)
from actors.streams import Counts, Exited, Next, Stream, hand_over
from actors.supervisor import EngineRestarts, convicted, died_by_itself, exit_status, rank_lost
from actors.trace import Trace
from mbd.config import DecodeConfig, EngineConfig
from mbd.decoding.constraint_spec import ConstraintSpec
from mbd.decoding.outputs import StepOutput
from mbd.decoding.model_spec import ModelSpec
from mbd.decoding.validate import EngineLimits, RequestError

log = logging.getLogger("ray.serve")
STATS_TIMEOUT_S = 10.0  # how long `stats()` waits for the engine process (at most a step)
RANK_GRACE_S = 2.0  # how long an exit without a `Failed` waits to learn whether a tensor-parallel rank ended
OK, RESTARTING, FAILED = "ok", "restarting", "failed"  # the host's states (`state`)


class EngineHost:
    def __init__(self, spec: ModelSpec, decode: DecodeConfig, engine: EngineConfig,
                 restarts: EngineRestarts = EngineRestarts(), on_step: Callable[[dict[str, float]], None] | None = None,
                 startup_timeout_s: float = 600.0, on_count: Callable[[str, int], None] | None = None):
        """on_step: called from the reader thread with the engine's stats (`engine_process.engine_stats`) after
        steps, at most every `engine_process.ON_STEP_S`. on_count: called as the supervisor restarts the engine
        process ("restarts", 1) or fails requests as suspects ("quarantined", n), so that the metrics count them
        even if the engine never steps again. A first engine process that does not start raises EngineDead (the
        replica fails to start; Serve retries it)."""
        self.spec, self.decode, self.engine, self.restarts = spec, decode, engine, restarts
        self.startup_timeout_s = startup_timeout_s
        self._on_step, self._on_count = on_step, on_count
        self._lock = threading.Lock()  # the streams, the state, the suspect on trial and the stats questions
        self._streams: dict[str, Stream] = {}  # in arrival order: kept requests are re-admitted in it
        self._outbox: queue.SimpleQueue[ToEngine | Exited | Next] = queue.SimpleQueue()
        self._asks: dict[int, queue.SimpleQueue] = {}
        self._ask_ids = itertools.count()
        self._solo: str | None = None  # the suspect on trial: nothing new is sent until it is cleared or ends
        self._killed: set[int] = set()  # engine processes the host killed itself (not evidence against a step)
        self._stopping = threading.Event()
        self._exits: collections.deque[float] = collections.deque()  # when the engine process exited, in the window
        self._error: BaseException | None = None  # why the host gave up (state FAILED)
        self.state = OK
        self.counts = Counts()
        self.trace = Trace("decoder")
        first = launch(spec, decode, engine, startup_timeout_s)
        self._proc, self._conn, self._limits, self._workers = first.proc, first.conn, first.limits, first.workers
        self._reader = self._start_reader(first.proc, first.conn)
        self._supervisor = threading.Thread(target=self._supervise, name="mbd-engine-supervisor", daemon=True)
        self._supervisor.start()

    # ---- the supervisor thread: sends, exits, restarts ----

    def _supervise(self) -> None:
        """The supervisor thread's loop; an unexpected exception in it gives up (the health check fails) rather
        than leaving the host restarting for ever."""
        try:
            while self._handle(self._outbox.get()):
                pass
        except Exception as e:  # noqa: BLE001 - a bug here: nobody else would restart the engine
            log.exception("the engine supervisor failed")
            self._give_up(f"the engine supervisor failed: {e!r}")

    def _handle(self, item: ToEngine | Exited | Next) -> bool:
        """One outbox item; False once the supervisor is done (the host gave up or is stopping)."""
        if isinstance(item, Exited):
            return self._recover(item)
        if isinstance(item, Next):
            self._send_waiting()
            return True
        try:
            self._conn.send(item)
        except OSError:  # the process is gone: its reader reports the exit, which comes next
            pass
        return not isinstance(item, Stop)

    def _recover(self, ex: Exited) -> bool:
        """Log the exit, fail the streams that had produced output, judge the requests of the step, keep the
        others and restart; False once the host gave up or is shutting down."""
        try:
            code = ex.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # its connection broke but it lives on: it cannot serve
            self._killed.add(ex.proc.pid)
            ex.proc.kill()
            code = ex.proc.wait()
        ex.conn.close()
        lost_rank = rank_lost(ex.failed, lambda: bool(self._workers) and bool(
            ray.wait([r for _, r in self._workers], timeout=RANK_GRACE_S)[0]))
        by_itself = died_by_itself(code, ex.proc.pid in self._killed, lost_rank)
        now, status = time.monotonic(), exit_status(code)
        with self._lock:
            lost = [s for s in self._streams.values() if s.produced]
            suspects = [s for rid in ex.in_step if (s := self._streams.get(rid)) and not s.produced] if by_itself \
                else []
            on_trial = [s for s in suspects if s.suspected is not None]
            guilty = [s for s in on_trial if convicted(len(on_trial) == 1, s.suspected, now, self.restarts.window_s)]
            suspects = guilty or suspects  # a conviction explains the exit: the others of the step stay innocent
            for s in lost + guilty:
                del self._streams[s.add.request_id]
            for s in suspects:
                s.suspected = now
            for s in self._streams.values():
                s.sent, s.held = False, None
            self._solo = None
            kept = len(self._streams)
            self.counts.kept += kept
            self.counts.lost += len(lost)
        self._count("quarantined", len(guilty))
        hand_over([(s, EngineDead(f"the engine process exited mid-stream ({status})")) for s in lost] + [
            (s, RequestQuarantined(f"the engine died by itself ({status}) on this request's trial (beside none but "
                                   "requests already cleared), after it had died with it in the step before; it is "
                                   "not run again")) for s in guilty])
        log.error("engine process %d exited (%s; %s; %s): %d stream(s) that had produced output failed, %d "
                  "request(s) quarantined, %d suspect(s) to try, %d request(s) kept for a new engine "
                  "process", ex.proc.pid, status, ex.why, "by itself in a step" if by_itself else "not by itself",
                  len(lost), len(guilty), len(suspects) - len(guilty), kept)
        return self._restart(ex.why)

    def _restart(self, why: str) -> bool:
        """Start a new engine process after the back-off the exits in the window call for, and re-admit the kept
        requests; give up (FAILED) once the exits in the window exceed `restarts.limit`."""
        t0 = time.monotonic()
        while True:
            now = time.monotonic()
            self._exits.append(now)
            while self._exits and self._exits[0] < now - self.restarts.window_s:
                self._exits.popleft()
            k = len(self._exits)
            if k > self.restarts.limit:
                self._give_up(f"the engine process exited {k} times within {self.restarts.window_s:.0f} s "
                              f"(last: {why})")
                return False
            if self._stopping.wait(self.restarts.delay(k)):
                self._fail_all(EngineDead("the replica is shutting down"))
                return False
            end_workers(self._workers)
            try:
                new = launch(self.spec, self.decode, self.engine, self.startup_timeout_s)
                break
            except Exception as e:  # noqa: BLE001 - EngineDead, or the start itself failed: one more exit
                why = str(e)
                log.error("engine process restart %d of %d failed: %s", k, self.restarts.limit, why)
        if self._stopping.is_set():  # the replica began shutting down while it started
            new.conn.send(Stop())
            new.proc.wait()
            self._fail_all(EngineDead("the replica is shutting down"))
            return False
        self._proc, self._conn, self._workers = new.proc, new.conn, new.workers
        self._count("restarts", 1)
        self._reader = self._start_reader(new.proc, new.conn)
        n = self._send_waiting(restarted=True)
        log.warning("engine process restarted (pid %d) %.1f s after the exit; %d request(s) re-admitted in order "
                    "(a suspect on trial first, else the kept ones, then those that arrived meanwhile)", new.proc.pid,
                    time.monotonic() - t0, n)
        return True

    def _send_waiting(self, restarted: bool = False) -> int:
        """Send what waits for the current engine process: the next suspect (beside none but those cleared
        before it), or, once none is left, every request not sent yet, oldest first; then OK (handlers send their
        own requests again)."""
        with self._lock:
            trial = self._streams.get(self._solo) if self._solo is not None else None
            if trial is not None and trial.suspected is not None or not restarted and self.state != OK:
                return 0  # a suspect is still on trial, or the process died meanwhile (its exit comes next)
            suspect = next((s for s in self._streams.values() if s.suspected is not None), None)
            todo = [suspect] if suspect else [s for s in self._streams.values() if not s.sent]
            self._solo = suspect.add.request_id if suspect else None
            for s in todo:
                s.sent = True
            self.state = OK
            self.counts.readmitted += len(todo)
        for s in todo:
            try:
                self._conn.send(s.add)
            except OSError:
                break
        return len(todo)

    def _count(self, what: str, n: int) -> None:
        """Add n to the supervision count `what` (a `Counts` field), and tell the metrics."""
        if n:
            setattr(self.counts, what, getattr(self.counts, what) + n)
            if self._on_count is not None:
                self._on_count(what, n)

    def _give_up(self, reason: str) -> None:
        log.error("%s; giving up: this replica now fails its health check so that Serve replaces it", reason)
        end_workers(self._workers)
        self._fail_all(EngineDead(f"engine process gave up: {reason}"))

    # ---- reader threads: outputs to handlers ----

    def _start_reader(self, proc: subprocess.Popen, conn: Connection) -> threading.Thread:
        t = threading.Thread(target=self._read, args=(proc, conn), name="mbd-engine-reader", daemon=True)
        t.start()
        return t

    def _read(self, proc: subprocess.Popen, conn: Connection) -> None:
        """One engine process's messages until it ends; then its exit goes to the supervisor."""
        why, in_step, failed = "connection closed", (), None
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError) as e:
                why = why if why != "connection closed" else f"{why} ({type(e).__name__})"
                break
            if isinstance(msg, Running):
                in_step = msg.request_ids
            elif isinstance(msg, Stepped):
                for r in msg.refused:
                    self._fail(r.request_id, RequestError(r.error.field, f"request refused by the engine: {r.error}",
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
            if not self._stopping.is_set():
                self.state = RESTARTING  # from now on handlers leave their requests to the supervisor
        if self._stopping.is_set():
            proc.wait()
            self._fail_all(EngineDead("the replica is shutting down"))
        else:
            self._outbox.put(Exited(proc, conn, why, in_step, failed))

    def _publish(self, outs: Sequence[StepOutput]) -> None:
        items = []
        for o in outs:
            if not (o.new_token_ids or o.finished or o.provisional):
                continue
            with self._lock:
                s = self._pop(o.request_id) if o.finished else self._streams.get(o.request_id)
                if s is not None and (s.per_block or o.finished):
                    s.produced = True
                if s is not None and o.request_id == self._solo and s.suspected is not None and not o.finished:
                    s.suspected = None  # it survived a step on trial: cleared, the next may go (not its whole run)
                    self._outbox.put(Next())
            if s is None:
                continue
            if not s.per_block:
                o = s.held.merge(o) if s.held is not None else o
                if not o.finished:
                    s.held = o
                    continue
            items.append((s, o))
        hand_over(items)

    def _pop(self, rid: str) -> Stream | None:
        """Remove a request (under the lock); the end of a trial (a suspect that ends before it is cleared) lets
        the others go."""
        s = self._streams.pop(rid, None)
        if s is not None and rid == self._solo and s.suspected is not None:
            self._outbox.put(Next())
        return s

    def _fail(self, rid: str, e: BaseException) -> None:
        with self._lock:
            s = self._pop(rid)
        if s is not None:
            hand_over([(s, e)])

    def _fail_all(self, e: BaseException) -> None:
        """Fail every request: the host is done. A suspect gets RequestQuarantined instead, so that it never
        leaves the replica (the ingress would try it on another)."""
        with self._lock:
            self.state, self._error = FAILED, e
            streams, self._streams = list(self._streams.values()), {}
            suspects = {id(s) for s in streams if s.suspected is not None}
        self._count("quarantined", len(suspects))
        hand_over([(s, RequestQuarantined(f"the engine died by itself with this request in its step; {e}")
                     if id(s) in suspects else e) for s in streams])

    # ---- event-loop side ----

    def check(self) -> None:
        """Serve's health check: raise once the host gave up (or its reader or supervisor thread died). A dead
        tensor-parallel rank takes its engine process down, so that the supervisor restarts every rank."""
        if self.state == FAILED:
            raise EngineDead(f"engine loop is not running: {self._error}")
        if not self._supervisor.is_alive() and not self._stopping.is_set():
            raise EngineDead("the engine's supervisor thread has stopped")
        if self.state == OK and not self._reader.is_alive():
            raise EngineDead("the engine's reader thread has stopped")
        if self._workers and self.state == OK:
            done, _ = ray.wait([ref for _, ref in self._workers], num_returns=len(self._workers), timeout=0)
            if done:
                log.error("a tensor-parallel rank exited; stopping its engine process to restart every rank")
                self._killed.add(self._proc.pid)
                self._proc.kill()

    def engine_state(self) -> str:
        """"ok", "restarting" (a new engine process is starting; requests wait for it) or "failed"."""
        return self.state

    def limits(self) -> EngineLimits:
        """What this replica's engine can serve (the ingress checks requests against it before routing them)."""
        return self._limits

    def stats(self) -> dict[str, float]:
        """A snapshot for operators and tests: open streams, aborted requests, engine restarts with the requests
        they re-admitted, the streams they failed and the requests quarantined, and the engine's stats (asked of
        the engine process, as of its last step; absent while it restarts)."""
        c = self.counts
        base = {"streams": len(self._streams), "aborted": c.aborted, "engine_restarts": c.restarts, "kept": c.kept,
                "readmitted": c.readmitted, "lost_mid_stream": c.lost, "quarantined": c.quarantined}
        answer: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            if self.state != OK:
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

    async def generate(self, prompt_ids: list[int], params: DecodeConfig, per_block: bool = True,
                       rid: str | None = None, constraint: ConstraintSpec | None = None
                       ) -> AsyncIterator[StepOutput]:
        """Yield what the engine committed since the last yield, merged, until the request finishes
        (per_block=False: one StepOutput, the whole generation); leaving early (client gone) aborts it in the
        engine. rid: the request's id in the engine (unique among its live requests; default a fresh uuid).
        The engine checks the request when it admits it; a refusal raises RequestError naming the field. While
        the engine process restarts, the request waits for the new one."""
        rid = rid or uuid.uuid4().hex
        self.trace.mark(rid, "arrive")
        s = Stream(asyncio.get_running_loop(), asyncio.Queue(), Add(rid, prompt_ids, params, constraint), per_block)
        with self._lock:  # registered under the lock the supervisor takes: sent now, or re-admitted by it
            if self.state == FAILED:
                raise EngineDead(f"engine loop is not running: {self._error}")
            if rid in self._streams:
                raise ValueError(f"request id {rid} is already live")
            self._streams[rid] = s
            if self.state == OK and self._solo is None:
                s.sent = True
                self._outbox.put(s.add)
        finished = False
        try:
            while not finished:
                items = [await s.queue.get()]
                while not s.queue.empty():
                    items.append(s.queue.get_nowait())
                for it in items:
                    if isinstance(it, BaseException):
                        raise it
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
            s = self._pop(rid)
            if s is not None and s.sent:
                self._outbox.put(Abort(rid))
        if s is not None:
            self.counts.aborted += 1

    def shutdown(self) -> None:
        """Stop the engine process (and with it the TP ranks' loops); kill it if it does not stop in time."""
        self._stopping.set()
        self._outbox.put(Stop())
        proc = self._proc
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._reader.join(timeout=5)
        self._supervisor.join(timeout=5)
