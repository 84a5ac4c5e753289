"""A decoder replica's supervisor: every state and transition of a replica is here. It owns the engine process
(actors/engine_link.py), the streams and the state machine; the replica host (actors/engine_host.py) holds one.
Policy: actors/supervision_policy.py; streams and events: actors/streams.py. The supervisor thread drains one inbox
of typed events in order, and alone changes state and sends to the engine process; other threads (handlers, the
link's reader, health check, shutdown) post events, and share `streams` with it under `_lock`.

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
from actors.launch import Launched, end_workers, launch, relaunch
from actors.messages import Abort, AskStats, EngineDead, RequestQuarantined, Stepped, Stop
from actors.streams import Added, Counts, Event, Exited, Left, RankLost, Shutdown, StatsAsked, Stream, TrialOver, \
    hand_over, readmit, take_step
from actors.supervision_policy import EngineRestarts, ExitLog, Trials, exit_status, judge
from mbd.config import DecodeConfig, EngineConfig
from mbd.decoding.model_spec import ModelSpec

log = logging.getLogger("ray.serve")


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
        """on_step: the engine's stats after steps (reader thread); on_count: ("restarts" | "quarantined", 1) as
        they happen. A first engine process that does not start raises EngineDead (Serve retries the replica)."""
        self.spec, self.decode, self.engine, self.startup_timeout_s = spec, decode, engine, startup_timeout_s
        self._on_step = on_step
        self._lock = threading.Lock()  # the streams, and `state` against handlers registering
        self.streams: dict[str, Stream] = {}  # in arrival order: waiting requests are sent in it
        self._inbox: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.stopping, self._killed = threading.Event(), set[int]()  # killed: by us (no evidence against a step)
        self.trials, self.exits, self.counts = Trials(), ExitLog(restarts), Counts(on_count=on_count)
        self.state, self.error = State.SERVING, None
        self._attach(launch(spec, decode, engine, startup_timeout_s))
        self.thread = threading.Thread(target=self._supervise, name="mbd-engine-supervisor", daemon=True)
        self.thread.start()

    # ---- the handlers' side (any thread): streams under `_lock`, all else posted to the inbox ----

    def register(self, s: Stream) -> None:
        """Take a request; EngineDead once the replica gave up or stops (under the lock `_fail_all` takes)."""
        rid = s.add.request_id
        with self._lock:
            if self.state in (State.FAILED, State.STOPPED):
                raise EngineDead(f"engine loop is not running: {self.error}")
            if rid in self.streams:
                raise ValueError(f"request id {rid} is already live")
            self.streams[rid] = s
        self.post(Added(rid))

    def leave(self, s: Stream) -> None:
        """A request whose handler left before it finished (client gone): dropped, and aborted on the engine."""
        with self._lock:  # the supervisor sets `on_engine` under it too
            if self.streams.pop(s.add.request_id, None) is not s:
                return
            self.counts.aborted += 1
        self.post(Left(s.add.request_id, False, time.monotonic(), abort=s.on_engine))

    def post(self, ev: Event) -> None:
        self._inbox.put(ev)

    def stop(self) -> None:
        """Shutdown: the supervisor stops the engine process (the host waits for it to end)."""
        self.stopping.set()
        self.post(Shutdown())

    def _attach(self, new: Launched) -> None:
        self.link, self.workers = EngineLink(new, self._stepped, self._exited, self._on_step), new.workers

    def _stepped(self, msg: Stepped) -> None:
        with self._lock:
            items, left = take_step(self.streams, self.counts, msg)
        for rid, served in left:
            self.post(Left(rid, served, time.monotonic()))
        hand_over(items)

    def _exited(self, ex: Exited) -> None:
        if not self.stopping.is_set():
            self.post(ex)

    # ---- the supervisor thread: the only one that changes state ----

    def _supervise(self) -> None:
        """The supervisor's loop; an unexpected exception in it gives up rather than leaving requests waiting."""
        try:
            while self._handle(self._inbox.get()):
                pass
        except Exception as e:  # noqa: BLE001 - a bug here: nobody else would restart the engine
            log.exception("the engine supervisor failed")
            self._give_up(f"the engine supervisor failed: {e!r}")

    def _handle(self, ev: Event) -> bool:
        """One event; False once the supervisor is done (given up or stopped)."""
        if isinstance(ev, Exited):
            return self._on_exit(ev) and self._restart(ev.why)
        if isinstance(ev, Shutdown):
            return self._stop()
        if isinstance(ev, TrialOver) and self.state == State.TRYING and self.trials.current is None:
            self._next_trial()  # else stale: a restart started another trial since it was posted
        elif isinstance(ev, Added):
            self._add(ev.rid)
        elif isinstance(ev, Left):
            self._left(ev)
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
        """-> RESTARTING: judge the exit (supervision_policy.py), convicting a request that crashed it alone. True."""
        with self._lock:
            self._move(State.RESTARTING, "_on_exit")
        code, by_itself = reap(ex, self._killed, self.workers)
        now = time.monotonic()
        with self._lock:
            step = [rid for rid in ex.in_step if rid in self.streams]
            culprit = judge(self.trials, self.exits, step, by_itself, now)
            guilty = self.streams.pop(culprit) if culprit else None
            for s in self.streams.values():
                s.on_engine = False
        if guilty is not None:
            self.counts.add("quarantined", 1)
            hand_over([(guilty, RequestQuarantined.convicted(exit_status(code)))])
        log.error("engine process %d exited (%s; %s; %s): %s; %d suspect group(s) to try; %d request(s) kept",
                  ex.proc.pid, exit_status(code), ex.why, "by itself in a step" if by_itself else "not by itself",
                  f"request {culprit} convicted" if culprit else "nobody convicted", len(self.trials.queue),
                  len(self.streams))
        return True

    def _restart(self, why: str) -> bool:
        """RESTARTING: a new engine process (launch.py `relaunch`), or give up. False once the supervisor is done."""
        new = relaunch(self.spec, self.decode, self.engine, self.startup_timeout_s, self.exits, self.stopping,
                       self.workers, why)
        if not isinstance(new, Launched):
            return self._give_up(new) if new else self._stop()
        self._attach(new)  # a shutdown meanwhile: its event, next in the inbox, stops the new process
        self.counts.add("restarts", 1)
        self._next_trial()
        return True

    def _next_trial(self) -> None:
        """-> TRYING with the next suspect group alone, or SERVING with every request that is not on the engine
        process yet (oldest first). Requests whose output already ended finish here."""
        with self._lock:
            while (group := self.trials.start()) is not None and not group & self.streams.keys():
                pass
            todo = [s for rid, s in self.streams.items() if rid in group] if group else \
                [s for s in self.streams.values() if not s.on_engine]
            self._move(State.TRYING if group else State.SERVING, "_next_trial")
            self.counts.trials += bool(group)
            ops, ended = readmit(self.streams, todo, self.counts)
        for s, _ in ended:
            self._left(Left(s.add.request_id, True, time.monotonic()))
        hand_over(ended)
        for _, op in ops:
            self.link.send(op)
        if group:
            log.warning("trying %d suspect request(s) alone: %s", len(group), sorted(group))

    def _add(self, rid: str) -> None:
        """SERVING sends a request as it is added; else it waits for `_next_trial`."""
        with self._lock:
            s = self.streams.get(rid) if self.state == State.SERVING else None
            if s is None or s.on_engine:  # it left already, or went with a restart
                return
            s.on_engine = True
        self.link.send(s.add)

    def _left(self, ev: Left) -> None:
        """Trials forget a request that left (aborted on the engine if its client left); the last of a trial ends it."""
        if ev.abort:
            self.link.send(Abort(ev.rid))
        if ev.served:
            self.exits.served_at = max(self.exits.served_at, ev.at)
        self.trials.forget(ev.rid)
        if self.trials.cleared(ev.rid):
            self.post(TrialOver())

    def _kill(self, pid: int) -> None:
        """A dead tensor-parallel rank takes its engine process down, so that every rank is restarted."""
        if pid == self.link.proc.pid and self.state in (State.SERVING, State.TRYING):
            log.error("a tensor-parallel rank exited; stopping its engine process to restart every rank")
            self._killed.add(pid)
            self.link.proc.kill()

    def _give_up(self, reason: str) -> bool:
        """-> FAILED: every request gets EngineDead (a retryable 503); the health check fails. False."""
        log.error("%s; giving up: this replica now fails its health check so that Serve replaces it", reason)
        end_workers(self.workers)
        return self._fail_all(EngineDead(f"engine process gave up: {reason}"), State.FAILED, "_give_up")

    def _stop(self) -> bool:
        """-> STOPPED: the replica is shutting down (its engine process is told to stop). False."""
        self.link.send(Stop())
        return self._fail_all(EngineDead("the replica is shutting down"), State.STOPPED, "_stop")

    def _fail_all(self, e: BaseException, state: State, by: str) -> bool:
        with self._lock:
            self._move(state, by)
            self.error, streams, self.streams = e, list(self.streams.values()), {}
        hand_over([(s, e) for s in streams])
        return False
