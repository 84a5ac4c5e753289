"""The decoder deployment: one replica = one placement group = tensor_parallel_size ranks hosting the Block Buffer
engine (actors/decoder.py). It streams each request's committed blocks back to the ingress."""

from __future__ import annotations

import os
from typing import AsyncIterator

from ray import serve

from actors.decoder import Delta, EngineHost
from actors.tp_worker import ModelSpec
from mbd.config import DecodeConfig, EngineConfig
from mbd.decoding.constraints import ConstraintSpec
from mbd.decoding.validate import EngineLimits
from serve_app.metrics import DecoderMetrics


@serve.deployment
class Decoder:
    """Engine host replica: streams each request's committed blocks. With `per_block=False` they are merged into
    one final Delta, so a non-streaming request costs one Ray stream item (and one wake-up) instead of one per
    block."""

    def __init__(self, spec: ModelSpec, decode: DecodeConfig, engine: EngineConfig):
        self.metrics = DecoderMetrics()
        self.host = EngineHost(spec, decode, engine, on_step=self.metrics.update)

    async def generate(self, prompt_ids: list[int], params: DecodeConfig, per_block: bool = True,
                       rid: str | None = None, constraint: ConstraintSpec | None = None) -> AsyncIterator[Delta]:
        self.host.trace.mark(rid or "-", "arrive")
        self.host.validate(prompt_ids, params)
        async for d in self.host.generate(prompt_ids, params, rid, per_block, constraint):
            yield d

    def limits(self) -> EngineLimits:
        return self.host.limits()

    def check_health(self) -> None:
        self.host.check()

    def stats(self) -> dict[str, float]:
        return self.host.stats() | {"pid": os.getpid()}

    def __del__(self) -> None:
        if hasattr(self, "host"):
            self.host.shutdown()
