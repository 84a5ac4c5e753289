"""The serving configuration (`configs/serve/*.yaml`), validated once when the application is built.

One file describes a whole deployment: which model, how it is sharded, the decoding defaults that also bound
every request (a request cannot ask for a larger Block Buffer than the deployment compiled), the Serve
scaling knobs and the HTTP front door. Bad values fail at `mbd serve` time, naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from actors.supervision_policy import EngineRestarts
from mbd.config import ConfigError, DecodeConfig, EngineConfig, StrictModel, load_decode, load_yaml
from mbd.decoding.model_spec import ModelSpec


DEFAULT_MAX_BODY = 4 * 1024 * 1024


class RequestLimits(StrictModel):
    default_max_tokens: int | None = Field(default=None, gt=0, description="when a request omits max_tokens")
    max_temperature: float = Field(default=2.0, ge=0)
    max_choices: int = Field(default=16, ge=1, description="prompts x n per request (each is one engine request)")


class Autoscaling(StrictModel):
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=1, ge=1)
    target_ongoing_requests: float = Field(default=8, gt=0)
    upscale_delay_s: float = Field(default=30, ge=0)
    downscale_delay_s: float = Field(default=600, ge=0)

    @model_validator(mode="after")
    def _check(self) -> "Autoscaling":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} must be <= max_replicas={self.max_replicas}")
        return self


class DecoderDeployment(StrictModel):
    """Serve knobs of the engine-host deployment (one replica = one placement group = TP ranks).

    A replica should accept many more requests than it has batch rows: those beyond the rows wait in the engine's
    own queue, which admits one the step a row frees. Requests that a full replica refuses wait in Serve's router
    instead, which retries with a backoff of up to half a second while rows may sit empty."""

    max_ongoing_requests: int = Field(default=256, ge=1,
                                      description="requests inside one replica: decoding + in its engine's queue")
    max_queued_requests: int = Field(default=64, ge=-1, description="waiting for a replica with room; -1: "
                                                                    "unbounded; beyond it clients get 503")
    retry_after_s: float = Field(default=1.0, ge=0)
    replica_retries: int = Field(default=2, ge=0, description="times a request is started again when its replica "
                                                              "died before the client got any of its tokens")
    engine_restarts: EngineRestarts = Field(default=EngineRestarts(), description=(
        "how a replica restarts its engine process when it exits, and when it gives up (then Serve replaces it)"))
    autoscaling: Autoscaling = Autoscaling()
    health_check_period_s: float = Field(default=10, gt=0)
    health_check_timeout_s: float = Field(default=30, gt=0)


class IngressDeployment(StrictModel):
    num_replicas: int = Field(default=1, ge=1)
    max_ongoing_requests: int = Field(default=256, ge=1)
    num_cpus: float = Field(default=0.0, ge=0)
    tokenizer_threads: int = Field(default=4, ge=1, description="(de)tokenization threads, off the event loop")


class HTTPSpec(StrictModel):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    route_prefix: str = "/"
    api_key: str | None = Field(default=None, description="bearer token; unset: MBD_API_KEY env, else no auth")
    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY, ge=1024, description="larger request bodies get 413")


class MetricsSpec(StrictModel):
    port: int = Field(default=8080, ge=1, le=65535, description=(
        "Ray's metrics export port on the local cluster `mbd serve` starts (KubeRay's 8080; --metrics-port); a "
        "cluster it joins keeps its own"))


class ServeConfig(StrictModel):
    model: ModelSpec
    engine: EngineConfig = EngineConfig()
    decode: DecodeConfig = Field(default=DecodeConfig(), description=(
        "decoding defaults and per-request bounds; `base: <decode YAML>` takes that file's operating point, the "
        "fields beside it override it"))
    limits: RequestLimits = RequestLimits()
    decoder: DecoderDeployment = DecoderDeployment()
    ingress: IngressDeployment = IngressDeployment()
    http: HTTPSpec = HTTPSpec()
    metrics: MetricsSpec = MetricsSpec()

    @model_validator(mode="before")
    @classmethod
    def _decode_base(cls, data: Any) -> Any:
        """`decode: {base: configs/decode/x.yaml, ...}`: the decode YAML's fields (its `engine:` section is how
        `mbd generate` runs it, not a decode field), then the fields given beside `base` over them."""
        dec = data.get("decode") if isinstance(data, dict) else None
        if not isinstance(dec, dict) or "base" not in dec:
            return data
        try:
            point = load_decode(dec["base"])[0].model_dump(exclude_unset=True)
        except ConfigError as e:
            raise ValueError(f"decode.base: {e}") from e
        return data | {"decode": point | {k: v for k, v in dec.items() if k != "base"}}

    @model_validator(mode="after")
    def _rows_can_fill(self) -> "ServeConfig":
        if self.decoder.max_ongoing_requests < self.engine.max_batch_rows:
            raise ValueError(f"decoder.max_ongoing_requests={self.decoder.max_ongoing_requests} leaves batch rows "
                             "empty: a replica must accept at least engine.max_batch_rows="
                             f"{self.engine.max_batch_rows} requests")
        return self

    @model_validator(mode="after")
    def _devices(self) -> "ServeConfig":
        if self.engine.device == "cuda" and self.model.num_gpus_per_rank < 1:
            raise ValueError("engine.device cuda needs model.num_gpus_per_rank: 1 (one GPU per tensor-parallel rank)")
        return self


def load_serve_config(path: str | Path, sets: Sequence[str] = ()) -> ServeConfig:
    """The serve YAML with `--set` overrides (`--set engine.attention=flex`)."""
    return load_yaml(path, ServeConfig, sets=sets)
