"""Test-side instrumentation of the multi-node job tests, importable by Ray workers by module name (pytest imports
test modules under their bare file names, which workers cannot import).

`expand_batch_marking_node` is the expansion stage of `mbd expand` that also leaves a marker file naming the node
it ran on (in `<output_dir>.nodes/`, a directory every node of a one-machine cluster sees) and takes a little
longer, so that a node can be removed while blocks are still being expanded; `loop_marking_node` does the same
for the training workers of `mbd train`, which also leave a marker per step they start (`steps_started`), so a test
sees where a restarted worker group resumed even when no step was logged twice."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pyarrow as pa

from mbd.train_config import TrainConfig
from pipelines import expand_layouts, train_multitf

_expand = expand_layouts.expand_batch
BLOCK_DELAY_S = 0.5


def node_dir(output_dir: str) -> Path:
    return Path(output_dir.rstrip("/") + ".nodes")


def expand_batch_marking_node(batch: pa.Table, *, cfg_json: str, block_size: int, mask_token_id: int) -> pa.Table:
    import ray

    out = _expand(batch, cfg_json=cfg_json, block_size=block_size, mask_token_id=mask_token_id)
    time.sleep(BLOCK_DELAY_S)
    marks = node_dir(json.loads(cfg_json)["output_dir"])
    marks.mkdir(parents=True, exist_ok=True)
    node = ray.get_runtime_context().get_node_id()
    (marks / f"{node}.{os.getpid()}.{uuid.uuid4().hex}").write_text(str(batch.num_rows))
    return out


def marked_nodes(output_dir: str) -> list[str]:
    """The node id of every expanded block so far (one entry per block, retried blocks counted again)."""
    d = node_dir(output_dir)
    return [f.name.split(".")[0] for f in d.iterdir()] if d.is_dir() else []


# ---------------------------------------------------------------- training

STEP_DELAY_S = 0.5
_batches = train_multitf.worker_batches
_loop = train_multitf.train_loop


def _slow_batches(config: dict, cfg: TrainConfig, mcfg, device, start: int):
    """The trainer's micro-batches (on the fly or from Parquet), each a little later, leaving a marker
    `<rank>.<step>.<pid>` in `<run dir>.steps/` as each step's first micro-batch is drawn."""
    import ray

    marks = Path(cfg.run.run_dir + ".steps")
    marks.mkdir(parents=True, exist_ok=True)
    rank = ray.train.get_context().get_world_rank()
    for i, batch in enumerate(_batches(config, cfg, mcfg, device, start)):
        if i % cfg.deepspeed.grad_accum == 0:
            (marks / f"{rank}.{start + 1 + i // cfg.deepspeed.grad_accum}.{os.getpid()}").touch()
        time.sleep(STEP_DELAY_S)
        yield batch


def loop_marking_node(config: dict) -> None:
    """The trainer's loop as each Ray Train worker runs it, after leaving a marker `<rank>.<node id>.<pid>` in
    `<run dir>.nodes/`; each micro-batch takes a little longer, so that a node can be removed mid-run."""
    import ray

    cfg = TrainConfig.model_validate(config["cfg"])
    marks = node_dir(cfg.run.run_dir)
    marks.mkdir(parents=True, exist_ok=True)
    rank = ray.train.get_context().get_world_rank()
    (marks / f"{rank}.{ray.get_runtime_context().get_node_id()}.{os.getpid()}").touch()
    train_multitf.worker_batches = _slow_batches
    _loop(config)


def steps_started(run_dir: str) -> dict[int, set[int]]:
    """Worker pid -> the steps it started (drew a batch for), from `_slow_batches`' markers."""
    d = Path(run_dir + ".steps")
    out: dict[int, set[int]] = {}
    for f in d.iterdir() if d.is_dir() else []:
        _, step, pid = f.name.split(".")
        out.setdefault(int(pid), set()).add(int(step))
    return out


def worker_nodes(run_dir: str) -> list[tuple[int, str]]:
    """(rank, node id) of every training worker started so far, in start order."""
    d = node_dir(run_dir)
    files = sorted(d.iterdir(), key=lambda f: f.stat().st_mtime_ns) if d.is_dir() else []
    return [(int(f.name.split(".")[0]), f.name.split(".")[1]) for f in files]
