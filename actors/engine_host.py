"""Engine host: rank 0 of a decoder replica, bridging asyncio request handlers and the engine process, which it
supervises.

The engine loop runs in a process of its own (actors/engine_process.py), so the replica's request handling never
competes with it for the interpreter lock; the replica talks to it through one connection. Handlers send each
request there; a reader thread receives each step's outputs and hands a request's `StepOutput`s to its
handler's asyncio.Queue, one thread-safe call per event loop per step. The request was checked where it entered
(the ingress) and is checked again where it is served (the engine); the host forwards it unchanged. With
tensor_parallel_size > 1 the host starts ranks 1.. as `TPWorker` actors in the other bundles of the replica's
placement group; the engine process leads them through `Lockstep` (see actors/tp_worker.py).

Supervision: an engine process can die while its replica is healthy (a CUDA error, an out-of-memory kill, a bug on
a rare request), and replacing the whole replica would repeat the model load and warm-up. So when the engine
process exits the reader thread logs its exit status, fails the streams that had produced output (their clients
get a clean error event), keeps every other request, starts a new engine process (and TP ranks) with the same
configuration and re-admits the kept requests in their order. Meanwhile the host is "restarting": requests that
arrive wait with the kept ones (Serve's max_ongoing_requests bounds them; beyond, its queue, then 503 with
Retry-After). A crash loop stops: the k-th exit within `EngineRestarts.window_s` is restarted after a back-off,
up to `limit` restarts; then the host is "failed", its health check fails and Serve replaces the replica.
vLLM's V1 server treats a dead engine core as fatal and leaves the restart to its orchestrator; here the replica
owns the engine process, so it restarts it itself.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import AsyncIterator, Callable, Sequence

import ray
from pydantic import Field
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors import engine_process
from actors.tp_worker import Op, TPWorker, free_port
from actors.trace import Trace
from mbd.config import DecodeConfig, EngineConfig, StrictModel
from mbd.decoding.constraints import ConstraintSpec
from mbd.decoding.outputs import StepOutput
from mbd.decoding.spec import ModelSpec
from mbd.decoding.validate import EngineLimits, RequestError

log = logging.getLogger("ray.serve")
STATS_TIMEOUT_S = 10.0  # how long `stats()` waits for the engine process (at most a step)
OK, RESTARTING, FAILED = "ok", "restarting", "failed"  # the host's states (`state`)


class EngineDead(RuntimeError):
    """The engine process is gone for this request: it exited mid-stream, or the replica gave up restarting it
    (then check_health fails and Serve replaces the replica)."""


class RequestQuarantined(RuntimeError):
    """The request was in the engine process at each of its last exits: it is not run again (it may be what kills
    the engine: re-admitting it, or retrying it on another replica, would take that one down as well)."""


class EngineRestarts(StrictModel):
    """How a replica restarts its engine process when it exits: the k-th exit within `window_s` is restarted after
    `delay(k)` (the first at once, then backoff_s, 2 x backoff_s, ...), at most `limit` times; one more exit in the
    window and the replica gives up (a crash loop stops)."""

    limit: int = Field(default=3, ge=0, description="restarts within window_s; 0: an engine exit is fatal")
    window_s: float = Field(default=60.0, gt=0, description="exits older than this no longer count")
    backoff_s: float = Field(default=1.0, ge=0, description="back-off before the second restart in the window")
    quarantine_after: int = Field(default=2, ge=1, description=(
        "a request that no output had left yet and that was in the engine process at this many of its exits is "
        "failed (HTTP 500, not retried) instead of re-admitted: one poisonous request cannot crash-loop replicas"))

    def delay(self, k: int) -> float:
        """Seconds to wait before the k-th restart in the window (k >= 1)."""
        return 0.0 if k <= 1 else self.backoff_s * 2 ** (k - 2)


@dataclass
class _Stream:
    """One request: what re-admits it to a new engine process, and its way back to its handler. With
    per_block=False the reader thread merges its outputs and hands over only the finished whole, so a
    non-streaming request costs its event loop one wake-up."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    add: Op  # ("add", request_id, prompt_ids, DecodeConfig, ConstraintSpec | None), sent again after a restart
    per_block: bool = True
    held: StepOutput | None = None  # merged outputs not yet handed over (per_block=False)
    sent: bool = False  # the current engine process has (or is being sent) its add
    produced: bool = False  # its handler got output: an engine exit fails it instead of re-running it
    exits: int = 0  # engine process exits it was sent to and kept through (`EngineRestarts.quarantine_after`)


def _hand_over(items: list[tuple[_Stream, "StepOutput | BaseException"]]) -> None:
    """Deliver a step's items to their handlers with one thread-safe call per event loop (each call wakes the
    loop); a closed loop (replica shutting down) drops them."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for s, item in items:
        by_loop.setdefault(s.loop, []).append((s.queue, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:
            pass


def _put_all(batch: list[tuple[asyncio.Queue, "StepOutput | BaseException"]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


def exit_status(code: int | None) -> str:
    """A process's exit status in words: 'exit code 1', 'killed by SIGKILL'."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class EngineHost:
    def __init__(self, spec: ModelSpec, decode: DecodeConfig, engine: EngineConfig,
                 restarts: EngineRestarts = EngineRestarts(), on_step: Callable[[dict[str, float]], None] | None = None,
                 startup_timeout_s: float = 600.0):
        """on_step: called from the reader thread with the engine's stats (`engine_process.engine_stats`) after
        steps, at most every `engine_process.ON_STEP_S`. A first engine process that does not start raises
        EngineDead (the replica fails to start; Serve retries it)."""
        self.spec, self.decode, self.engine, self.restarts = spec, decode, engine, restarts
        self.startup_timeout_s = startup_timeout_s
        self._on_step = on_step
        self._streams: dict[str, _Stream] = {}  # in arrival order: kept requests are re-admitted in it
        self._lock = threading.Lock()  # the streams, the state and the current connection
        self._send_lock = threading.Lock()  # sends on a connection (never held by the reader: no deadlock when
        # both directions' socket buffers are full, the reader keeps draining)
        self._stats_lock = threading.Lock()  # one stats question at a time
        self._asks: queue.SimpleQueue[dict[str, float]] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._exits: collections.deque[float] = collections.deque()  # when the engine process exited, in the window
        self._error: BaseException | None = None  # why the host gave up (state FAILED)
        self._epoch = 0  # engine exits handled so far: a re-admission stops once a newer exit takes over
        self.state = OK
        self.num_aborted = 0
        self.num_restarts = 0
        self.num_kept = 0  # requests without output yet when their engine process exited: kept for the next one
        self.num_readmitted = 0  # requests sent to a new engine process (kept ones and those that arrived meanwhile)
        self.num_lost = 0  # streams that had produced output when their engine process exited: failed
        self.num_quarantined = 0  # requests failed as suspects (`EngineRestarts.quarantine_after`)
        self.trace = Trace("decoder")
        self._workers: list[tuple[object, ray.ObjectRef]] = []
        self._proc, self._conn, self._limits = self._launch()
        self._start_reader()

    # ---- the engine process (and TP ranks): start, read, supervise ----

    def _launch(self) -> tuple[subprocess.Popen, Connection, EngineLimits]:
        """Start the engine process and, with tensor_parallel_size > 1, ranks 1.. (any earlier ones are ended
        first); wait for its limits. Raises EngineDead if it does not come up."""
        for actor, _ in self._workers:
            ray.kill(actor, no_restart=True)
        world = self.spec.tensor_parallel_size
        addr, port = (ray.util.get_node_ip_address(), free_port("")) if world > 1 else ("", 0)
        self._workers = [self._start_worker(r, addr, port) for r in range(1, world)]
        proc, conn = engine_process.start(self.spec, self.decode, self.engine, addr, port)
        first = self._recv(conn) if conn.poll(self.startup_timeout_s) else ("error", "no answer within "
                                                                            f"{self.startup_timeout_s:.0f}s")
        if first[0] == "ready":
            return proc, conn, first[1]
        conn.close()
        try:
            proc.wait(timeout=10)  # it exits after reporting its error
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise EngineDead(f"engine failed to start ({exit_status(proc.returncode)}): "
                         f"{first[1] if first[0] == 'error' else first!r}")

    def _start_worker(self, rank: int, addr: str, port: int) -> tuple[object, ray.ObjectRef]:
        pg = ray.util.get_current_placement_group()
        if pg is None:
            raise EngineDead("tensor_parallel_size > 1 needs a placement group (Serve placement_group_bundles)")
        actor = TPWorker.options(
            num_cpus=self.spec.num_cpus_per_rank, num_gpus=self.spec.num_gpus_per_rank,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
        ).remote()
        return actor, actor.run.remote(self.spec, self.decode, self.engine, rank, addr, port)

    def _start_reader(self) -> threading.Thread:
        t = threading.Thread(target=self._read, args=(self._proc, self._conn), name="mbd-engine-reader", daemon=True)
        self._reader = t  # before it runs: its own restart may replace it
        t.start()
        return t

    @staticmethod
    def _recv(conn: Connection) -> tuple:
        try:
            return conn.recv()
        except (EOFError, OSError) as e:
            return ("error", f"connection closed ({type(e).__name__})")

    def _read(self, proc: subprocess.Popen, conn: Connection) -> None:
        """The reader thread of one engine process: its messages until it ends, then its supervision."""
        while True:
            msg = self._recv(conn)
            if msg[0] == "step":
                _, outs, refused, stats = msg
                for rid, e in refused:
                    self._fail(rid, RequestError(e.field, f"request refused by the engine: {e}", e.code))
                self._publish(outs)
                if stats is not None and self._on_step is not None:
                    self._on_step(stats)
            elif msg[0] == "stats":
                self._asks.put(msg[1])
            else:  # ("error", message): the engine process has ended
                break
        with self._send_lock:  # no send is under way on it (its file descriptor may be reused once closed)
            conn.close()
        self._asks.put({})  # a stats question it will never answer
        if self._stopping.is_set():
            proc.wait()
            self._fail_all(EngineDead("the replica is shutting down"))
            return
        self._engine_exited(proc, msg[1])

    def _engine_exited(self, proc: subprocess.Popen, why: str) -> None:
        """Log the exit, fail the streams that had produced output, keep the others, restart (or give up)."""
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # its connection broke but it lives on: it cannot serve
            proc.kill()
            code = proc.wait()
        with self._lock:
            self.state = RESTARTING
            self._epoch += 1
            epoch = self._epoch
            for s in self._streams.values():
                s.exits += s.sent
            lost = [(s, EngineDead(f"the engine process exited mid-stream ({exit_status(code)})"))
                    for s in self._streams.values() if s.produced]
            limit = self.restarts.quarantine_after
            suspects = [(s, RequestQuarantined(f"the engine process exited {s.exits} times while this request was "
                                               f"in it (last: {exit_status(code)}); it is not run again"))
                        for s in self._streams.values() if not s.produced and s.exits >= limit]
            self._streams = {rid: s for rid, s in self._streams.items() if not s.produced and s.exits < limit}
            for s in self._streams.values():
                s.sent, s.held = False, None
            kept = len(self._streams)
            self.num_kept += kept
            self.num_lost += len(lost)
            self.num_quarantined += len(suspects)
        _hand_over(lost + suspects)
        log.error("engine process %d exited (%s; %s): %d stream(s) that had produced output failed, %d request(s) "
                  "quarantined (in it at %d exits), %d request(s) kept for a new engine process", proc.pid,
                  exit_status(code), why, len(lost), len(suspects), limit, kept)
        self._restart(why, epoch)

    def _restart(self, why: str, epoch: int) -> None:
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
                return self._give_up(f"the engine process exited {k} times within {self.restarts.window_s:.0f} s "
                                     f"(last: {why})")
            if self._stopping.wait(self.restarts.delay(k)):
                return self._fail_all(EngineDead("the replica is shutting down"))
            try:
                proc, conn, _ = self._launch()
                break
            except Exception as e:  # noqa: BLE001 - EngineDead, or the start itself failed: one more exit
                why = str(e)
                log.error("engine process restart %d of %d failed: %s", k, self.restarts.limit, why)
        if self._stopping.is_set():  # the replica began shutting down while it started
            self._send(("stop",), conn)
            proc.wait()
            return self._fail_all(EngineDead("the replica is shutting down"))
        with self._lock:
            self._proc, self._conn = proc, conn
            self.num_restarts += 1
        self._start_reader()
        n = self._readmit(conn, epoch)
        log.warning("engine process restarted (pid %d) %.1f s after the exit; %d request(s) re-admitted in order "
                    "(the kept ones, then those that arrived meanwhile)", proc.pid, time.monotonic() - t0, n)

    def _readmit(self, conn: Connection, epoch: int) -> int:
        """Send every request not yet sent to the new engine process, oldest first, until none is left; then OK
        (requests that arrive from then on are sent by their handlers). No lock is held while sending. If that
        process exits meanwhile, its own reader takes over (a newer epoch) and this stops."""
        n = 0
        while True:
            with self._lock:
                if self._epoch != epoch:
                    return n
                todo = [s for s in self._streams.values() if not s.sent]
                for s in todo:
                    s.sent = True
                if not todo:
                    self.state = OK
                    return n
            for s in todo:
                self._send(s.add, conn)
            n += len(todo)
            with self._lock:
                self.num_readmitted += len(todo)
                gone = [s.add[1] for s in todo if s.add[1] not in self._streams]
            for rid in gone:  # left while its add was on the way: abort it behind the add
                self._send(("abort", rid), conn)

    def _give_up(self, reason: str) -> None:
        log.error("%s; giving up: this replica now fails its health check so that Serve replaces it", reason)
        for actor, _ in self._workers:
            ray.kill(actor, no_restart=True)
        self._fail_all(EngineDead(f"engine process gave up: {reason}"))

    # ---- reader side: outputs to handlers ----

    def _publish(self, outs: Sequence[StepOutput]) -> None:
        items = []
        for o in outs:
            if not (o.new_token_ids or o.finished or o.provisional):
                continue
            with self._lock:
                s = self._streams.pop(o.request_id, None) if o.finished else self._streams.get(o.request_id)
                if s is not None and (s.per_block or o.finished):
                    s.produced = True
            if s is None:
                continue
            if not s.per_block:
                o = s.held.merge(o) if s.held is not None else o
                if not o.finished:
                    s.held = o
                    continue
            items.append((s, o))
        _hand_over(items)

    def _fail(self, rid: str, e: BaseException) -> None:
        with self._lock:
            s = self._streams.pop(rid, None)
        if s is not None:
            _hand_over([(s, e)])

    def _fail_all(self, e: BaseException) -> None:
        with self._lock:
            self.state, self._error = FAILED, e
            streams, self._streams = list(self._streams.values()), {}
        _hand_over([(s, e) for s in streams])

    def _send(self, op: Op, conn: Connection | None = None) -> bool:
        """One op to an engine process (default: the current one); False if it is gone (its reader restarts it
        and re-admits what it had not finished)."""
        try:
            with self._send_lock:
                (conn or self._conn).send(op)
            return True
        except OSError:
            return False

    # ---- event-loop side ----

    def check(self) -> None:
        """Serve's health check: raise once the host gave up (or its reader died). A dead tensor-parallel rank
        takes its engine process down, so that the supervisor restarts every rank."""
        if self.state == FAILED:
            raise EngineDead(f"engine loop is not running: {self._error}")
        if self.state == OK and not self._reader.is_alive():
            raise EngineDead("the engine's reader thread has stopped")
        if self._workers and self.state == OK:
            done, _ = ray.wait([ref for _, ref in self._workers], num_returns=len(self._workers), timeout=0)
            if done:
                log.error("a tensor-parallel rank exited; stopping its engine process to restart every rank")
                self._proc.kill()

    def engine_state(self) -> str:
        """"ok", "restarting" (a new engine process is starting; requests wait for it) or "failed"."""
        return self.state

    def limits(self) -> EngineLimits:
        """What this replica's engine can serve (the ingress checks requests against it before routing them)."""
        return self._limits

    def stats(self) -> dict[str, float]:
        """A snapshot for operators and tests: open streams, aborted requests, engine restarts with the requests
        they re-admitted and the streams they failed, and the engine's stats (asked of the engine process, as of
        its last step; absent while it restarts)."""
        base = {"streams": len(self._streams), "aborted": self.num_aborted, "engine_restarts": self.num_restarts,
                "kept": self.num_kept, "readmitted": self.num_readmitted, "lost_mid_stream": self.num_lost,
                "quarantined": self.num_quarantined}
        with self._stats_lock:
            while not self._asks.empty():  # answers meant for an earlier question (or a dead engine's)
                self._asks.get_nowait()
            if self.state != OK or not self._send(("stats",)):
                return base
            try:
                return base | self._asks.get(timeout=STATS_TIMEOUT_S)
            except queue.Empty:
                return base

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
        add = ("add", rid, prompt_ids, params, constraint)
        s = _Stream(asyncio.get_running_loop(), asyncio.Queue(), add, per_block)
        with self._lock:  # registered under the lock the supervisor takes: sent now, or re-admitted by it
            if self.state == FAILED:
                raise EngineDead(f"engine loop is not running: {self._error}")
            if rid in self._streams:
                raise ValueError(f"request id {rid} is already live")
            self._streams[rid] = s
            s.sent = self.state == OK
            conn = self._conn
        finished = False
        try:
            if s.sent:
                self._send(s.add, conn)  # if that engine process is gone, its supervisor re-admits the request
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
                yield out
        finally:
            if not finished:
                self._abort(rid)

    def _abort(self, rid: str) -> None:
        with self._lock:
            s = self._streams.pop(rid, None)
            conn = self._conn
        if s is not None:
            self.num_aborted += 1
            if s.sent:
                self._send(("abort", rid), conn)

    def shutdown(self) -> None:
        """Stop the engine process (and with it the TP ranks' loops); kill it if it does not stop in time."""
        self._stopping.set()
        with self._lock:
            proc = self._proc
        self._send(("stop",))
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._reader.join(timeout=5)
