"""Start a decoder replica's engine process and, with tensor_parallel_size > 1, its ranks 1.. as `TPWorker`
actors in the other bundles of the replica's placement group; wait until the engine says it is `Ready`.

Imports no torch: only the engine process and the TP ranks need it. A replica with one rank, the engine host,
therefore starts without it (torch's import costs seconds of CPU, paid again at every replica start before its
engine process can start)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.messages import FD_ENV, EngineDead, Failed, Ready, Start
from actors.supervision_policy import ExitLog, exit_status
from mbd.config import DecodeConfig, EngineConfig
from mbd.decoding.model_spec import ModelSpec
from mbd.decoding.validate import EngineLimits

log = logging.getLogger("ray.serve")


@dataclass
class Launched:
    proc: subprocess.Popen
    conn: Connection
    limits: EngineLimits
    workers: list[tuple[object, ray.ObjectRef]]  # ranks 1..: (actor, its `run` call)


def ranks_ended(workers: list[tuple[object, ray.ObjectRef]], timeout_s: float) -> bool:
    """Whether a tensor-parallel rank's loop ended (waiting up to timeout_s for one to)."""
    return bool(workers) and bool(ray.wait([ref for _, ref in workers], timeout=timeout_s)[0])


def end_workers(workers: list[tuple[object, ray.ObjectRef]]) -> None:
    for actor, _ in workers:
        ray.kill(actor, no_restart=True)


def launch(spec: ModelSpec, decode: DecodeConfig, engine: EngineConfig, timeout_s: float) -> Launched:
    """A new engine process (and TP ranks). Raises EngineDead if it does not come up within timeout_s."""
    addr, port, workers = _start_ranks(spec, decode, engine) if spec.tensor_parallel_size > 1 else ("", 0, [])
    proc, conn = _start_engine_process(Start(spec, decode, engine, addr, port))
    try:
        first = conn.recv() if conn.poll(timeout_s) else Failed(f"no answer within {timeout_s:.0f}s")
    except (EOFError, OSError) as e:
        first = Failed(f"connection closed ({type(e).__name__})")
    if isinstance(first, Ready):
        return Launched(proc, conn, first.limits, workers)
    conn.close()
    end_workers(workers)
    try:
        proc.wait(timeout=10)  # it exits after reporting its error
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    raise EngineDead(f"engine failed to start ({exit_status(proc.returncode)}): "
                     f"{first.message if isinstance(first, Failed) else first!r}")


def relaunch(spec: ModelSpec, decode: DecodeConfig, engine: EngineConfig, timeout_s: float, exits: ExitLog,
             stopping: threading.Event, workers: list[tuple[object, ray.ObjectRef]], why: str) -> Launched | str | None:
    """A new engine process (and TP ranks, the old ones ended first) after the back-off the counted exits call for,
    a failed start counting as an exit; the reason to give up once they exceed the limit; None if `stopping` is set
    while it waits."""
    while True:
        now = time.monotonic()
        if exits.gives_up(now):
            return f"the engine process exited {exits.count(now)} times within {exits.restarts.window_s:.0f} s " \
                   f"(last: {why})"
        if stopping.wait(exits.restarts.delay(exits.count(now))):
            return None
        end_workers(workers)
        try:
            return launch(spec, decode, engine, timeout_s)
        except Exception as e:  # noqa: BLE001 - EngineDead, or the start itself failed: a counted exit
            why = str(e)
            exits.add(time.monotonic())
            log.error("engine process restart failed: %s", why)


def _start_engine_process(start: Start) -> tuple[subprocess.Popen, Connection]:
    """`python -m actors.engine_process` with the same interpreter, environment and import path as this
    process, and this process's end of its connection (`start` already sent)."""
    mine, theirs = socket.socketpair()
    env = os.environ | {FD_ENV: str(theirs.fileno()), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-m", "actors.engine_process"], env=env, pass_fds=[theirs.fileno()])
    theirs.close()
    conn = Connection(mine.detach())
    conn.send(start)
    return proc, conn


@ray.remote(max_restarts=0)
class TPWorker:
    """Rank r > 0 of a decoder replica, placed in bundle r of the replica's placement group. Defined here, not
    beside the lockstep loop, so that the engine process (which imports actors.tp_worker) never imports Ray."""

    def run(self, spec: ModelSpec, decode: DecodeConfig, engine: EngineConfig, rank: int, addr: str, port: int) -> None:
        """Blocks for the replica's lifetime; returns when rank 0 broadcasts stop, raises if the loop fails."""
        from actors.tp_worker import follow_rank

        follow_rank(spec, decode, engine, rank, addr, port)


def _start_ranks(spec: ModelSpec, decode: DecodeConfig, engine: EngineConfig
                 ) -> tuple[str, int, list[tuple[object, ray.ObjectRef]]]:
    """Ranks 1.. as TPWorker actors in the other bundles of the replica's placement group, and the rendezvous
    address they and rank 0 meet at. The one place this module loads torch (through actors.tp_worker)."""
    from actors.tp_worker import free_port

    pg = ray.util.get_current_placement_group()
    if pg is None:
        raise EngineDead("tensor_parallel_size > 1 needs a placement group (Serve placement_group_bundles)")
    addr, port = ray.util.get_node_ip_address(), free_port("")
    workers = []
    for rank in range(1, spec.tensor_parallel_size):
        actor = TPWorker.options(
            num_cpus=spec.num_cpus_per_rank, num_gpus=spec.num_gpus_per_rank,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
        ).remote()
        workers.append((actor, actor.run.remote(spec, decode, engine, rank, addr, port)))
    return addr, port, workers
