"""Shared setup of the training integration tests: a tiny model with the char-level tokenizer, a small
prompt/response corpus, a TrainConfig factory, a plain single-process reference training loop, and the
test-side fault injection of the fault-tolerance test."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from mbd.model import build_model, load_checkpoint, save_checkpoint
from mbd.multitf.batching import OnTheFlyRows, StepSampler, collate, rows_to_columns
from mbd.multitf.objectives import compute_objective
from mbd.tiny.vocab import save_tokenizer, special_token_ids
from mbd.train_config import TrainConfig
from pipelines import train_multitf
from pipelines.train_multitf import tokenize_corpus
from tests.conftest import tiny_cfg


def make_model_and_corpus(root: Path, records: int = 48, family: str = "sdar") -> tuple[Path, Path]:
    ids = special_token_ids()
    cfg = tiny_cfg(family, mask_token_id=ids["mask_token_id"], eos_token_id=ids["eos_token_id"],
                   pad_token_id=ids["pad_token_id"])
    model_dir = root / "model"
    save_checkpoint(build_model(cfg, seed=0), cfg, model_dir)
    save_tokenizer(model_dir)
    rng = random.Random(0)
    corpus = root / "corpus.jsonl"
    with open(corpus, "w") as fh:
        for _ in range(records):
            a, b = rng.randint(0, 60), rng.randint(0, 60)
            fh.write(json.dumps({"prompt": f"{a}+{b}", "response": f"{a}+{b}={a + b}"}) + "\n")
    return model_dir, corpus


def train_config(name: str, storage: Path, model_dir: Path, corpus: Path, **overrides) -> TrainConfig:
    data = {
        "run": {"name": name, "storage_path": str(storage)},
        "model_path": str(model_dir),
        "data": {"jsonl": str(corpus), "max_length": 64, "probe_rows": 4},
        "layouts": {"gmax": 3, "n_rand": 1},
        "deepspeed": {"zero_stage": 2, "micro_batch_size": 2, "grad_accum": 2, "lr": 3e-3, "warmup_steps": 1,
                      "grad_clip": 0.5},
        "steps": 4, "checkpoint_every": 4, "num_workers": 2, "cpus_per_worker": 0.5, "seed": 5,
    }
    for key, value in overrides.items():
        node = data
        *parents, leaf = key.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return TrainConfig.model_validate(data)


def reference_run(cfg: TrainConfig) -> tuple[list[float], torch.nn.Module]:
    """The same training without Ray or DeepSpeed: one process, the whole global batch per step."""
    model, mcfg = load_checkpoint(cfg.model_path)
    model.train()
    ds = cfg.deepspeed
    seqs, _ = tokenize_corpus(cfg.data.jsonl, cfg.model_path, mcfg.block_size, cfg.data.max_length)
    rows = OnTheFlyRows(seqs, cfg.layouts, block_size=mcfg.block_size, mask_token_id=mcfg.mask_token_id,
                        seed=cfg.seed)
    sampler = StepSampler(rows.rows_per_epoch, ds.micro_batch_size, ds.grad_accum, cfg.num_workers, cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), **ds.adamw_kwargs())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: ds.lr_factor(s, cfg.steps))
    parts = ds.grad_accum * cfg.num_workers
    losses = []
    for step in range(1, cfg.steps + 1):
        total = 0.0
        for micro in range(ds.grad_accum):
            for rank in range(cfg.num_workers):
                epoch, idx = sampler.micro_rows(step, rank, micro)
                batch = collate(rows_to_columns(rows.rows(epoch, idx)), block_size=mcfg.block_size,
                                pad_token_id=mcfg.pad_token_id)
                out = compute_objective(model, batch, cfg.objective, mcfg.mask_token_id)
                (out.loss / parts).backward()
                total += float(out.loss.detach()) / parts
        if ds.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), ds.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model


def probe_batch(cfg: TrainConfig):
    """The probe rows the trainer measures `probe_loss` on (the first rows of epoch 0)."""
    _, mcfg = load_checkpoint(cfg.model_path)
    seqs, _ = tokenize_corpus(cfg.data.jsonl, cfg.model_path, mcfg.block_size, cfg.data.max_length)
    rows = OnTheFlyRows(seqs, cfg.layouts, block_size=mcfg.block_size, mask_token_id=mcfg.mask_token_id,
                        seed=cfg.seed)
    return collate(rows_to_columns(rows.rows(0, range(cfg.data.probe_rows))), block_size=mcfg.block_size,
                   pad_token_id=mcfg.pad_token_id), mcfg


def step_losses(history: list[dict]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for m in history:
        if "loss" in m:
            out.setdefault(int(m["step"]), []).append(m["loss"])
    return out


FAIL_AT = 4
FAULT_MARKER = ".injected_failure"  # in the run dir: the failure happens once, not again after the restart
_batches = train_multitf.on_the_fly_batches  # the real ones, as a worker process imports them
_loop = train_multitf.train_loop


def _batches_failing_once(cfg, mcfg, rows, rank, world, first_step, device):
    """The worker's on-the-fly batches, except that the last rank raises once when step FAIL_AT asks for its
    first micro-batch (a marker file in the run dir makes it once: the restarted group runs through)."""
    for i, batch in enumerate(_batches(cfg, mcfg, rows, rank, world, first_step, device)):
        marker = Path(cfg.run.run_dir) / FAULT_MARKER
        if first_step + i // cfg.deepspeed.grad_accum == FAIL_AT and rank == world - 1 and not marker.exists():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
            raise RuntimeError(f"injected worker failure at step {FAIL_AT} (rank {rank})")
        yield batch


def loop_with_fault(config):
    """Fault injection for tests, given to the trainer in place of `train_loop` (monkeypatch in the driver). It
    runs in each Ray Train worker, a process of its own that a driver-side patch does not reach: it patches that
    process's batch source, then trains as usual. Lives here, not in the test module, because workers import it
    by module name and pytest imports test modules under their bare file name."""
    train_multitf.on_the_fly_batches = _batches_failing_once
    _loop(config)
