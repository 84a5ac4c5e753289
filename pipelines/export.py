"""Export a training checkpoint as a HuggingFace-format safetensors model directory.

    mbd export --run-dir runs/tiny-multitf --out models/tiny-mbd        # the run's latest checkpoint
    mbd export --checkpoint runs/tiny-multitf/checkpoint_2026-... --out models/x --dtype bf16
    mbd export --run-dir s3://bucket/runs/tiny-multitf --out s3://bucket/models/tiny-mbd   # URIs: mbd/storage.py

Every checkpoint of `mbd train` carries `model/`, a full (ZeRO-3-gathered) safetensors snapshot written
by rank 0, next to the DeepSpeed shards. Export therefore never unpickles DeepSpeed's optimizer files: it
loads `model/` with the foundation loader (which validates every tensor against config.json), writes it
with `save_checkpoint` in the requested dtype, and copies the tokenizer files.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import torch

from mbd import storage
from mbd.config import DTYPE_NAMES, parse_dtype
from mbd.model import load_checkpoint, save_checkpoint
from mbd.model.checkpoint import copy_tokenizer_files
from mbd.training_record import RECORD_FILE

__all__ = ["export_checkpoint", "latest_checkpoint", "main"]  # what other pipelines may use


def checkpoint_step(path: str | Path) -> int:
    state = storage.join(path, "train_state.json")
    return int(json.loads(storage.read_text(state))["step"]) if storage.exists(state) else -1


def latest_checkpoint(run_dir: str | Path) -> str:
    """The checkpoint directory (local path or URI) of the run with the highest training step."""
    found = [c for c in (storage.join(run_dir, n) for n in storage.list_names(run_dir, "checkpoint_"))
             if storage.exists(storage.join(c, "model", "config.json"))]
    if not found:
        raise FileNotFoundError(f"{run_dir}: no checkpoint_*/model/ found (is this <storage_path>/<run name>?)")
    return max(found, key=checkpoint_step)


def export_checkpoint(checkpoint: Path, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write `checkpoint/model` to `out` as config.json + model.safetensors (+ tokenizer files, and the training
    record that says how it was trained: mbd/training_record.py)."""
    src = checkpoint / "model"
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{checkpoint}: no model/config.json; not a checkpoint written by `mbd train`")
    model, cfg = load_checkpoint(src, dtype=dtype)
    save_checkpoint(model, cfg, out)
    copy_tokenizer_files(src, out)
    if (src / RECORD_FILE).is_file():
        shutil.copyfile(src / RECORD_FILE, out / RECORD_FILE)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mbd export", description="Training checkpoint -> HF safetensors directory.")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--run-dir", help="<storage_path>/<run name> (a local path or a URI): export its latest "
                                        "checkpoint")
    where.add_argument("--checkpoint", help="one checkpoint directory (checkpoint_*)")
    ap.add_argument("--out", required=True, help="output model directory (a local path or a URI)")
    ap.add_argument("--dtype", choices=list(DTYPE_NAMES), default="float32")
    args = ap.parse_args(argv)
    ckpt = latest_checkpoint(args.run_dir) if args.run_dir else args.checkpoint
    # URIs: only the checkpoint's model/ snapshot is downloaded, the export uploaded
    with tempfile.TemporaryDirectory(prefix="mbd-export-") as tmp, storage.local_dir_for(args.out) as out:
        local = Path(ckpt)
        if storage.is_uri(ckpt):
            local = Path(tmp)
            storage.download_dir(storage.join(ckpt, "model"), local / "model")
        export_checkpoint(local, out, parse_dtype(args.dtype))
    print(json.dumps({"checkpoint": str(ckpt), "step": checkpoint_step(ckpt), "export_dir": str(args.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
