"""The one way to build an engine: `EngineSpec` (which weights, where, how many batch slots) + `build_engine`.

The CLI (`mbd generate`), the eval sweeps' decoder actors, the tensor-parallel ranks of a served replica and
`mbd pretrain-tiny`'s evaluation all build their engines here, so a model directory, a device and a dtype mean
the same thing everywhere (the way vLLM has one engine-args object).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import psutil
import torch
import torch.distributed as dist
from pydantic import Field, model_validator

from mbd.config import DecodeConfig, StrictModel, parse_dtype
from mbd.decoding.engine import Engine
from mbd.hub import resolve_model
from mbd.model.tp import SINGLE, TPGroup
from mbd.tokenizer import Tokenizer


class EngineSpec(StrictModel):
    """What it takes to build an engine over one model directory on one device (or one tensor-parallel rank)."""

    path: str = Field(description="model directory (config.json, *.safetensors, tokenizer.json) or a Hugging Face "
                      "Hub id ORG/NAME[@REVISION] (mbd.hub)")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto: cuda if available")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="auto: bfloat16 on cuda, float32 on cpu")
    max_batch_slots: int = Field(default=8, ge=1, le=1024, description="requests decoded together per step")
    torch_threads: int | None = Field(default=None, ge=1, description="intra-op threads (CPU); None: torch's")
    kv_cache_bytes: int | None = Field(default=None, ge=1, description=(
        "KV page pool budget (per tensor-parallel rank); None: room for every batch slot at max_length"))
    kv_cache_fraction: float | None = Field(default=None, gt=0, le=0.95, description=(
        "or: this share of the device memory free once the weights are loaded (host memory on CPU); the "
        "smallest over the tensor-parallel ranks, so every rank's pool is the same"))
    page_size: int | None = Field(default=None, ge=1, description="tokens per KV page, a multiple of the block "
                                  "size; None: 16 or one block, whichever is larger")
    prefix_caching: bool = Field(default=True, description="reuse committed prefix pages across requests")

    @model_validator(mode="after")
    def _one_budget(self) -> "EngineSpec":
        if self.kv_cache_bytes is not None and self.kv_cache_fraction is not None:
            raise ValueError("set kv_cache_bytes or kv_cache_fraction, not both")
        return self

    def resolved_path(self) -> Path:
        """Absolute model directory: relative paths from the working directory, then the repository root, so
        `mbd/assets/tiny` works from any directory and inside the Docker image; a Hub id: its cached snapshot."""
        return resolve_model(self.path).resolve()

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device("cuda", 0) if self.device == "cuda" else torch.device("cpu")

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return parse_dtype(self.dtype)


def load_engine_model(spec: EngineSpec, tp: TPGroup = SINGLE) -> tuple[torch.nn.Module, Tokenizer | None]:
    """The weights (this rank's shard) and the tokenizer (None if the directory has none) of `spec`."""
    from mbd.model import load_checkpoint

    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    path = spec.resolved_path()
    model, mcfg = load_checkpoint(path, tp=tp, dtype=spec.torch_dtype(), device=spec.torch_device())
    tok = Tokenizer.from_dir(path, mcfg) if (path / "tokenizer.json").is_file() else None
    return model, tok


def build_engine(spec: EngineSpec, decode: DecodeConfig, tp: TPGroup = SINGLE,
                 loaded: tuple[torch.nn.Module, Tokenizer | None] | None = None, **engine_kw: Any) -> Engine:
    """An engine for `spec` under `decode`; `loaded` reuses weights from `load_engine_model` (the eval sweeps
    build one engine per decoding configuration over the same weights); `engine_kw` go to `Engine` (trace, ...)."""
    model, tok = loaded if loaded is not None else load_engine_model(spec, tp)
    return Engine(model, tok, decode, max_batch_slots=spec.max_batch_slots, device=spec.torch_device(),
                  kv_cache_bytes=kv_cache_budget(spec, tp), page_size=spec.page_size,
                  prefix_caching=spec.prefix_caching, **engine_kw)


def kv_cache_budget(spec: EngineSpec, tp: TPGroup = SINGLE) -> int | None:
    """The KV pool's bytes: `kv_cache_bytes`, or `kv_cache_fraction` of the memory free now (after the weights),
    reduced to the minimum over the tensor-parallel ranks: ranks decide admission and preemption independently
    from the same inputs, so their pools must be the same size."""
    if spec.kv_cache_fraction is None:
        return spec.kv_cache_bytes
    dev = spec.torch_device()
    free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else psutil.virtual_memory().available
    budget = torch.tensor([int(free * spec.kv_cache_fraction)], device=dev)
    if tp.world > 1:
        dist.all_reduce(budget, op=dist.ReduceOp.MIN, group=tp.group)
    return int(budget.item())
