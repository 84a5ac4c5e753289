"""Engine host: rank 0 of a decoder replica, bridging asyncio request handlers and the engine process, which it
supervises. The policy (evidence, trials, give-up) is actors/supervisor.py; the streams are actors/streams.py.

The engine loop runs in a process of its own (actors/engine_process.py), so request handling never competes with
it for the interpreter lock. Three kinds of thread touch the host, under one lock (`_lock`):
- handlers (asyncio) register a request (`generate`) and, while the host is SERVING, put its `Add` in the outbox;
- a reader thread per engine process hands each step's outputs to their handlers; when the process ends it puts
  the exit in the outbox;
- the supervisor thread is the only one that sends to the engine process and the only one that changes state.

The state machine (every transition a method of the supervisor thread, but `_fail_all`):

| state      | event                                  | transition      | next state                    |
|------------|----------------------------------------|-----------------|-------------------------------|
| SERVING    | the engine process exits               | `_on_exit`      | RESTARTING                    |
| TRYING     | the engine process exits               | `_on_exit`      | RESTARTING                    |
| RESTARTING | a new engine process is ready          | `_next_trial`   | TRYING (suspects) or SERVING  |
| RESTARTING | too many counted exits, or no start    | `_give_up`      | FAILED                        |
| TRYING     | every request of the trial finished    | `_next_trial`   | TRYING (next group) / SERVING |
| any        | `shutdown`                             | `_fail_all`     | STOPPED                       |

SERVING sends every request as it arrives. TRYING runs one suspect group alone (new requests wait, in order).
At `_on_exit` the exit is judged (supervisor.py): a convicted request gets `RequestQuarantined` (500); nobody
else fails. Every live request is re-admitted to the new engine process, resumed from the tokens its client
already has (mbd/decoding/resume.py: greedy streams continue exactly as if uninterrupted). At give-up every
request gets `EngineDead` (a retryable 503) and the health check fails so that Serve replaces the replica.
"""

from __future__ import annotations

import logging
import queue
import subprocess
import threading
import time
from typing import Callable

import ray

from actors.engine_link import FAILED, SERVING, STOPPED, TRYING, EngineLink
from actors.launch import end_workers, launch
from actors.messages import Add, EngineDead, RequestQuarantined, Stop, ToEngine
from actors.streams import Counts, Exited, Stream, TrialOver, hand_over
from actors.supervisor import EngineRestarts, ExitLog, Trials, died_by_itself, exit_status, rank_lost
from actors.trace import Trace
from mbd.config import DecodeConfig, EngineConfig
from mbd.decoding.model_spec import ModelSpec

log = logging.getLogger("ray.serve")
RANK_GRACE_S = 2.0  # how long an exit without a `Failed` waits to learn whether a tensor-parallel rank ended


class EngineHost(EngineLink):
    def __init__(self, spec: ModelSpec, decode: DecodeConfig, engine: EngineConfig,
                 restarts: EngineRestarts = EngineRestarts(), on_step: Callable[[dict[str, float]], None] | None = None,
                 startup_timeout_s: float = 600.0, on_count: Callable[[str, int], None] | None = None):
        """on_step: called from the reader thread with the engine's stats after steps; on_count: called as the
        supervisor restarts the engine process ("restarts", 1) or convicts a request ("quarantined", 1). A first
        engine process that does not start raises EngineDead (the replica fails to start; Serve retries it)."""
        self.spec, self.decode, self.engine, self.restarts = spec, decode, engine, restarts
        self.startup_timeout_s, self._on_count = startup_timeout_s, on_count
        self._lock = threading.Lock()  # the streams, the state, the trials, the exit log
        self._streams: dict[str, Stream] = {}  # in arrival order: waiting requests are sent in it
        self._outbox: queue.SimpleQueue[ToEngine | Exited | TrialOver] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._killed: set[int] = set()  # engine processes the host killed itself (not evidence against a step)
        self.trials, self.exits = Trials(), ExitLog(restarts)
        self.state, self._error = SERVING, None
        self.counts, self.trace = Counts(), Trace("decoder")
        super().__init__(on_step)
        self._attach(launch(spec, decode, engine, startup_timeout_s))
        self._supervisor = threading.Thread(target=self._supervise, name="mbd-engine-supervisor", daemon=True)
        self._supervisor.start()

    # ---- the supervisor thread ----

    def _supervise(self) -> None:
        """The supervisor's loop; an unexpected exception in it gives up rather than leaving requests waiting."""
        try:
            while self._handle(self._outbox.get()):
                pass
        except Exception as e:  # noqa: BLE001 - a bug here: nobody else would restart the engine
            log.exception("the engine supervisor failed")
            self._give_up(f"the engine supervisor failed: {e!r}")

    def _handle(self, item: ToEngine | Exited | TrialOver) -> bool:
        """One outbox item; False once the supervisor is done (given up or stopping)."""
        if isinstance(item, Exited):
            self._on_exit(item)
            return self._restart(item.why)
        if isinstance(item, TrialOver):
            with self._lock:  # stale when a restart started another trial since it was queued
                due = self.state == TRYING and self.trials.current is None
            if due:
                self._next_trial()
            return True
        try:
            self._conn.send(item)
        except OSError:  # the process is gone: its reader reports the exit, which comes next
            pass
        return not isinstance(item, Stop)

    def _on_exit(self, ex: Exited) -> None:
        """SERVING / TRYING -> RESTARTING: judge the exit (supervisor.py) and convict a request that crashed the
        engine alone on its trial; every other request stays, for the next engine process."""
        try:
            code = ex.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # its connection broke but it lives on: it cannot serve
            self._killed.add(ex.proc.pid)
            ex.proc.kill()
            code = ex.proc.wait()
        ex.conn.close()
        lost = rank_lost(ex.failed, lambda: bool(self._workers) and bool(
            ray.wait([r for _, r in self._workers], timeout=RANK_GRACE_S)[0]))
        by_itself = died_by_itself(code, ex.proc.pid in self._killed, lost, raised=ex.failed is not None)
        now = time.monotonic()
        with self._lock:
            step = [rid for rid in ex.in_step if rid in self._streams]
            on_trial = self.trials.current is not None and any(r in self.trials.current for r in step)
            culprit = self.trials.crashed(step) if by_itself and on_trial else None
            if not (by_itself and on_trial):  # a trial crash does not count toward giving up
                self.trials.retry()
                self.exits.add(now, step if by_itself else ())
                if by_itself:
                    self.trials.suspect(step)
            guilty = self._streams.pop(culprit) if culprit else None
            if culprit:
                self.exits.explain(culprit, now)
            for s in self._streams.values():
                s.on_engine = False
        if guilty is not None:
            self._count("quarantined", 1)
            hand_over([(guilty, RequestQuarantined(
                f"the engine process died by itself ({exit_status(code)}) with this request alone in its step, on "
                "this request's trial after it had been in a step that died; it is not run again"))])
        log.error("engine process %d exited (%s; %s; %s): %s; %d suspect group(s) to try; %d request(s) kept",
                  ex.proc.pid, exit_status(code), ex.why, "by itself in a step" if by_itself else "not by itself",
                  f"request {culprit} convicted" if culprit else "nobody convicted", len(self.trials.queue),
                  len(self._streams))

    def _restart(self, why: str) -> bool:
        """RESTARTING: start a new engine process after the back-off the counted exits call for; give up once
        they exceed `restarts.limit`. False once the supervisor is done."""
        while True:
            now = time.monotonic()
            if self.exits.gives_up(now):
                self._give_up(f"the engine process exited {self.exits.count(now)} times within "
                              f"{self.restarts.window_s:.0f} s (last: {why})")
                return False
            if self._stopping.wait(self.restarts.delay(self.exits.count(now))):
                return False
            end_workers(self._workers)
            try:
                new = launch(self.spec, self.decode, self.engine, self.startup_timeout_s)
                break
            except Exception as e:  # noqa: BLE001 - EngineDead, or the start itself failed: a counted exit
                why = str(e)
                self.exits.add(time.monotonic())
                log.error("engine process restart failed: %s", why)
        if self._stopping.is_set():  # the replica began shutting down while it started
            new.conn.send(Stop())
            new.proc.wait()
            return False
        self._attach(new)
        self._count("restarts", 1)
        self._next_trial()
        return True

    def _next_trial(self) -> None:
        """RESTARTING / TRYING -> TRYING with the next suspect group alone, or SERVING with every request that is
        not on the engine process yet (oldest first). Requests whose output already ended finish here."""
        with self._lock:
            while (group := self.trials.start()) is not None and not group & self._streams.keys():
                pass
            todo = [s for rid, s in self._streams.items() if rid in group] if group else \
                [s for s in self._streams.values() if not s.on_engine]
            self.state = TRYING if group else SERVING
            self.counts.trials += bool(group)
            ops, ended = [], []
            for s in todo:
                s.on_engine = True
                got = s.readmission(self._limits.max_length)
                (ops if isinstance(got, Add) else ended).append((s, got))
            for s, _ in ended:
                self._left(s.add.request_id)
            self.counts.readmitted += len(ops)
            self.counts.resumed += sum(op.resumed is not None for _, op in ops)
        hand_over(ended)
        for _, op in ops:
            try:
                self._conn.send(op)
            except OSError:
                break
        if group:
            log.warning("trying %d suspect request(s) alone: %s", len(group), sorted(group))

    def _give_up(self, reason: str) -> None:
        """-> FAILED: every request gets EngineDead (a retryable 503); the health check fails."""
        log.error("%s; giving up: this replica now fails its health check so that Serve replaces it", reason)
        end_workers(self._workers)
        self._fail_all(EngineDead(f"engine process gave up: {reason}"), FAILED)

    def _fail_all(self, e: BaseException, state: str) -> None:
        with self._lock:
            self.state, self._error = state, e
            streams, self._streams = list(self._streams.values()), {}
        hand_over([(s, e) for s in streams])

    def _count(self, what: str, n: int) -> None:
        setattr(self.counts, what, getattr(self.counts, what) + n)
        if self._on_count is not None:
            self._on_count(what, n)

    # ---- bookkeeping shared by the threads (called under the lock) ----

    def _left(self, rid: str, served: bool = True) -> None:
        """A request left the host: the trials forget it, and a trial it ends lets the next group go."""
        self._streams.pop(rid, None)
        if served:
            self.exits.served_at = time.monotonic()
        self.trials.forget(rid)
        if self.trials.cleared(rid):
            self._outbox.put(TrialOver())

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
        self._fail_all(EngineDead("the replica is shutting down"), STOPPED)
        self._reader.join(timeout=5)
        self._supervisor.join(timeout=5)
