"""The decoder deployment: one replica = one placement group = tensor_parallel_size ranks. A replica IS its
engine host (actors/engine_host.py): Serve calls the host's `generate` itself, which streams each request's
`StepOutput`s to the ingress, so no hop of the replica only forwards them."""

from __future__ import annotations

import os

from ray import serve

from actors.engine_host import EngineHost
from actors.supervision_policy import EngineRestarts
from mbd.config import DecodeConfig, EngineConfig
from mbd.decoding.model_spec import ModelSpec
from serve_app.metrics import DecoderMetrics


@serve.deployment
class Decoder(EngineHost):
    """Engine host replica: `generate` (per_block=False: the whole generation as one StepOutput, so a
    non-streaming request costs one Ray stream item and one wake-up), `limits`, `stats`, `engine_state` (for the
    ingress's /health) and Serve's health check, which fails only once the replica gave up restarting its engine
    process (a restart in progress keeps the replica, its loaded configuration and its waiting requests)."""

    def __init__(self, spec: ModelSpec, decode: DecodeConfig, engine: EngineConfig, restarts: EngineRestarts):
        self.metrics = DecoderMetrics(spec.name)
        self.metrics.declare()  # exported at 0 while the engine loads, not only after its first event
        super().__init__(spec, decode, engine, restarts, on_step=self.metrics.update, on_count=self.metrics.count)

    def check_health(self) -> None:
        self.check()

    def stats(self) -> dict[str, float]:
        return super().stats() | {"pid": os.getpid()}

    def __del__(self) -> None:
        if hasattr(self, "supervisor"):
            self.shutdown()
