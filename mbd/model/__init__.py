"""BD-LM backbones (SDAR, LLaDA2-MoE), attention masks, static KV cache, tensor parallelism, checkpoints."""

from mbd.model.cache import KVCache
from mbd.model.checkpoint import CheckpointError, build_model, load_checkpoint, save_checkpoint
from mbd.model.tp import TPGroup

__all__ = ["KVCache", "CheckpointError", "TPGroup", "build_model", "load_checkpoint", "save_checkpoint"]
