"""Engine host: rank 0 of a decoder replica, bridging asyncio request handlers and the lockstep engine loop.

The engine loop runs in a background thread (torch releases the GIL in its kernels) so the replica's event
loop keeps accepting and streaming requests while it decodes. Handlers hand requests to the loop through a
thread-safe inbox; the loop sends each request's committed blocks back through that request's asyncio.Queue.
With tensor_parallel_size > 1 the host starts ranks 1.. as `TPWorker` actors in the other bundles of the
replica's placement group and leads them through `Lockstep` (see actors/tp_worker.py).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Sequence

import ray
import torch
import torch.distributed as dist
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.tp_worker import Lockstep, ModelSpec, Op, TPWorker, free_port, init_tp
from actors.trace import Trace
from mbd.config import DecodeConfig, EngineConfig
from mbd.decoding.constraints import ConstraintSpec
from mbd.decoding.engine import Engine, StepOutput
from mbd.decoding.spec import build_engine
from mbd.decoding.validate import EngineLimits

ON_STEP_S = 0.5  # metrics are refreshed at most this often (a step can take a millisecond)
IDLE_TICK_S = 1.0  # an idle rank 0 still broadcasts this often, so follower ranks never hit a collective timeout


class EngineDead(RuntimeError):
    """The engine loop stopped; the replica must be replaced (check_health fails)."""


@dataclass
class Delta:
    """What a request receives per engine step that committed tokens (or finished it)."""

    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    nfe: int = 0
    num_generated: int = 0
    logprobs: list[float] | None = None  # of token_ids, when the request asked for them
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    provisional: list[list[int]] | None = None  # the Block Buffer's not-yet-final blocks after these tokens
    top_logprobs: list[list[tuple[int, float]]] | None = None  # of token_ids: the top (id, logprob) of each

    def merge(self, later: "Delta") -> "Delta":
        lps = None if later.logprobs is None else (self.logprobs or []) + later.logprobs
        tops = None if later.top_logprobs is None else (self.top_logprobs or []) + later.top_logprobs
        return Delta(self.token_ids + later.token_ids, later.finished, later.finish_reason, later.nfe,
                     later.num_generated, lps, later.cached_tokens, later.provisional, tops)


@dataclass
class _Stream:
    """One request's way back to its handler. With per_block=False the engine thread merges its blocks and
    hands over only the finished whole, so a non-streaming request costs its event loop one wake-up."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    per_block: bool = True
    held: Delta | None = None  # merged blocks not yet handed over (per_block=False)
    committed: int = 0  # tokens committed so far


def _hand_over(items: list[tuple[_Stream, "Delta | BaseException"]]) -> None:
    """Deliver a step's items to their handlers with one thread-safe call per event loop (each call wakes the
    loop and takes the GIL from the engine thread); a closed loop (replica shutting down) drops them."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for s, item in items:
        by_loop.setdefault(s.loop, []).append((s.queue, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:
            pass


def _put_all(batch: list[tuple[asyncio.Queue, "Delta | BaseException"]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


def engine_stats(engine: Engine, in_engine: int) -> dict[str, float]:
    """Requests in the engine, free batch slots, decode steps and their wall time, the KV page pool (pages some
    request holds, pages free or cached), prefix-cache hit rate (prompt tokens served from cached pages) and
    preemptions so far."""
    s, kv = engine.stats, engine.kv
    return {"in_engine": in_engine, "free_slots": engine.num_free_rows(), "steps": s.steps, "step_s": s.step_s,
            "kv_pages_used": kv.used(), "kv_pages_free": kv.available(), "prefix_hit_rate": s.prefix_hit_rate,
            "prefix_hit_tokens": s.prefix_hit_tokens, "preemptions": s.preemptions}


class EngineHost:
    def __init__(self, spec: ModelSpec, decode: DecodeConfig, engine: EngineConfig,
                 on_step: Callable[[dict[str, float]], None] | None = None, startup_timeout_s: float = 600.0):
        """on_step: called from the engine loop with `engine_stats(...)` after steps, at most every ON_STEP_S."""
        self.spec = spec
        self.decode = decode
        self.engine = engine
        self._on_step = on_step
        self._inbox: queue.SimpleQueue[Op] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._lockstep: Lockstep | None = None
        self.num_aborted = 0
        self.trace = Trace("decoder")
        world = spec.tensor_parallel_size
        addr, port = (ray.util.get_node_ip_address(), free_port("")) if world > 1 else ("", 0)
        self._workers = [self._start_worker(r, addr, port) for r in range(1, world)]
        self._thread = threading.Thread(target=self._main, args=(addr, port), name="mbd-engine", daemon=True)
        self._thread.start()
        if not self._ready.wait(startup_timeout_s):
            raise EngineDead(f"engine did not start within {startup_timeout_s:.0f}s")
        self.check()

    def _start_worker(self, rank: int, addr: str, port: int) -> tuple[object, ray.ObjectRef]:
        pg = ray.util.get_current_placement_group()
        if pg is None:
            raise EngineDead("tensor_parallel_size > 1 needs a placement group (Serve placement_group_bundles)")
        actor = TPWorker.options(
            num_cpus=self.spec.num_cpus_per_rank, num_gpus=self.spec.num_gpus_per_rank,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
        ).remote()
        return actor, actor.run.remote(self.spec, self.decode, self.engine, rank, addr, port)

    # ---- engine thread ----

    def _main(self, addr: str, port: int) -> None:
        try:
            tp, ctrl = init_tp(self.spec, self.engine, 0, addr, port)
            with torch.inference_mode():
                engine = build_engine(self.spec.resolved_path(), self.decode, self.engine, tp)
                lock = self._lockstep = Lockstep(engine, tp.world, ctrl)
                self._ready.set()
                reported = 0.0
                while True:
                    idle = not lock.engine.has_unfinished()
                    t = time.perf_counter()
                    ops = lock.exchange(self._drain(block=idle))
                    if idle:
                        self.trace.mark("-", "idle", time.perf_counter() - t)
                    refused = dict(lock.apply(ops))
                    for rid, reason in refused.items():
                        self._fail(rid, ValueError(f"request refused by the engine: {reason}"))
                    for op in ops:
                        if op[0] == "add" and op[1] not in refused:
                            self.trace.mark(op[1], "admit")
                    if lock.stopped:
                        break
                    t = time.perf_counter()
                    outs = lock.step()
                    self.trace.mark("-", "step", time.perf_counter() - t)
                    self._publish(outs)
                    if self._on_step is not None and time.monotonic() - reported >= ON_STEP_S:
                        reported = time.monotonic()
                        self._on_step(engine_stats(lock.engine, len(lock.live)))
        except BaseException as e:  # noqa: BLE001 - any failure must reach the waiting requests and check_health
            self._fail_all(e)
        finally:
            self._ready.set()
            if dist.is_initialized():
                dist.destroy_process_group()

    def _drain(self, block: bool) -> list[Op]:
        ops = []
        try:
            ops.append(self._inbox.get(timeout=IDLE_TICK_S) if block else self._inbox.get_nowait())
            while True:
                ops.append(self._inbox.get_nowait())
        except queue.Empty:
            return ops

    def _publish(self, outs: Sequence[StepOutput]) -> None:
        items = []
        for o in outs:
            if not (o.new_token_ids or o.finished or o.provisional):
                continue
            with self._lock:
                s = self._streams.pop(o.request_id, None) if o.finished else self._streams.get(o.request_id)
            if s is None:
                continue
            s.committed += len(o.new_token_ids)
            self.trace.mark(o.request_id, "commit", s.committed)
            d = Delta(list(o.new_token_ids), o.finished, o.finish_reason, o.nfe, o.num_generated, o.new_logprobs,
                      o.cached_tokens, o.provisional, o.new_top_logprobs)
            if not s.per_block:
                d = s.held.merge(d) if s.held is not None else d
                if not o.finished:
                    s.held = d
                    continue
            items.append((s, d))
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
        _hand_over([(s, EngineDead(f"engine loop failed: {e!r}")) for s in streams])

    # ---- event-loop side ----

    def check(self) -> None:
        """Raise if this replica can no longer serve (engine thread or a TP rank died)."""
        if self._error is not None or not self._thread.is_alive():
            raise EngineDead(f"engine loop is not running: {self._error!r}")
        if self._workers:
            done, _ = ray.wait([ref for _, ref in self._workers], num_returns=len(self._workers), timeout=0)
            if done:
                raise EngineDead(f"tensor-parallel rank exited: {ray.get(done[0])!r}")

    def validate(self, prompt_ids: list[int], params: DecodeConfig, constraint: ConstraintSpec | None = None) -> None:
        """Last line of defence (the ingress checks first): the engine's one request check, plus this
        deployment's bounds on max_length and max_nfe, so nothing that could crash the engine gets in."""
        if not isinstance(params, DecodeConfig):
            raise ValueError(f"params must be a DecodeConfig, got {type(params).__name__}")
        if params.max_length > self.decode.max_length or params.max_nfe > self.decode.max_nfe:
            raise ValueError("max_length and max_nfe cannot exceed the replica's configuration")
        if self._lockstep is None:
            raise EngineDead("engine loop has not started")
        self._lockstep.engine.check_request(prompt_ids, params, constraint)

    def limits(self) -> EngineLimits:
        """What this replica's engine can serve (the ingress checks requests against it before routing them)."""
        if self._lockstep is None:
            raise EngineDead("engine loop has not started")
        return self._lockstep.engine.limits

    def stats(self) -> dict[str, float]:
        """A snapshot for operators and tests: open streams, aborted requests, and `engine_stats`."""
        lock = self._lockstep
        if lock is None:
            return {"streams": len(self._streams), "aborted": self.num_aborted}
        return {"streams": len(self._streams), "aborted": self.num_aborted} | engine_stats(lock.engine, len(lock.live))

    async def generate(self, prompt_ids: list[int], params: DecodeConfig, rid: str | None = None,
                       per_block: bool = True, constraint: ConstraintSpec | None = None) -> AsyncIterator[Delta]:
        """Yield the blocks committed since the last yield, merged, until the request finishes (per_block=False:
        one Delta, the whole generation); leaving early (client gone) aborts it in the engine.
        rid: the request's id in the engine (unique among its live requests; default a fresh uuid)."""
        rid = rid or uuid.uuid4().hex
        s = _Stream(asyncio.get_running_loop(), asyncio.Queue(), per_block)
        with self._lock:  # registered under the lock that _fail_all takes: no request can slip past a dying loop
            self.check()
            if rid in self._streams:
                raise ValueError(f"request id {rid} is already live")
            self._streams[rid] = s
        self._inbox.put(("add", rid, list(prompt_ids), params, constraint))
        finished = False
        try:
            while not finished:
                items = [await s.queue.get()]
                while not s.queue.empty():
                    items.append(s.queue.get_nowait())
                for it in items:
                    if isinstance(it, BaseException):
                        raise it
                d = items[0]
                for it in items[1:]:
                    d = d.merge(it)
                finished = d.finished
                yield d
        finally:
            if not finished:
                self._abort(rid)

    def _abort(self, rid: str) -> None:
        with self._lock:
            live = self._streams.pop(rid, None) is not None
        if live:
            self.num_aborted += 1
            self._inbox.put(("abort", rid))

    def shutdown(self) -> None:
        self._inbox.put(("stop",))
        self._thread.join(timeout=10)
