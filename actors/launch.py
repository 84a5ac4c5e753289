"""Start a decoder replica's engine process and, with tensor_parallel_size > 1, its ranks 1.. as `TPWorker`
actors in the other bundles of the replica's placement group; wait until the engine says it is `Ready`."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from multiprocessing.connection import Connection

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors import engine_process
from actors.messages import EngineDead, Failed, Ready
from actors.supervisor import exit_status
from actors.tp_worker import TPWorker, free_port
from mbd.config import DecodeConfig, EngineConfig
from mbd.decoding.model_spec import ModelSpec
from mbd.decoding.validate import EngineLimits


@dataclass
class Launched:
    proc: subprocess.Popen
    conn: Connection
    limits: EngineLimits
    workers: list[tuple[object, ray.ObjectRef]]  # ranks 1..: (actor, its `run` call)


def end_workers(workers: list[tuple[object, ray.ObjectRef]]) -> None:
    for actor, _ in workers:
        ray.kill(actor, no_restart=True)


def launch(spec: ModelSpec, decode: DecodeConfig, engine: EngineConfig, timeout_s: float) -> Launched:
    """A new engine process (and TP ranks). Raises EngineDead if it does not come up within timeout_s."""
    world = spec.tensor_parallel_size
    addr, port = (ray.util.get_node_ip_address(), free_port("")) if world > 1 else ("", 0)
    workers = [_start_worker(spec, decode, engine, r, addr, port) for r in range(1, world)]
    proc, conn = engine_process.start(spec, decode, engine, addr, port)
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


def _start_worker(spec: ModelSpec, decode: DecodeConfig, engine: EngineConfig, rank: int, addr: str, port: int
                  ) -> tuple[object, ray.ObjectRef]:
    pg = ray.util.get_current_placement_group()
    if pg is None:
        raise EngineDead("tensor_parallel_size > 1 needs a placement group (Serve placement_group_bundles)")
    actor = TPWorker.options(
        num_cpus=spec.num_cpus_per_rank, num_gpus=spec.num_gpus_per_rank,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
    ).remote()
    return actor, actor.run.remote(spec, decode, engine, rank, addr, port)
