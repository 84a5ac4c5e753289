"""Engine host: rank 0 of a decoder replica, what Serve calls. It holds the replica's supervisor
(actors/replica_supervisor.py, where every state and transition is) and changes no supervision state: handlers
(asyncio) register a request (`generate`) and wait on its stream; the health check, stats and shutdown read the
supervisor's public state and post events to its inbox."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import AsyncIterator
from typing import Any

from actors.launch import ranks_ended
from actors.messages import Add, EngineDead
from actors.replica_supervisor import ReplicaSupervisor, State
from actors.streams import RankLost, StatsAsked, Stream
from actors.trace import Trace
from mbd.decoding.constraint_spec import ConstraintSpec
from mbd.decoding.outputs import StepOutput
from mbd.decoding.validate import EngineLimits, RequestParams

HEALTH = {State.SERVING: "ok", State.TRYING: "ok", State.RESTARTING: "restarting", State.FAILED: "failed",
          State.STOPPED: "failed"}
SHUTDOWN_S = 10.0  # how long shutdown waits for the engine process to stop (then kills it), and for the supervisor


class EngineHost:
    def __init__(self, *args: Any, **kwargs: Any):
        """As `ReplicaSupervisor` (it starts the engine process)."""
        self.trace = Trace("decoder")
        self.supervisor = ReplicaSupervisor(*args, **kwargs)

    async def generate(self, prompt_ids: list[int], params: RequestParams, per_block: bool = True,
                       rid: str | None = None, constraint: ConstraintSpec | None = None
                       ) -> AsyncIterator[StepOutput]:
        """Yield what the engine committed since the last yield, merged, until the request finishes
        (per_block=False: one StepOutput, the whole generation); leaving early (client gone) aborts it. The
        request was checked against `limits()` (`mbd.decoding.validate.validate_request`, at the ingress) and is
        not checked again; a constraint the engine cannot compile raises RequestError naming the field. While the
        engine process restarts (or suspects are tried), the request waits."""
        rid = rid or uuid.uuid4().hex
        self.trace.mark(rid, "arrive")
        s = Stream(asyncio.get_running_loop(), asyncio.Queue(), Add(rid, prompt_ids, params, constraint), per_block)
        self.supervisor.register(s)
        finished = False
        try:
            async for out in s.outputs():
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.supervisor.leave(s)

    @property
    def _proc(self) -> subprocess.Popen:
        """The current engine process (tests kill it)."""
        return self.supervisor.link.proc

    # ---- what the replica answers ----

    def check(self) -> None:
        """Serve's health check: raise once the replica gave up, or its reader or supervisor thread died. A dead
        tensor-parallel rank takes its engine process down (posted), so that the supervisor restarts every rank."""
        sup = self.supervisor
        if sup.state == State.FAILED or not sup.thread.is_alive() and not sup.stopping.is_set():
            raise EngineDead(f"engine loop is not running: {sup.error or 'its supervisor thread has stopped'}")
        link, live = sup.link, sup.state in (State.SERVING, State.TRYING)
        if live and not link.reader.is_alive() and not link.ended:
            raise EngineDead("the engine's reader thread has stopped")
        if live and ranks_ended(sup.workers, 0):
            sup.post(RankLost(link.proc.pid))

    def engine_state(self) -> str:
        """"ok" (serving, or trying suspects while others wait), "restarting" or "failed"."""
        return HEALTH[self.supervisor.state]

    def limits(self) -> EngineLimits:
        """What this replica's engine can serve (the ingress checks requests against it before routing them)."""
        return self.supervisor.link.limits

    def stats(self) -> dict[str, float]:
        """A snapshot for operators and tests: open streams, the supervision counts, and the engine's stats (asked
        of the engine process, as of its last step; absent while it restarts)."""
        sup, c = self.supervisor, self.supervisor.counts
        base = {"streams": len(sup.streams), "aborted": c.aborted, "generated": c.generated, "discarded": c.discarded,
                "engine_restarts": c.restarts, "readmitted": c.readmitted, "resumed": c.resumed,
                "quarantined": c.quarantined, "trials": c.trials}
        if sup.state not in (State.SERVING, State.TRYING):
            return base
        return base | sup.link.stats(lambda send, ask: sup.post(StatsAsked(send, ask)))

    def shutdown(self) -> None:
        """Stop the engine process (and with it the TP ranks' loops); kill it if it does not stop in time."""
        self.supervisor.stop()
        self.supervisor.link.close(SHUTDOWN_S)
        self.supervisor.thread.join(timeout=SHUTDOWN_S)
