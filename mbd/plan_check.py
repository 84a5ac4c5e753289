"""From a serve or train configuration to its memory plan (`mbd.plan`), and the refusal `mbd serve` and
`mbd train` run before loading anything.

A configuration names a model directory; its `config.json` gives the architecture. The paper's models live on
GPU nodes, not here, so when the directory is absent the shape comes from `configs/model/<name>-shape.json`
whose name the directory's name contains (`/models/MBD-LLaDA2-Mini` -> `llada2-mini-shape.json`); the plan says so.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import torch

from mbd.checkpoint_files import read_model_config
from mbd.config import REPO_ROOT, ConfigError, DecodeConfig, EngineConfig, ModelConfig, read_json, resolve_path
from mbd.plan import H100_80GB, DeviceMemory, Plan, ServeShape, TrainShape, refuse_unless_fits, serve_plan, train_plan
from mbd.train_config import TrainConfig

SHAPES = REPO_ROOT / "configs" / "model"


def model_config(path: str, override: str | None = None) -> tuple[ModelConfig, str]:
    """(config, where it came from): `override` (a config.json), else the model directory's config.json, else
    the shipped shape whose name the directory's name contains."""
    if override:
        return ModelConfig.from_hf(read_json(resolve_path(override))), override
    own = resolve_path(path) / "config.json"
    if own.is_file():
        return read_model_config(own.parent), str(own)
    name = Path(path).name.lower()
    for shape in sorted(SHAPES.glob("*-shape.json")):
        if shape.name.removesuffix("-shape.json") in name:
            return ModelConfig.from_hf(read_json(shape)), f"{shape.relative_to(REPO_ROOT)} ({path} is not here)"
    raise ConfigError(f"{path} has no config.json and matches no configs/model/*-shape.json: pass --model-config")


def device_memory(cuda: bool) -> DeviceMemory:
    """This machine's GPU 0 when it has one, else the product's target (an 80 GB H100); host memory on CPU."""
    if not cuda:
        return DeviceMemory("host", psutil.virtual_memory().total, 0)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return DeviceMemory(props.name, props.total_memory, H100_80GB.reserved)
    return H100_80GB


def serve_shape(engine: EngineConfig, tp: int) -> ServeShape:
    """The memory-relevant settings of an engine config at tensor-parallel size `tp`."""
    device = engine.torch_device()
    cuda, dtype = device.type == "cuda", engine.torch_dtype()
    from mbd.decoding.compiled import decode_mode

    attention, compile, graphs = decode_mode(engine, device)
    # eager flex materialises the scores as the math kernel does
    attention = "sdpa" if attention == "flex" and compile == "off" else attention
    return ServeShape(tp=tp, dtype=dtype, cuda=cuda, max_batch_rows=engine.max_batch_rows,
                      kv_cache_bytes=engine.kv_cache_bytes, kv_cache_fraction=engine.kv_cache_fraction,
                      page_size=engine.page_size, attention=attention, cuda_graphs=graphs,
                      batch_buckets=tuple(engine.batch_buckets) if engine.batch_buckets else None,
                      prefill_chunk=engine.prefill_chunk)


def train_shape(cfg: TrainConfig, world: int | None = None, zero_stage: int | None = None) -> TrainShape:
    return TrainShape(world=world or cfg.num_workers, zero_stage=zero_stage or cfg.deepspeed.zero_stage,
                      bf16=cfg.deepspeed.use_bf16(cfg.use_gpu), micro_batch=cfg.deepspeed.micro_batch_size,
                      seq_len=cfg.data.max_length, attention=cfg.attention)


def check_serve(path: str, engine: EngineConfig, tp: int, decode: DecodeConfig) -> Plan:
    """Refuse (PlanError) an engine over the model at `path` whose plan does not fit one rank's device; the plan
    otherwise."""
    mcfg, _ = model_config(path)
    shape = serve_shape(engine, tp)
    return refuse_unless_fits(serve_plan(mcfg, decode, shape, device_memory(shape.cuda)), f"model '{path}'")


def check_train(cfg: TrainConfig) -> Plan | None:
    """Refuse (PlanError) a GPU training run whose plan does not fit a GPU; None when the model directory has no
    config.json (the run reports that itself) or the run is on CPU (ranks share the host's memory)."""
    if not cfg.use_gpu or not (resolve_path(cfg.model_path) / "config.json").is_file():
        return None
    mcfg, _ = model_config(cfg.model_path)
    return refuse_unless_fits(train_plan(mcfg, train_shape(cfg), device_memory(True)), f"training run '{cfg.run.name}'")
