"""Configuration of a MultiTF (or block-diffusion TF) training run, loaded from `configs/train/*.yaml`.

One YAML file per row of the paper's tab:appendix_train_hparams. The paper reports the layout and noise
settings (Seq Len, Block, Max Group, t_low, t_high, rho, N_rand, Steps) but not the optimiser settings;
those are ordinary SFT defaults here and are meant to be tuned.

The `deepspeed` section is written as plain fields and turned into DeepSpeed's JSON by `ds_config`, so
that the optimiser and the learning-rate schedule are the SAME objects a single-process reference run
builds (a torch AdamW and `lr_factor`): DeepSpeed only partitions them (ZeRO 2 or 3).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from mbd.config import StrictModel, load_yaml
from mbd.multitf.batching import LayoutSection
from mbd.multitf.objectives import ObjectiveSection
from mbd.storage import join

class RunSection(StrictModel):
    """Where Ray Train keeps checkpoints; re-running with the same name and storage_path resumes."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    storage_path: str = Field(default="runs", description="local directory or a filesystem URI every node sees "
                              "(file://, s3://, ...; mbd/storage.py)")
    keep_checkpoints: int = Field(default=2, ge=1)
    export_dir: str | None = Field(default=None, description="HF export; default <storage_path>/<name>/export")

    @property
    def run_dir(self) -> str:
        return join(self.storage_path, self.name)


class DataSection(StrictModel):
    """Exactly one source: Parquet rows of `mbd expand`, or a JSONL corpus expanded on the fly."""

    parquet: str | None = Field(default=None, description="directory of layout-expansion rows (ROW_SCHEMA)")
    jsonl: str | None = Field(default=None, description="prompt/response or messages corpus (small runs)")
    max_length: int = Field(default=2048, gt=0, description="Seq Len: padded prompt + response tokens")
    probe_rows: int = Field(default=8, ge=1, description="fixed training rows whose loss is logged at checkpoints")

    @model_validator(mode="after")
    def _one_source(self) -> "DataSection":
        if (self.parquet is None) == (self.jsonl is None):
            raise ValueError("set exactly one of data.parquet (rows of `mbd expand`) or data.jsonl (a corpus)")
        return self


class DeepSpeedSection(StrictModel):
    """ZeRO stage, batch, AdamW, warm-up + cosine schedule and clipping (turned into DeepSpeed JSON)."""

    zero_stage: Literal[2, 3] = 2
    micro_batch_size: int = Field(default=1, ge=1, description="rows per worker per forward")
    grad_accum: int = Field(default=1, ge=1)
    grad_clip: float = Field(default=1.0, ge=0, description="global grad-norm clip; 0 disables")
    lr: float = Field(default=1e-5, gt=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="cosine floor as a fraction of lr")
    warmup_steps: int = Field(default=0, ge=0)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(default=1e-8, gt=0)
    bf16: bool | None = Field(default=None, description="None: bf16 on GPU, fp32 on CPU")

    def global_batch(self, world: int) -> int:
        return self.micro_batch_size * self.grad_accum * world

    def adamw_kwargs(self) -> dict[str, Any]:
        return dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)

    def lr_factor(self, step: int, total_steps: int) -> float:
        """Multiplier of `lr` for optimiser step `step` (0-based): linear warm-up, then cosine to min_lr_ratio.

        The first step already has a non-zero rate ((step + 1) / warmup), so no step is wasted.
        """
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def use_bf16(self, use_gpu: bool) -> bool:
        return use_gpu if self.bf16 is None else self.bf16

    def ds_config(self, use_gpu: bool) -> dict[str, Any]:
        """DeepSpeed JSON; the optimiser and scheduler are passed as objects to `deepspeed.initialize`."""
        return {
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.grad_accum,
            "gradient_clipping": self.grad_clip,
            "zero_optimization": {"stage": self.zero_stage},
            "zero_allow_untested_optimizer": True,  # a plain torch AdamW: no compiled DeepSpeed Adam op
            "bf16": {"enabled": self.use_bf16(use_gpu)},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }


class TrainConfig(StrictModel):
    run: RunSection
    model_path: str = Field(description="HF-format model directory (config.json + safetensors [+ tokenizer.json])")
    data: DataSection
    layouts: LayoutSection = LayoutSection()
    objective: ObjectiveSection = ObjectiveSection()
    deepspeed: DeepSpeedSection = DeepSpeedSection()
    steps: int = Field(gt=0, description="optimiser steps")
    checkpoint_every: int = Field(default=500, gt=0)
    num_workers: int = Field(default=1, ge=1)
    use_gpu: bool = False
    cpus_per_worker: float = Field(default=1.0, gt=0,
                                   description="Ray CPUs per CPU worker (torch threads: its floor, at least 1)")
    attention: Literal["dense", "flex"] = Field(default="dense", description="dense SDPA mask or FlexAttention")
    seed: int = Field(default=0, ge=0)
    max_failures: int = Field(default=0, ge=-1, description="worker-group restarts; -1 = unlimited")

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if self.deepspeed.bf16 and not self.use_gpu:
            raise ValueError("deepspeed.bf16=true needs use_gpu=true (CPU training runs in fp32 over gloo)")
        if self.attention == "flex" and not self.use_gpu:
            raise ValueError("attention=flex needs use_gpu=true (FlexAttention has no backward on CPU); use dense")
        return self


def load_train_config(path: str | Path) -> TrainConfig:
    return load_yaml(path, TrainConfig)
