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
from pathlib import Path
from typing import Literal

import ray
import torch
import torch.distributed as dist
from pydantic import Field, model_validator

from mbd.config import DecodeConfig, StrictModel
from mbd.decoding.engine import Engine, StepOutput
from mbd.model import TPGroup, load_checkpoint
from mbd.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Ops broadcast from rank 0: ("add", request_id, prompt_ids, DecodeConfig) | ("abort", request_id) | ("stop",)
Op = tuple


class ModelSpec(StrictModel):
    """What a rank needs to load its shard and build its engine."""

    path: str = Field(description="model directory: config.json, *.safetensors, tokenizer.json")
    name: str = Field(default="mbd-tiny", min_length=1, description="the `model` id clients send")
    tensor_parallel_size: int = Field(default=1, ge=1, le=8)
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_batch_slots: int = Field(default=8, ge=1, le=1024, description="requests decoded together per step")
    num_cpus_per_rank: float = Field(default=1.0, gt=0)
    num_gpus_per_rank: float = Field(default=0.0, ge=0)
    torch_threads: int | None = Field(default=None, ge=1, description="intra-op threads per rank (CPU)")

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        if self.device == "cuda" and self.num_gpus_per_rank < 1:
            raise ValueError("device 'cuda' needs num_gpus_per_rank: 1 (one GPU per tensor-parallel rank)")
        return self

    def resolved_path(self) -> Path:
        """Absolute model directory. A relative path is tried against the working directory, then against the
        installed package root, so `mbd/assets/tiny` works from any directory and inside the Docker image."""
        p = Path(self.path).expanduser()
        if p.is_absolute() or p.exists():
            return p.resolve()
        import mbd

        return (Path(mbd.__file__).resolve().parent.parent / p).resolve()

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_tp(spec: ModelSpec, rank: int, addr: str, port: int) -> tuple[TPGroup, object | None]:
    """Join the replica's process group; returns this rank's TPGroup and the gloo group for control messages
    (None: the default group is already gloo)."""
    world = spec.tensor_parallel_size
    if world == 1:
        return TPGroup(), None
    dist.init_process_group(spec.backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    ctrl = dist.new_group(backend="gloo") if spec.backend != "gloo" else None
    return TPGroup(rank, world), ctrl


def build_engine(spec: ModelSpec, decode: DecodeConfig, tp: TPGroup) -> Engine:
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    device = torch.device("cuda", 0) if spec.device == "cuda" else torch.device("cpu")
    path = spec.resolved_path()
    model, cfg = load_checkpoint(path, tp=tp, dtype=DTYPES[spec.dtype], device=device)
    return Engine(model, Tokenizer.from_dir(path, cfg), decode, max_batch_slots=spec.max_batch_slots, device=device)


class Lockstep:
    """Applies rank 0's ops and steps the engine; identical on every rank, so the ranks never diverge."""

    def __init__(self, engine: Engine, world: int, ctrl: object | None):
        self.engine = engine
        self.world = world
        self.ctrl = ctrl
        self.live: set[str] = set()
        self.stopped = False

    def exchange(self, ops: list[Op] | None) -> list[Op]:
        """Rank 0 passes its ops, the others None; everyone returns rank 0's ops."""
        if self.world == 1:
            return ops or []
        box = [ops]
        dist.broadcast_object_list(box, src=0, group=self.ctrl)
        return box[0]

    def apply(self, ops: list[Op]) -> list[tuple[str, str]]:
        """Apply ops in order; return the admissions the engine refused as (request_id, reason). Every rank
        refuses the same ones (same ops, same state), so a refusal never breaks the lockstep."""
        refused = []
        for op in ops:
            if op[0] == "add":
                try:
                    self.engine.add_request(op[2], op[3], request_id=op[1])
                    self.live.add(op[1])
                except ValueError as e:
                    refused.append((op[1], str(e)))
            elif op[0] == "abort" and op[1] in self.live:
                self.engine.abort(op[1])
                self.live.discard(op[1])
            elif op[0] == "stop":
                self.stopped = True
        return refused

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


@ray.remote(max_restarts=0)
class TPWorker:
    """Rank r > 0 of a decoder replica, placed in bundle r of the replica's placement group."""

    def run(self, spec: ModelSpec, decode: DecodeConfig, rank: int, addr: str, port: int) -> None:
        """Blocks for the replica's lifetime; returns when rank 0 broadcasts stop, raises if the loop fails."""
        tp, ctrl = init_tp(spec, rank, addr, port)
        try:
            with torch.inference_mode():
                Lockstep(build_engine(spec, decode, tp), tp.world, ctrl).follow()
        finally:
            dist.destroy_process_group()
