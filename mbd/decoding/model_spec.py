"""`ModelSpec`: the served model a decoder replica builds its engine from, and where a model directory is.
Plain configuration, no torch: the serve config (read by the ingress too) holds one."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from mbd.config import StrictModel
from mbd.hub import resolve_model


def model_dir(path: str | Path) -> Path:
    """Absolute model directory: relative paths from the working directory, then the repository root, so
    `mbd/assets/tiny` works from any directory and inside the Docker image; a Hugging Face Hub id
    ORG/NAME[@REVISION]: its cached snapshot (mbd.hub)."""
    return resolve_model(path).resolve()


class ModelSpec(StrictModel):
    """A served model: its weights, the replica's name, tensor parallelism and resources per rank (how the
    engine runs is the serve config's `engine:` section)."""

    path: str = Field(description="model directory: config.json, *.safetensors, tokenizer.json")
    name: str = Field(default="mbd-tiny", min_length=1, description="the `model` id clients send")
    tensor_parallel_size: int = Field(default=1, ge=1, le=8)
    num_cpus_per_rank: float = Field(default=1.0, gt=0)
    num_gpus_per_rank: float = Field(default=0.0, ge=0)

    def resolved_path(self) -> Path:
        return model_dir(self.path)
