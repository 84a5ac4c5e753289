"""A decoder replica's supervisor: every state and transition of a replica is in this file. `ReplicaSupervisor`
owns the engine process (actors/engine_link.py, a link per process), the streams and the state machine; the host
(actors/engine_host.py) adds the handlers' side. Policy: actors/supervisor.py; streams, events: actors/streams.py.

Two thread contexts touch supervision state (`state`, trials, exit log, the link): the supervisor thread drains
one inbox of typed events (`_outbox`, in order) and alone changes state and sends to the engine process; other
threads (handlers, the link's reader, health check, shutdown) post events, and share `_streams` under `_lock`.

| state                          | event                                         | transition    | next state(s)       |
|--------------------------------|-----------------------------------------------|---------------|---------------------|
| serving, trying                | Exited: the engine process ended              | `_on_exit`    | restarting          |
| restarting                     | a new engine process is ready                 | `_next_trial` | trying, serving     |
| trying                         | TrialOver: every suspect of the trial left    | `_next_trial` | trying, serving     |
| serving, trying, restarting    | too many counted exits, no start, or a bug    | `_give_up`    | failed              |
| serving, trying, restarting    | Shutdown                                      | `_stop`       | stopped             |
| serving, trying, restarting    | Added: a handler registered a request         | `_add`        | (unchanged)         |
| serving, trying, restarting    | Left: a request finished or its client left   | `_left`       | (unchanged)         |
| serving, trying                | RankLost: a tensor-parallel rank ended        | `_kill`       | (unchanged)         |

SERVING sends each request as it is added; TRYING runs one suspect group alone (new requests wait, in order). A
request convicted at `_on_exit` gets `RequestQuarantined` (500); every other goes to the next engine process,
resumed from the tokens its client has (mbd/decoding/resume.py). At give-up every request gets `EngineDead` (503).
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable

from actors.engine_link import EngineLink, reap
from actors.launch import Launched, end_workers, launch, ranks_ended
from actors.messages import Abort, AskStats, EngineDead, RequestQuarantined, Stepped, Stop
from actors.streams import Added, Counts, Event, Exited, Left, RankLost, Shutdown, StatsAsked, Stream, \
    TrialOver, hand_over, readmit, take_step
from actors.supervisor import EngineRestarts, ExitLog, Trials, died_by_itself, exit_status, judge, rank_lost
from mbd.config import DecodeConfig, EngineConfig
from mbd.decoding.model_spec import ModelSpec

log = logging.getLogger("ray.serve")
RANK_GRACE_S = 2.0  # how long an exit without a `Failed` waits to learn whether a tensor-parallel rank ended


class State(enum.StrEnum):
    SERVING, TRYING, RESTARTING, FAILED, STOPPED = "serving", "trying", "restarting", "failed", "stopped"


LIVE = (State.SERVING, State.TRYING, State.RESTARTING)
# (states, event, transition method, next states; (): the state does not change), as in the module docstring
TRANSITIONS: tuple[tuple[tuple[State, ...], str, str, tuple[State, ...]], ...] = (
    ((State.SERVING, State.TRYING), "Exited: the engine process ended", "_on_exit", (State.RESTARTING,)),
    ((State.RESTARTING,), "a new engine process is ready", "_next_trial", (State.TRYING, State.SERVING)),
    ((State.TRYING,), "TrialOver: every suspect of the trial left", "_next_trial", (State.TRYING, State.SERVING)),
    (LIVE, "too many counted exits, no start, or a bug", "_give_up", (State.FAILED,)),
    (LIVE, "Shutdown", "_stop", (State.STOPPED,)),
    (LIVE, "Added: a handler registered a request", "_add", ()),
    (LIVE, "Left: a request finished or its client left", "_left", ()),
    ((State.SERVING, State.TRYING), "RankLost: a tensor-parallel rank ended", "_kill", ()),
)


class ReplicaSupervisor:
    def __init__(self, spec: ModelSpec, decode: DecodeConfig, engine: EngineConfig,
                 restarts: EngineRestarts = EngineRestarts(), on_step: Callable[[dict[str, float]], None] | None = None,
                 startup_timeout_s: float = 600.0, on_count: Callable[[str, int], None] | None = None):
        """on_step: called from the reader thread with the engine's stats after steps; on_count: called as the
        supervisor restarts the engine process ("restarts", 1) or convicts a request ("quarantined", 1). A first
        engine process that does not start raises EngineDead (the replica fails to start; Serve retries it)."""
        self.spec, self.decode, self.engine, self.restarts = spec, decode, engine, restarts
        self.startup_timeout_s, self._on_step = startup_timeout_s, on_step
        self._lock = threading.Lock()  # the streams, and `state` against handlers registering
        self._streams: dict[str, Stream] = {}  # in arrival order: waiting requests are sent in it
        self._outbox: queue.SimpleQueue[Event] = queue.SimpleQueue()  # the supervisor's inbox: others post to it
        self._stopping = threading.Event()
        self._killed: set[int] = set()  # engine processes the host killed itself (not evidence against a step)
        self.trials, self.exits = Trials(), ExitLog(restarts)
        self.state, self._error = State.SERVING, None
        self.counts = Counts(on_count=on_count)
        self._attach(launch(spec, decode, engine, startup_timeout_s))
        self._supervisor = threading.Thread(target=self._supervise, name="mbd-engine-supervisor", daemon=True)
        self._supervisor.start()

    def _attach(self, new: Launched) -> None:
        self._link, self._workers = EngineLink(new, self._stepped, self._exited, self._on_step), new.workers

    # ---- the reader thread: hands outputs over, posts what left and the exit ----

    def _stepped(self, msg: Stepped) -> None:
        with self._lock:
            items, left = take_step(self._streams, self.counts, msg)
        now = time.monotonic()
        for rid, served in left:
            self._outbox.put(Left(rid, served, now))
        hand_over(items)

    def _exited(self, ex: Exited) -> None:
        if not self._stopping.is_set():
            self._outbox.put(ex)

    # ---- the supervisor thread: the only one that changes state ----

    def _supervise(self) -> None:
        """The supervisor's loop; an unexpected exception in it gives up rather than leaving requests waiting."""
        try:
            while self._handle(self._outbox.get()):
                pass
        except Exception as e:  # noqa: BLE001 - a bug here: nobody else would restart the engine
            log.exception("the engine supervisor failed")
            self._give_up(f"the engine supervisor failed: {e!r}")

    def _handle(self, ev: Event) -> bool:
        """One event; False once the supervisor is done (given up or stopped)."""
        if isinstance(ev, Exited):
            self._on_exit(ev)
            return self._restart(ev.why)
        if isinstance(ev, Shutdown):
            self._stop()
            return False
        if isinstance(ev, TrialOver) and self.state == State.TRYING and self.trials.current is None:
            self._next_trial()  # else stale: a restart started another trial since it was posted
        elif isinstance(ev, Added):
            self._add(ev.rid)
        elif isinstance(ev, Left):
            self._left(ev.rid, ev.served, ev.at)
            if ev.abort:
                self._link.send(Abort(ev.rid))
        elif isinstance(ev, RankLost):
            self._kill(ev.pid)
        elif isinstance(ev, StatsAsked):
            ev.send(AskStats(ev.ask))
        return True

    def _move(self, to: State, by: str) -> None:
        if not any(m == by and self.state in src and to in dst for src, _, m, dst in TRANSITIONS):
            raise RuntimeError(f"no transition {self.state} -> {to} by {by}")
        self.state = to

    def _on_exit(self, ex: Exited) -> None:
        """-> RESTARTING: judge the exit (supervisor.py) and convict a request that crashed the engine alone on
        its trial; every other request stays, for the next engine process."""
        with self._lock:
            self._move(State.RESTARTING, "_on_exit")
        code = reap(ex, self._killed)
        lost = rank_lost(ex.failed, lambda: ranks_ended(self._workers, RANK_GRACE_S))
        by_itself = died_by_itself(code, ex.proc.pid in self._killed, lost, raised=ex.failed is not None)
        now = time.monotonic()
        with self._lock:
            step = [rid for rid in ex.in_step if rid in self._streams]
            culprit = judge(self.trials, self.exits, step, by_itself, now)
            guilty = self._streams.pop(culprit) if culprit else None
            for s in self._streams.values():
                s.on_engine = False
        if guilty is not None:
            self.counts.add("quarantined", 1)
            hand_over([(guilty, RequestQuarantined.convicted(exit_status(code)))])
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
                self._stop()
                return False
            end_workers(self._workers)
            try:
                new = launch(self.spec, self.decode, self.engine, self.startup_timeout_s)
                break
            except Exception as e:  # noqa: BLE001 - EngineDead, or the start itself failed: a counted exit
                why = str(e)
                self.exits.add(time.monotonic())
                log.error("engine process restart failed: %s", why)
        self._attach(new)  # a shutdown meanwhile: its event, next in the inbox, stops the new process
        self.counts.add("restarts", 1)
        self._next_trial()
        return True

    def _next_trial(self) -> None:
        """-> TRYING with the next suspect group alone, or SERVING with every request that is not on the engine
        process yet (oldest first). Requests whose output already ended finish here."""
        with self._lock:
            while (group := self.trials.start()) is not None and not group & self._streams.keys():
                pass
            todo = [s for rid, s in self._streams.items() if rid in group] if group else \
                [s for s in self._streams.values() if not s.on_engine]
            self._move(State.TRYING if group else State.SERVING, "_next_trial")
            self.counts.trials += bool(group)
            ops, ended = readmit(self._streams, todo, self._link.limits.max_length)
            self.counts.readmitted += len(ops)
            self.counts.resumed += sum(op.resumed is not None for _, op in ops)
        for s, _ in ended:
            self._left(s.add.request_id, True, time.monotonic())
        hand_over(ended)
        for _, op in ops:
            self._link.send(op)
        if group:
            log.warning("trying %d suspect request(s) alone: %s", len(group), sorted(group))

    def _add(self, rid: str) -> None:
        """SERVING sends a request as it is added; else it waits for `_next_trial`."""
        with self._lock:
            s = self._streams.get(rid) if self.state == State.SERVING else None
            if s is None or s.on_engine:  # it left already, or went with a restart
                return
            s.on_engine = True
        self._link.send(s.add)

    def _left(self, rid: str, served: bool, at: float) -> None:
        """The trials forget a request that left; one that ends a trial lets the next group go."""
        if served:
            self.exits.served_at = max(self.exits.served_at, at)
        self.trials.forget(rid)
        if self.trials.cleared(rid):
            self._outbox.put(TrialOver())

    def _kill(self, pid: int) -> None:
        """A dead tensor-parallel rank takes its engine process down, so that every rank is restarted."""
        if pid == self._link.proc.pid and self.state in (State.SERVING, State.TRYING):
            log.error("a tensor-parallel rank exited; stopping its engine process to restart every rank")
            self._killed.add(pid)
            self._link.proc.kill()

    def _give_up(self, reason: str) -> None:
        """-> FAILED: every request gets EngineDead (a retryable 503); the health check fails."""
        log.error("%s; giving up: this replica now fails its health check so that Serve replaces it", reason)
        end_workers(self._workers)
        self._fail_all(EngineDead(f"engine process gave up: {reason}"), State.FAILED, "_give_up")

    def _stop(self) -> None:
        """-> STOPPED: the replica is shutting down (its engine process is told to stop)."""
        self._link.send(Stop())
        self._fail_all(EngineDead("the replica is shutting down"), State.STOPPED, "_stop")

    def _fail_all(self, e: BaseException, state: State, by: str) -> None:
        with self._lock:
            self._move(state, by)
            self._error = e
            streams, self._streams = list(self._streams.values()), {}
        hand_over([(s, e) for s in streams])
