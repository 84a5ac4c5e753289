"""How a checkpoint was trained, as far as decoding it with MultiBD is concerned.

`mbd train` writes `mbd_training.json` into every checkpoint it saves (and `mbd export` copies it): the layout
mode (MultiTF group-layouts or block-diffusion TF), the objective, the block size, the steps and the base model.
A checkpoint is an MBD model when that record says MultiTF, or when its name follows the paper's naming of the
authors' published MBD models (`MBD-LLaDA2-Mini`, `MBD-SDAR-8B-Chat-b4`, ...: sec:experiments, "MBD-* models";
docs/fidelity.md). Decoding any other checkpoint with a Block Buffer of more than one slot is training-free
MultiBD, the failure MultiTF exists to fix (claim (b)): `multibd_warning` says so once, at start.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field

from mbd.config import StrictModel

RECORD_FILE = "mbd_training.json"
# claim (b)'s registered run (a6-c6-d5-e5-7d0a4d4c0e, docs/reproduce.md): training-free MultiBD on the tiny base
CLAIM_B_LOSS = "35.2 pp [34.2, 36.2] of tinymath accuracy"


class TrainingRecord(StrictModel):
    """What `mbd train` did to the checkpoint it wrote."""

    layouts: Literal["multitf", "tf", "d2f"] = Field(description="layout mode of the training rows "
                                                                  "(multitf: MultiTF group-layouts)")
    objective: str
    block_size: int = Field(gt=0)
    steps: int = Field(ge=0)
    base_model: str = Field(description="the model it was trained from")
    data: str = Field(description="the training rows: Parquet of `mbd expand`, or a JSONL corpus")

    @property
    def multitf(self) -> bool:
        return self.layouts == "multitf"


def write_record(d: Path, record: TrainingRecord) -> None:
    (d / RECORD_FILE).write_text(record.model_dump_json(indent=2) + "\n")


def read_record(d: Path) -> TrainingRecord | None:
    """The checkpoint's record, or None when it has none (a base, or a checkpoint from elsewhere)."""
    p = Path(d) / RECORD_FILE
    return TrainingRecord.model_validate(json.loads(p.read_text())) if p.is_file() else None


def published_mbd(name: str) -> bool:
    """A name (Hub id, or directory) of the paper's naming for MultiTF post-trained models: MBD-<base>."""
    return name.rstrip("/").rsplit("/", 1)[-1].lower().startswith("mbd-")


def is_mbd_model(d: Path, name: str) -> bool:
    record = read_record(d)
    return record.multitf if record is not None else published_mbd(name)


def multibd_warning(d: Path, name: str, buffer_size: int) -> str | None:
    """The warning for decoding checkpoint `d` (named `name` by the user) with `buffer_size` slots, or None."""
    if buffer_size <= 1 or is_mbd_model(d, name):
        return None
    return (f"{name} is not an MBD model (no MultiTF post-training in {RECORD_FILE}, and not named MBD-*): decoding "
            f"it with buffer_size {buffer_size} is training-free MultiBD, which lost {CLAIM_B_LOSS} on the tiny "
            "model (claim (b), docs/reproduce.md). Use buffer_size: 1 (SingleBD), or an MBD model such as "
            "mbd/assets/mbd-tiny or the output of `mbd train`.")
