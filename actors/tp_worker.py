"""One tensor-parallel rank of a decoder replica, and the lockstep (SPMD) engine loop every rank runs.

Every rank holds a full engine (scheduler, Block Buffers, sampler) over its weight shard; the model all-gathers
logits, so identical inputs give identical decisions on every rank. The only thing rank 0 must share is what
changed in the request set. Once per engine step it broadcasts that list of operations (admit, abort, stop) over
a gloo group; all ranks apply it and call `engine.step()` together. The per-step cost is one small CPU
broadcast; no Ray call sits inside a decoding step.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from actors.messages import Abort, Add, LockstepOp, Refusal, Stop
from mbd.config import DecodeConfig, EngineConfig
from mbd.decoding.engine import Engine, StepOutput
from mbd.decoding.model_spec import ModelSpec
from mbd.decoding.spec import build_engine
from mbd.decoding.validate import RequestError
from mbd.model import TPGroup


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now ("" = every interface, for a rendezvous other nodes reach)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_tp(spec: ModelSpec, engine: EngineConfig, rank: int, addr: str, port: int) -> tuple[TPGroup, object | None]:
    """Join the replica's process group; returns this rank's TPGroup and the gloo group for control messages
    (None: the default group is already gloo)."""
    world = spec.tensor_parallel_size
    if world == 1:
        return TPGroup(), None
    backend = "nccl" if engine.torch_device().type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    ctrl = dist.new_group(backend="gloo") if backend != "gloo" else None
    return TPGroup(rank, world), ctrl


class Lockstep:
    """Applies rank 0's ops and steps the engine; identical on every rank, so the ranks never diverge."""

    def __init__(self, engine: Engine, world: int, ctrl: object | None):
        self.engine = engine
        self.world = world
        self.ctrl = ctrl
        self.live: set[str] = set()
        self.stopped = False

    def exchange(self, ops: list[LockstepOp] | None) -> list[LockstepOp]:
        """Rank 0 passes its ops, the others None; everyone returns rank 0's ops."""
        if self.world == 1:
            return ops or []
        box = [ops]
        dist.broadcast_object_list(box, src=0, group=self.ctrl)
        return box[0]

    def apply(self, ops: list[LockstepOp]) -> list[Refusal]:
        """Apply ops in order; return the admissions the engine refused (a constraint that does not compile), each
        with the error naming the field. Every rank refuses the same ones (same ops, same state), so a refusal
        never breaks the lockstep."""
        refused = []
        for op in ops:
            if isinstance(op, Add):
                try:
                    self.engine.admit(op.prompt_ids, op.params, op.request_id, op.constraint, op.resumed)
                    self.live.add(op.request_id)
                except ValueError as e:  # RequestError, or ConstraintError (which names its field too)
                    refused.append(Refusal(op.request_id, e if isinstance(e, RequestError) else
                                           RequestError(getattr(e, "field", None), str(e))))
            elif isinstance(op, Abort) and op.request_id in self.live:
                self.engine.abort(op.request_id)
                self.live.discard(op.request_id)
            elif isinstance(op, Stop):
                self.stopped = True
        return refused

    def in_step(self) -> tuple[str, ...]:
        """The requests the next step may run: those in batch rows, then as many waiting ones as rows are free
        (the scheduler admits from the front of its queue)."""
        sched = self.engine.scheduler
        free = sched.rows - len(sched.running)
        return tuple(r.id for r in sched.running.values()) + tuple(r.id for r in list(sched.waiting)[:free])

    def step(self) -> list[StepOutput]:
        if not self.engine.has_unfinished():
            return []
        outs = self.engine.step()
        for o in outs:
            if o.finished:
                self.live.discard(o.request_id)
        return outs

    def follow(self) -> None:
        """The loop of ranks > 0: everything they do is dictated by rank 0's broadcasts."""
        while not self.stopped:
            self.apply(self.exchange(None))
            self.step()


def follow_rank(spec: ModelSpec, decode: DecodeConfig, engine: EngineConfig, rank: int, addr: str, port: int) -> None:
    """Rank r > 0 for the replica's lifetime (actors/launch.py's TPWorker): returns when rank 0 broadcasts stop,
    raises if the loop fails."""
    tp, ctrl = init_tp(spec, engine, rank, addr, port)
    try:
        with torch.inference_mode():
            Lockstep(build_engine(spec.resolved_path(), decode, engine, tp), tp.world, ctrl).follow()
    finally:
        dist.destroy_process_group()
