"""Engine host: rank 0 of a decoder replica, the handlers' side of its supervisor (actors/replica_supervisor.py,
where every state and transition is). Handlers (asyncio) register a request (`generate`) and wait on its stream;
they, the health check and shutdown change no supervision state: they post events to the supervisor's inbox."""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from actors.launch import ranks_ended
from actors.messages import Add, EngineDead
from actors.replica_supervisor import ReplicaSupervisor, State
from actors.streams import Added, Left, RankLost, Shutdown, StatsAsked, Stream
from actors.trace import Trace
from mbd.config import DecodeConfig
from mbd.decoding.constraint_spec import ConstraintSpec
from mbd.decoding.outputs import StepOutput
from mbd.decoding.validate import EngineLimits

HEALTH = {State.SERVING: "ok", State.TRYING: "ok", State.RESTARTING: "restarting", State.FAILED: "failed",
          State.STOPPED: "failed"}
SHUTDOWN_S = 10.0  # how long shutdown waits for the engine process to stop (then kills it), and for the supervisor


class EngineHost(ReplicaSupervisor):
    def __init__(self, *args: Any, **kwargs: Any):
        """As `ReplicaSupervisor` (it starts the engine process)."""
        self.trace = Trace("decoder")
        super().__init__(*args, **kwargs)

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
        with self._lock:  # registered under the lock `_fail_all` takes: failed by it, or after it refused here
            if self.state in (State.FAILED, State.STOPPED):
                raise EngineDead(f"engine loop is not running: {self._error}")
            if rid in self._streams:
                raise ValueError(f"request id {rid} is already live")
            self._streams[rid] = s
        self._outbox.put(Added(rid))
        finished = False
        try:
            async for out in s.outputs():
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._abort(s)

    @property
    def _proc(self) -> subprocess.Popen:
        """The current engine process (tests kill it)."""
        return self._link.proc

    def _abort(self, s: Stream) -> None:
        rid = s.add.request_id
        with self._lock:  # the supervisor sets `on_engine` under it too
            if self._streams.get(rid) is not s:
                return
            del self._streams[rid]
            self.counts.aborted += 1
            on_engine = s.on_engine
        self._outbox.put(Left(rid, False, time.monotonic(), abort=on_engine))

    # ---- what the replica answers ----

    def check(self) -> None:
        """Serve's health check: raise once the host gave up (or its reader or supervisor thread died). A dead
        tensor-parallel rank takes its engine process down, so that the supervisor restarts every rank."""
        if self.state == State.FAILED:
            raise EngineDead(f"engine loop is not running: {self._error}")
        if not self._supervisor.is_alive() and not self._stopping.is_set():
            raise EngineDead("the engine's supervisor thread has stopped")
        link, live = self._link, self.state in (State.SERVING, State.TRYING)
        if live and not link.reader.is_alive() and not link.ended:
            raise EngineDead("the engine's reader thread has stopped")
        if live and ranks_ended(self._workers, 0):
            self._outbox.put(RankLost(link.proc.pid))

    def engine_state(self) -> str:
        """"ok" (serving, or trying suspects while others wait), "restarting" or "failed"."""
        return HEALTH[self.state]

    def limits(self) -> EngineLimits:
        """What this replica's engine can serve (the ingress checks requests against it before routing them)."""
        return self._link.limits

    def stats(self) -> dict[str, float]:
        """A snapshot for operators and tests: open streams, the supervision counts, and the engine's stats (asked
        of the engine process, as of its last step; absent while it restarts)."""
        c = self.counts
        base = {"streams": len(self._streams), "aborted": c.aborted, "generated": c.generated,
                "discarded": c.discarded, "engine_restarts": c.restarts,
                "readmitted": c.readmitted, "resumed": c.resumed, "quarantined": c.quarantined, "trials": c.trials}
        if self.state not in (State.SERVING, State.TRYING):
            return base
        return base | self._link.stats(lambda send, ask: self._outbox.put(StatsAsked(send, ask)))

    def shutdown(self) -> None:
        """Stop the engine process (and with it the TP ranks' loops); kill it if it does not stop in time."""
        self._stopping.set()
        self._outbox.put(Shutdown())
        link = self._link
        try:
            link.proc.wait(timeout=SHUTDOWN_S)
        except subprocess.TimeoutExpired:
            link.proc.kill()
            link.proc.wait()
        self._supervisor.join(timeout=SHUTDOWN_S)
        link.reader.join(timeout=5)
