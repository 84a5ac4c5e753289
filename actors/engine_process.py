"""The engine process of a decoder replica: rank 0's lockstep engine loop, in a process of its own.

Why a process and not a thread of the replica: the engine's Python (scheduling, the policy's host bookkeeping,
publishing a step) and the replica's request handling (Serve's request path, gRPC, pickling) would share one
interpreter lock. On a model whose step is short, every request the replica handles then stalls the engine: on
the tiny model a replica with the engine in a thread served far fewer requests than the same engine called
directly, with the replica's process saturated (docs/performance.md has the measurements). In its own
process the engine steps at its own speed while the replica's Python runs beside it (vLLM V1 splits its engine
core from its API server for the same reason).

The replica (actors/engine_host.py `EngineHost`) starts `python -m actors.engine_process` (actors/launch.py) with one
end of a socket pair and talks to it through that one connection, in the messages of actors/messages.py. In:
`Start` first, then `Add`, `Abort`, `AskStats`, `Stop`. Out: `Ready` once, then `Running` before admitting requests
and before a step whose requests changed, `Stepped` after a step that has something to say, `StatsReply` when
asked, or `Failed` before exiting. The process ends on `Stop` or when the connection closes (the replica died: no
engine outlives its replica).
"""

from __future__ import annotations

import os
import sys
import time
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from actors.messages import FD_ENV, Add, AskStats, Failed, Ready, Running, Start, StatsReply, Stepped, ToEngine
from actors.tp_worker import Lockstep, init_tp
from actors.trace import Trace
from mbd.decoding.engine import Engine
from mbd.decoding.spec import build_engine

ON_STEP_S = 0.5  # stats ride along with a step's outputs at most this often (a step can take a millisecond)
IDLE_TICK_S = 1.0  # an idle rank 0 still broadcasts this often, so follower ranks never hit a collective timeout


def engine_stats(engine: Engine, in_engine: int) -> dict[str, float]:
    """Requests in the engine (those holding a batch row, those queued for one), free batch rows, decode steps
    and their wall time (of it, the grammar matchers'), decoding rows, ACTIVE and resident blocks summed over
    steps, the KV page pool (pages some request holds, pages free or cached, all pages), prefix-cache lookups
    and hits (prompt tokens), preemptions so far, and this process's pid (a restarted engine counts from 0)."""
    s, kv, sched = engine.stats, engine.kv, engine.scheduler
    return {"in_engine": in_engine, "running": len(sched.running), "waiting": len(sched.waiting),
            "free_slots": engine.num_free_rows(), "steps": s.steps, "step_s": s.step_s, "grammar_s": s.grammar_s,
            "decode_rows": s.decode_rows, "active_blocks": s.active_blocks,
            "resident_blocks": s.resident_positions // engine.block, "buffer_size": engine.n_buf,
            "kv_pages_used": kv.used(), "kv_pages_free": kv.available(), "kv_pages": kv.capacity,
            "prefix_hit_rate": s.prefix_hit_rate, "prefix_query_tokens": s.prefix_query_tokens,
            "prefix_hit_tokens": s.prefix_hit_tokens, "preemptions": s.preemptions, "engine_pid": os.getpid()}


def _drain(conn: Connection, block: bool) -> list[ToEngine]:
    """Every op waiting on the connection; when idle, wait up to IDLE_TICK_S for the first. EOFError: the replica
    is gone."""
    ops = []
    if block and not conn.poll(IDLE_TICK_S):
        return ops
    while conn.poll(0):
        ops.append(conn.recv())
    return ops


def serve(conn: Connection, start: Start) -> None:
    """Build rank 0's engine, report its limits, then run the loop until `Stop` or the replica goes."""
    trace = Trace("engine")
    tp, ctrl = init_tp(start.spec, start.engine, 0, start.addr, start.port)
    try:
        with torch.inference_mode():
            lock = Lockstep(build_engine(start.spec.resolved_path(), start.decode, start.engine, tp), tp.world, ctrl)
            conn.send(Ready(lock.engine.limits))
            reported, committed, running = 0.0, {}, ()
            while not lock.stopped:
                idle = not lock.engine.has_unfinished()
                t = time.perf_counter()
                ops = _drain(conn, block=idle)
                if idle:
                    trace.mark("-", "idle", time.perf_counter() - t)
                asks = [op.ask for op in ops if isinstance(op, AskStats)]
                ops = lock.exchange([op for op in ops if not isinstance(op, AskStats)])
                if adds := tuple(op.request_id for op in ops if isinstance(op, Add)):  # admitting one can kill the
                    conn.send(Running(running := lock.in_step() + adds))  # engine too (a grammar that panics)
                refused = lock.apply(ops)
                no = {r.request_id for r in refused}
                for op in ops:
                    if isinstance(op, Add) and op.request_id not in no:
                        trace.mark(op.request_id, "admit")
                if running != (running := lock.in_step()):
                    conn.send(Running(running))  # before the step: if it kills the engine, the replica knows who
                t = time.perf_counter()
                outs = lock.step()
                trace.mark("-", "step", time.perf_counter() - t)
                for o in outs if trace.enabled else ():  # tokens committed so far, as the replica counts them
                    n = committed.pop(o.request_id, 0) + len(o.new_token_ids)
                    if o.new_token_ids:
                        trace.mark(o.request_id, "commit", n)
                    if not o.finished:
                        committed[o.request_id] = n
                stats = None
                # also on the step that leaves the engine idle: gauges must not keep showing finished requests
                if asks or (outs and (time.monotonic() - reported >= ON_STEP_S or not lock.engine.has_unfinished())):
                    reported, stats = time.monotonic(), engine_stats(lock.engine, len(lock.live))
                if outs or refused or stats is not None:
                    conn.send(Stepped(outs, refused, stats))
                for ask in asks:
                    conn.send(StatsReply(ask, stats))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def collective_failure(e: BaseException) -> bool:
    """Whether `e` is a torch.distributed collective that failed (gloo's broken pair, NCCL's aborted
    communicator): a tensor-parallel rank ended first, which says nothing of the requests in the step."""
    return isinstance(e, dist.DistError) or isinstance(e, RuntimeError) and "gloo" in str(e).lower()


def main() -> None:
    conn = Connection(int(os.environ.pop(FD_ENV)))
    try:
        serve(conn, conn.recv())
    except EOFError:  # the replica went away: nobody is left to serve
        pass
    except BaseException as e:  # noqa: BLE001 - the replica fails its requests and its health check with this
        try:
            conn.send(Failed(repr(e), collective=collective_failure(e)))
        except OSError:
            pass
        sys.exit(1)


if __name__ == "__main__":
    main()
