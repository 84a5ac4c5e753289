"""The one way to build an engine over a checkpoint: `build_engine(path, decode, engine)` (a served model is
described by `mbd.decoding.model_spec.ModelSpec`).

The CLI (`mbd generate`), the eval sweeps' decoder actors, the tensor-parallel ranks of a served replica and
`mbd pretrain-tiny`'s evaluation all build their engines here, so a model directory and an `EngineConfig`
(device, dtype, threads, batch rows, KV pool, ...) mean the same thing everywhere (the way vLLM has one
engine-args object).
"""

from __future__ import annotations

from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from mbd.config import DecodeConfig, EngineConfig
from mbd.decoding.engine import Engine
from mbd.decoding.model_spec import model_dir
from mbd.model.tp import SINGLE, TPGroup
from mbd.tokenizer import Tokenizer

Loaded = tuple[torch.nn.Module, Tokenizer | None]


def load_engine_model(path: str | Path, engine: EngineConfig, tp: TPGroup = SINGLE) -> Loaded:
    """The weights (this rank's shard, on the engine's device and dtype) and the tokenizer (None if the
    directory has none); sets the engine's torch threads."""
    from mbd.model import load_checkpoint

    if engine.threads:
        torch.set_num_threads(engine.threads)
    root = model_dir(path)
    model, mcfg = load_checkpoint(root, tp=tp, dtype=engine.torch_dtype(), device=engine.torch_device())
    tok = Tokenizer.from_dir(root, mcfg) if (root / "tokenizer.json").is_file() else None
    return model, tok


def build_engine(path: str | Path, decode: DecodeConfig, engine: EngineConfig, tp: TPGroup = SINGLE,
                 loaded: Loaded | None = None) -> Engine:
    """An engine over the checkpoint at `path`; `loaded` reuses weights from `load_engine_model` (the eval
    sweeps build one engine per decoding configuration over the same weights). A `kv_cache_fraction` becomes
    bytes here, once the weights are in memory."""
    model, tok = loaded if loaded is not None else load_engine_model(path, engine, tp)
    budget = kv_cache_budget(engine, tp)
    cfg = engine.model_copy(update={"device": engine.torch_device().type, "kv_cache_bytes": budget,
                                    "kv_cache_fraction": None})
    return Engine(model, tok, decode, cfg)


def kv_cache_budget(engine: EngineConfig, tp: TPGroup = SINGLE) -> int | None:
    """The KV pool's bytes: `kv_cache_bytes`, or `kv_cache_fraction` of the memory free now (after the weights),
    reduced to the minimum over the tensor-parallel ranks: ranks decide admission and preemption independently
    from the same inputs, so their pools must be the same size."""
    if engine.kv_cache_fraction is None:
        return engine.kv_cache_bytes
    dev = engine.torch_device()
    free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else psutil.virtual_memory().available
    budget = torch.tensor([int(free * engine.kv_cache_fraction)], device=dev)
    if tp.world > 1:
        dist.all_reduce(budget, op=dist.ReduceOp.MIN, group=tp.group)
    return int(budget.item())
