"""Engine host: rank 0 of a decoder replica, bridging asyncio request handlers and the engine process.

The engine loop runs in a process of its own (actors/engine_process.py), so the replica's request handling never
competes with it for the interpreter lock; the replica talks to it through one connection. Handlers send each
request there; a reader thread receives each step's outputs and hands a request's `StepOutput`s to its
handler's asyncio.Queue, one thread-safe call per event loop per step. The request was checked where it entered
(the ingress) and is checked again where it is served (the engine); the host forwards it unchanged. With
tensor_parallel_size > 1 the host starts ranks 1.. as `TPWorker` actors in the other bundles of the replica's
placement group; the engine process leads them through `Lockstep` (see actors/tp_worker.py).
"""

from __future__ import annotations

import asyncio
import queue
import subprocess
import threading
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors import engine_process
from actors.tp_worker import Op, TPWorker, free_port
from actors.trace import Trace
from mbd.config import DecodeConfig, EngineConfig
from mbd.decoding.constraints import ConstraintSpec
from mbd.decoding.outputs import StepOutput
from mbd.decoding.spec import ModelSpec
from mbd.decoding.validate import EngineLimits, RequestError

STATS_TIMEOUT_S = 10.0  # how long `stats()` waits for the engine process (at most a step)


class EngineDead(RuntimeError):
    """The engine loop stopped; the replica must be replaced (check_health fails)."""


@dataclass
class _Stream:
    """One request's way back to its handler. With per_block=False the reader thread merges its outputs and
    hands over only the finished whole, so a non-streaming request costs its event loop one wake-up."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    per_block: bool = True
    held: StepOutput | None = None  # merged outputs not yet handed over (per_block=False)


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


class EngineHost:
    def __init__(self, spec: ModelSpec, decode: DecodeConfig, engine: EngineConfig,
                 on_step: Callable[[dict[str, float]], None] | None = None, startup_timeout_s: float = 600.0):
        """on_step: called from the reader thread with the engine's stats (`engine_process.engine_stats`) after
        steps, at most every `engine_process.ON_STEP_S`."""
        self.spec = spec
        self.decode = decode
        self.engine = engine
        self._on_step = on_step
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # the streams (the event loop and the reader thread)
        self._send_lock = threading.Lock()  # sends on the connection (never held by the reader: no deadlock when
        # both directions' socket buffers are full, the reader keeps draining)
        self._error: BaseException | None = None
        self._asks: queue.SimpleQueue[dict[str, float]] = queue.SimpleQueue()
        self.num_aborted = 0
        self.trace = Trace("decoder")
        world = spec.tensor_parallel_size
        addr, port = (ray.util.get_node_ip_address(), free_port("")) if world > 1 else ("", 0)
        self._workers = [self._start_worker(r, addr, port) for r in range(1, world)]
        self._proc, self._conn = engine_process.start(spec, decode, engine, addr, port)
        if not self._conn.poll(startup_timeout_s):
            self._proc.kill()
            raise EngineDead(f"engine did not start within {startup_timeout_s:.0f}s")
        first = self._recv()
        if first[0] != "ready":
            raise EngineDead(f"engine failed to start: {first[1] if first[0] == 'error' else first!r}")
        self._limits: EngineLimits = first[1]
        self._reader = threading.Thread(target=self._read, name="mbd-engine-reader", daemon=True)
        self._reader.start()

    def _start_worker(self, rank: int, addr: str, port: int) -> tuple[object, ray.ObjectRef]:
        pg = ray.util.get_current_placement_group()
        if pg is None:
            raise EngineDead("tensor_parallel_size > 1 needs a placement group (Serve placement_group_bundles)")
        actor = TPWorker.options(
            num_cpus=self.spec.num_cpus_per_rank, num_gpus=self.spec.num_gpus_per_rank,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
        ).remote()
        return actor, actor.run.remote(self.spec, self.decode, self.engine, rank, addr, port)

    # ---- reader thread: the engine process's messages ----

    def _recv(self) -> tuple:
        try:
            return self._conn.recv()
        except (EOFError, OSError) as e:
            return ("error", f"engine process exited ({e!r}, exit code {self._proc.poll()})")

    def _read(self) -> None:
        while True:
            msg = self._recv()
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
                self._fail_all(EngineDead(f"engine loop failed: {msg[1]}"))
                return

    def _publish(self, outs: Sequence[StepOutput]) -> None:
        items = []
        for o in outs:
            if not (o.new_token_ids or o.finished or o.provisional):
                continue
            with self._lock:
                s = self._streams.pop(o.request_id, None) if o.finished else self._streams.get(o.request_id)
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
            self._error = e
            streams, self._streams = list(self._streams.values()), {}
        self._asks.put({})
        _hand_over([(s, e) for s in streams])

    def _send(self, op: Op) -> None:
        """One op to the engine process (the event loop and other threads send)."""
        if self._error is not None:
            raise EngineDead(f"engine loop is not running: {self._error}")
        try:
            with self._send_lock:
                self._conn.send(op)
        except OSError as e:
            raise EngineDead(f"engine process unreachable: {e!r}") from e

    # ---- event-loop side ----

    def check(self) -> None:
        """Raise if this replica can no longer serve (engine process or a TP rank gone)."""
        if self._error is not None or self._proc.poll() is not None:
            raise EngineDead(f"engine loop is not running: {self._error or f'exit code {self._proc.poll()}'}")
        if self._workers:
            done, _ = ray.wait([ref for _, ref in self._workers], num_returns=len(self._workers), timeout=0)
            if done:
                raise EngineDead(f"tensor-parallel rank exited: {ray.get(done[0])!r}")

    def limits(self) -> EngineLimits:
        """What this replica's engine can serve (the ingress checks requests against it before routing them)."""
        return self._limits

    def stats(self) -> dict[str, float]:
        """A snapshot for operators and tests: open streams, aborted requests, and the engine's stats (asked of
        the engine process, as of its last step)."""
        base = {"streams": len(self._streams), "aborted": self.num_aborted}
        try:
            self._send(("stats",))
            return base | self._asks.get(timeout=STATS_TIMEOUT_S)
        except (EngineDead, queue.Empty):
            return base

    async def generate(self, prompt_ids: list[int], params: DecodeConfig, per_block: bool = True,
                       rid: str | None = None, constraint: ConstraintSpec | None = None
                       ) -> AsyncIterator[StepOutput]:
        """Yield what the engine committed since the last yield, merged, until the request finishes
        (per_block=False: one StepOutput, the whole generation); leaving early (client gone) aborts it in the
        engine. rid: the request's id in the engine (unique among its live requests; default a fresh uuid).
        The engine checks the request when it admits it; a refusal raises RequestError naming the field."""
        rid = rid or uuid.uuid4().hex
        self.trace.mark(rid, "arrive")
        s = _Stream(asyncio.get_running_loop(), asyncio.Queue(), per_block)
        with self._lock:  # registered under the lock that _fail_all takes: no request can slip past a dying loop
            self.check()
            if rid in self._streams:
                raise ValueError(f"request id {rid} is already live")
            self._streams[rid] = s
        finished = False
        try:
            self._send(("add", rid, prompt_ids, params, constraint))
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
            live = self._streams.pop(rid, None) is not None
        if live:
            self.num_aborted += 1
            try:
                self._send(("abort", rid))
            except EngineDead:
                pass

    def shutdown(self) -> None:
        """Stop the engine process (and with it the TP ranks' loops); kill it if it does not stop in time."""
        try:
            self._send(("stop",))
        except EngineDead:
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=5)
        self._conn.close()
