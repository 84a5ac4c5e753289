"""Decoder actor of an evaluation sweep: one per GPU (or a CPU share), holding the current model and engine.
It runs in a bundle of the sweep's placement group (pipelines/sweep_pool.py) and says which node decoded.

Thin on purpose: planning, decoding and scoring live in mbd.eval; the actor only keeps an EngineCache
alive between calls so consecutive units of the same (model, config) reuse the loaded weights and engine.
"""

from __future__ import annotations

import ray

from mbd.config import DecodeConfig, EngineConfig
from mbd.eval.prompts import Message
from mbd.eval.sweep import DecodedUnit, ModelEntry
from mbd.eval.sweep_work import EngineCache, decode_prompts


@ray.remote
class EvalWorker:
    def __init__(self, engine: EngineConfig):
        self.engines = EngineCache(engine)  # torch threads are set when the first model loads

    def decode(self, model: ModelEntry, params: DecodeConfig, prompts: list[list[Message]],
               keep_trace: list[bool]) -> DecodedUnit:
        unit = decode_prompts(self.engines.get(model, params), prompts, params, keep_trace)
        return unit.model_copy(update={"node": ray.get_runtime_context().get_node_id()})
