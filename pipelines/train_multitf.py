"""Ray Train + DeepSpeed ZeRO: MultiTF post-training (or block-diffusion TF pretraining) from a YAML config.

    mbd train --config configs/train/tiny_cpu.yaml [--set steps=20 --set deepspeed.zero_stage=3]
    ray job submit --working-dir . -- python -m pipelines.train_multitf --config configs/train/x.yaml

Driver (`run_train`): validates the config, prepares the data (Ray Data Parquet dataset, or the tokenized
JSONL corpus in the object store for on-the-fly expansion), starts a `TorchTrainer`, shows the progress line
(pipelines/train_progress.py), and copies the final checkpoint's HF model to the export directory.

Worker (`train_loop`): every worker calls `deepspeed.initialize` (ZeRO 2 or 3) on Ray Train's process
group (gloo on CPU, NCCL on GPU) with a plain torch AdamW and warm-up + cosine LambdaLR, so no compiled
DeepSpeed op is needed. Every `checkpoint_every` steps each rank writes its DeepSpeed shard and rank 0
adds a gathered HF safetensors snapshot (`model/`); all ranks report the same checkpoint, which Ray Train
merges into one directory. A restarted worker group (FailureConfig) or a re-run with the same
RunConfig(name, storage_path) resumes from `ray.train.get_checkpoint()`.

Noise on every pass: pass p over the data trains on rows drawn with epoch key `epoch + p` (on-the-fly rows by
the step sampler's epoch; Parquet rows redrawn from their stored clean tokens and recipe, `rows.redraw_columns`),
so no pass replays another's masks, as the authors' data transform redraws noise on every access.

Data order on resume: on-the-fly rows are a pure function of (seed, step, rank), so a resumed run trains on
exactly the rows an uninterrupted one would. So do Parquet shards: Ray Data reads a fixed number of blocks in
order (`preserve_order`, which also makes the streaming split hand each worker the same rows on any cluster), the
shuffle buffer is seeded per pass, and a resumed worker skips the micro-batches its pass had already trained on.

Step metrics (rank 0, all-reduced over workers): loss, ce/<layout kind>, ce/slot<i> (slot inside the
noise-group), masked_tokens, tokens_per_s (tokens of both streams, batch padding excluded), lr; `probe_loss` (the
objective on a fixed batch of training rows) at step 0 and at every checkpoint, step_s and mfu (model FLOPs,
`mbd.flops`, over the workers' measured matrix rate). Every step's metrics go to the driver's progress line (a
fire-and-forget push to a small actor); `ray.train.report` gets them at checkpoints only, with the checkpoint. A
report is a barrier across ranks whose result the controller takes from a one-slot queue at its poll (2 s by
default), so a report every step capped training at one step per poll (measured: the quickstart's 800 steps at
0.5 steps/s, 0.5 s of work per step).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import ray
import torch
from pydantic import BaseModel
from ray.data.collate_fn import NumpyBatchCollateFn
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from mbd import storage
from mbd.checkpoint_files import read_model_config
from mbd.config import ConfigError, ModelConfig, load_yaml
from mbd.flops import matmul_rate, train_flops_per_token
from mbd.hub import resolve_model
from mbd.multitf.batching import Batch, OnTheFlyRows, StepSampler, collate, rows_to_columns
from mbd.multitf.objectives import compute_objective, loss_stats, stats_metrics, stats_size
from mbd.multitf.records import BadRecord, load_tokenizer, tokenize_record
from mbd.multitf.rows import TokenizedSequence, redraw_columns
from mbd.plan_check import check_train
from mbd.train_config import TrainConfig
from pipelines.parquet import read_parquet
from pipelines.ray_session import init_ray, ray_session
from pipelines.train_progress import Progress, follow, one_time_note

__all__ = ["run_train", "TrainSummary", "main"]  # what other pipelines may use

SHUFFLE_BUFFER_ROWS = 4096  # rows each worker draws its Parquet micro-batches from at random
READ_BLOCKS = 32  # Parquet blocks of a pass: fixed, so the split is the same whatever the cluster's CPUs


class TrainSummary(BaseModel):
    run_dir: str
    last_step: int
    checkpoint: str | None
    export_dir: str | None
    final: dict[str, float]
    history: list[dict[str, float]]  # rank-0 step metrics in the order they happened (restarts included)
    wall_s: float
    skipped_records: dict[str, int]  # records left out, per reason (as `mbd expand`'s quarantine; too_long included)


# ---------------------------------------------------------------- worker side

class RowCollate(NumpyBatchCollateFn):
    """Ray Data numpy batch (ragged list columns) -> `Batch` with the dual-stream mask, its noise redrawn for
    training pass `pass_index`."""

    def __init__(self, mcfg: ModelConfig, attention: str, device: torch.device, pass_index: int):
        super().__init__()
        self.pass_index, self.mcfg = pass_index, mcfg
        self.kw = dict(block_size=mcfg.block_size, pad_token_id=mcfg.pad_token_id, attention=attention, device=device)

    def __call__(self, batch: dict[str, np.ndarray]) -> Batch:
        rows = redraw_columns(batch, self.pass_index, block_size=self.mcfg.block_size,
                              mask_token_id=self.mcfg.mask_token_id)
        return collate(rows, **self.kw)


def parquet_batches(cfg: TrainConfig, mcfg: ModelConfig, device: torch.device, first_pass: int,
                    skip: int) -> Iterator[Batch]:
    """Endless micro-batches of this worker's shard, from micro-batch `skip` of pass `first_pass` on (the skipped
    ones are drawn and dropped: the shuffle buffer's order depends on them); equal shard sizes keep the workers in
    step."""
    shard = ray.train.get_dataset_shard("train")
    epoch = first_pass
    while True:
        drawn = 0
        fn = RowCollate(mcfg, cfg.attention, device, epoch)
        # `mbd expand` writes a sequence's |Lambda| layouts next to each other: without a shuffle buffer a
        # micro-batch would hold the layouts of one or two sequences (what it costs MBD-tiny: docs/reproduce.md)
        for batch in shard.iter_torch_batches(batch_size=cfg.deepspeed.micro_batch_size, collate_fn=fn,
                                              drop_last=True, local_shuffle_buffer_size=SHUFFLE_BUFFER_ROWS,
                                              local_shuffle_seed=cfg.seed + epoch):
            drawn += 1
            if drawn > skip:
                yield batch
        epoch, skip = epoch + 1, 0
        if not drawn:
            raise ValueError(f"data.parquet: this worker's shard has fewer than micro_batch_size="
                             f"{cfg.deepspeed.micro_batch_size} rows; add data or lower num_workers")


def on_the_fly_batches(cfg: TrainConfig, mcfg: ModelConfig, rows: OnTheFlyRows, rank: int, world: int,
                       first_step: int, device: torch.device) -> Iterator[Batch]:
    ds = cfg.deepspeed
    sampler = StepSampler(rows.rows_per_epoch, ds.micro_batch_size, ds.grad_accum, world, cfg.seed)
    for step in range(first_step, cfg.steps + 1):
        for micro in range(ds.grad_accum):
            epoch, idx = sampler.micro_rows(step, rank, micro)
            yield collate(rows_to_columns(rows.rows(epoch, idx)), block_size=mcfg.block_size,
                          pad_token_id=mcfg.pad_token_id, attention=cfg.attention, device=device)


def gathered(engine, zero_stage: int):
    """Context in which every rank holds the full parameters (ZeRO-3 partitions them; ZeRO-2 does not)."""
    if zero_stage != 3:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)


def save_training_checkpoint(engine, cfg: TrainConfig, mcfg: ModelConfig, step: int, rank: int,
                             metrics: dict[str, float]) -> None:
    """All ranks: DeepSpeed shards + (rank 0) HF snapshot, reported as one Ray Train checkpoint."""
    from mbd.model import save_checkpoint
    from mbd.model.checkpoint import copy_tokenizer_files
    from mbd.training_record import TrainingRecord, write_record

    tmp = Path(tempfile.mkdtemp(prefix=f"mbd-ckpt-{step}-r{rank}-"))
    try:
        engine.save_checkpoint(str(tmp / "deepspeed"), tag=f"step_{step}", client_state={"step": step})
        with gathered(engine, cfg.deepspeed.zero_stage):
            if rank == 0:
                save_checkpoint(engine.module, mcfg, tmp / "model")
        if rank == 0:
            copy_tokenizer_files(cfg.model_path, tmp / "model")
            write_record(tmp / "model", TrainingRecord(
                layouts=cfg.layouts.mode, objective=cfg.objective.name, block_size=mcfg.training_block_size(),
                steps=step, base_model=cfg.model_path, data=cfg.data.parquet or cfg.data.jsonl or ""))
            (tmp / "train_state.json").write_text(json.dumps({"step": step, "metrics": metrics}))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(tmp)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def init_engine(cfg: TrainConfig) -> tuple[Any, ModelConfig, torch.device]:
    """This worker's DeepSpeed engine (ZeRO 2 or 3 on Ray Train's process group) around the model, a plain torch
    AdamW and the warm-up + cosine schedule; also its device and the model's config."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if cfg.use_gpu else "cpu")
    import deepspeed

    from mbd.model import load_checkpoint
    from pipelines.deepspeed_dist import init_distributed

    torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))
    init_distributed(cfg.use_gpu)
    device = ray.train.torch.get_device() if cfg.use_gpu else torch.device("cpu")
    ds = cfg.deepspeed
    model, mcfg = load_checkpoint(cfg.model_path, dtype=torch.bfloat16 if ds.use_bf16(cfg.use_gpu) else torch.float32)
    model.train()
    if ds.zero_stage == 3 and mcfg.family == "llada2_moe":
        # Experts run only on the tokens routed to them; fetching each expert's ZeRO-3 partition inside the
        # loop would make ranks issue different all-gathers. Fetch the whole MoE block at once instead.
        from mbd.model.llada2_moe import LLaDA2SparseMoE

        deepspeed.utils.set_z3_leaf_modules(model, [LLaDA2SparseMoE])
    optimizer = torch.optim.AdamW(model.parameters(), **ds.adamw_kwargs())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: ds.lr_factor(s, cfg.steps))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule,
                                      config=ds.ds_config(cfg.use_gpu))
    return engine, mcfg, device


def resumed_step(engine) -> int:
    """The step of Ray Train's latest checkpoint, loaded into `engine` (0 on a fresh run)."""
    ckpt = ray.train.get_checkpoint()
    if ckpt is None:
        return 0
    with ckpt.as_directory() as d:
        _, client = engine.load_checkpoint(str(Path(d) / "deepspeed"))
    return int(client["step"])


def worker_batches(config: dict[str, Any], cfg: TrainConfig, mcfg: ModelConfig, device: torch.device,
                   start: int) -> Iterator[Batch]:
    """This worker's micro-batches from step `start + 1` on: rows built on the fly, or its Parquet shard from the
    micro-batch a resumed run had reached (its shard: rows // workers, the streaming split's equal share; a pass:
    the shard's whole micro-batches)."""
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if config["sequences"] is not None:
        rows = OnTheFlyRows(ray.get(config["sequences"]), cfg.layouts, block_size=mcfg.block_size,
                            mask_token_id=mcfg.mask_token_id, seed=cfg.seed)
        return on_the_fly_batches(cfg, mcfg, rows, rank, world, start + 1, device)
    ds = cfg.deepspeed
    per_pass = max(config["parquet_rows"] // world // ds.micro_batch_size, 1)  # 0: parquet_batches refuses it
    return parquet_batches(cfg, mcfg, device, *divmod(start * ds.grad_accum, per_pass))


def train_step(engine, batches: Iterator[Batch], cfg: TrainConfig, mcfg: ModelConfig, device: torch.device,
               step: int) -> dict[str, float]:
    """One optimiser step over grad_accum micro-batches; its metrics all-reduced over the workers."""
    import torch.distributed as dist

    world = dist.get_world_size()

    def global_sum(x: torch.Tensor) -> torch.Tensor:  # the self-normalised SDAR loss's denominator
        x = x.clone()
        dist.all_reduce(x)
        return x

    ds, slots = cfg.deepspeed, cfg.layouts.max_slots
    t0 = time.perf_counter()
    lr = float(engine.optimizer.param_groups[0]["lr"])
    stats = torch.zeros(stats_size(slots), dtype=torch.float64, device=device)
    extra = torch.zeros(4, dtype=torch.float64, device=device)  # loss, tokens, OPUT standard, OPUT self-denoise
    for _ in range(ds.grad_accum):
        batch = next(batches)
        out = compute_objective(engine, batch, cfg.objective, mcfg.mask_token_id, global_sum, world)
        engine.backward(out.loss)
        engine.step()
        stats += loss_stats(batch, out.ce, out.masked, slots)
        extra += torch.tensor([float(out.loss.detach()), 2.0 * float(batch.total_len.sum()),
                               out.parts.get("loss_standard", 0.0), out.parts.get("loss_self_denoise", 0.0)],
                              dtype=torch.float64, device=device)
    both = torch.cat([stats, extra])
    dist.all_reduce(both)
    seconds = time.perf_counter() - t0
    stats, extra = both[: stats.numel()], both[stats.numel():].tolist()
    micro_total = ds.grad_accum * world
    metrics = {"step": step, "loss": extra[0] / micro_total, "lr": lr, "tokens": extra[1],
               "tokens_per_s": extra[1] / seconds, "step_s": seconds, **stats_metrics(stats, slots)}
    if cfg.objective.name == "dmax_oput":
        metrics |= {"loss_standard": extra[2] / micro_total, "loss_self_denoise": extra[3] / micro_total}
    return metrics


def train_loop(config: dict[str, Any]) -> None:
    """Ray Train's worker function: steps from the last checkpoint (or 0) to cfg.steps, checkpointing every
    checkpoint_every steps; every step's metrics go (rank 0) to the progress actor, Ray Train's with checkpoints."""
    cfg = TrainConfig.model_validate(config["cfg"])
    engine, mcfg, device = init_engine(cfg)
    rank = ray.train.get_context().get_world_rank()
    start = resumed_step(engine)
    progress = config["progress"]
    probe = collate(config["probe_rows"], block_size=mcfg.block_size, pad_token_id=mcfg.pad_token_id,
                    attention=cfg.attention, device=device)

    def probe_loss() -> float:
        with torch.no_grad():
            return float(compute_objective(engine, probe, cfg.objective, mcfg.mask_token_id).loss)

    batches = worker_batches(config, cfg, mcfg, device, start)
    dtype = torch.bfloat16 if cfg.deepspeed.use_bf16(cfg.use_gpu) else torch.float32
    peak = matmul_rate(device.type, dtype) * ray.train.get_context().get_world_size()
    flops_per_token = train_flops_per_token(engine.module)
    if start == 0:
        initial = probe_loss()
        if rank == 0:
            progress.log.remote({"step": 0, "probe_loss": initial})
    for step in range(start + 1, cfg.steps + 1):
        metrics = train_step(engine, batches, cfg, mcfg, device, step)
        metrics["mfu"] = flops_per_token * metrics["tokens_per_s"] / peak
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            metrics["probe_loss"] = probe_loss()
            save_training_checkpoint(engine, cfg, mcfg, step, rank, metrics)
        if rank == 0:
            progress.log.remote(metrics)


# ---------------------------------------------------------------- driver side

def tokenize_corpus(path: str, model_path: str, block_size: int,
                    max_length: int) -> tuple[list[TokenizedSequence], dict[str, int]]:
    """JSONL records -> tokenized sequences exactly as `mbd expand` tokenizes them; bad records are skipped and
    counted per reason (an over-long record is left out, never truncated: a cut answer would teach the model to
    stop mid-answer)."""
    tok, _ = load_tokenizer(model_path)
    seqs: list[TokenizedSequence] = []
    skipped: dict[str, int] = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                seq_id, ids, p_len, r_len = tokenize_record(line, tok, block_size, max_length)
            except BadRecord as e:
                skipped[e.reason] = skipped.get(e.reason, 0) + 1
                continue
            seqs.append(TokenizedSequence(seq_id, np.asarray(ids, dtype=np.int32), p_len, r_len))
    return seqs, skipped


def absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """Resolve local paths against the driver's cwd: Ray workers start in their own working directory, and
    Ray Train wants an absolute storage path. URIs (`scheme://`) are left as they are. The model as everywhere
    (`mbd.hub.resolve_model`): the path as given, else under the repository root, else a Hub id's snapshot."""
    def resolve(p: str | None) -> str | None:
        return p if p is None or "://" in p else str(Path(p).resolve())

    out = cfg.model_copy(deep=True)
    out.run.storage_path = resolve(cfg.run.storage_path)
    out.model_path = str(resolve_model(cfg.model_path).resolve())
    out.data.jsonl = resolve(cfg.data.jsonl)
    out.data.parquet = resolve(cfg.data.parquet)
    return out


def prepare_data(cfg: TrainConfig, mcfg: ModelConfig) -> tuple[dict, Any, list[dict], dict[str, int]]:
    """(Ray datasets, object ref of on-the-fly sequences or None, probe rows, skipped records per reason;
    Parquet rows were filtered by `mbd expand`, whose quarantine holds its bad records)."""
    n = cfg.data.probe_rows
    if cfg.data.parquet is not None:
        if not Path(cfg.data.parquet).exists() and "://" not in cfg.data.parquet:
            raise ConfigError(f"data.parquet: {cfg.data.parquet} does not exist (run `mbd expand` first)")
        # read tasks take no CPU: the workers may hold every CPU of the cluster (after a node loss, say), and a
        # read task waiting for one would stall every worker's shard for good
        ds = read_parquet(cfg.data.parquet, override_num_blocks=READ_BLOCKS, num_cpus=0)
        ds.context.execution_options.preserve_order = True  # the probe: the first n rows, on every run
        probe = ds.take(n)
        return {"train": ds}, None, rows_to_columns(probe), {}
    if not Path(cfg.data.jsonl).is_file():
        raise ConfigError(f"data.jsonl: file not found: {cfg.data.jsonl}")
    seqs, skipped = tokenize_corpus(cfg.data.jsonl, cfg.model_path, mcfg.block_size, cfg.data.max_length)
    rows = OnTheFlyRows(seqs, cfg.layouts, block_size=mcfg.block_size, mask_token_id=mcfg.mask_token_id,
                        seed=cfg.seed)
    StepSampler(rows.rows_per_epoch, cfg.deepspeed.micro_batch_size, cfg.deepspeed.grad_accum,
                cfg.num_workers, cfg.seed)  # fails early if one epoch cannot fill a global batch
    probe = rows.rows(0, range(min(n, rows.rows_per_epoch)))
    return {}, ray.put(seqs), rows_to_columns(probe), skipped


def build_trainer(cfg: TrainConfig, config: dict[str, Any], datasets: dict):
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    scaling = ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu,
                            resources_per_worker=None if cfg.use_gpu else {"CPU": cfg.cpus_per_worker})
    fs, path = storage.filesystem(cfg.run.storage_path)  # a URI's own options (endpoint, ...) go to the filesystem
    run = RunConfig(name=cfg.run.name, storage_path=path, storage_filesystem=fs,
                    failure_config=FailureConfig(max_failures=cfg.max_failures),
                    checkpoint_config=CheckpointConfig(num_to_keep=cfg.run.keep_checkpoints))
    # the session's options (as Ray Train's default takes them, without its deprecation warning), in order: the same
    # rows to the same worker on every run, so a resumed pass replays them
    ingest = copy.deepcopy(ray.data.DataContext.get_current().execution_options)
    ingest.preserve_order = True
    return TorchTrainer(train_loop, train_loop_config=config, scaling_config=scaling, run_config=run,
                        datasets=datasets or None, dataset_config=DataConfig(execution_options=ingest))


def run_train(cfg: TrainConfig, show_progress: bool = True) -> TrainSummary:
    """Run (or resume) a training run on the current Ray cluster (`init_ray` if none is connected)."""
    from pipelines.export import export_checkpoint

    cfg = absolute_paths(cfg)
    if not (Path(cfg.model_path) / "config.json").is_file():
        raise ConfigError(f"model_path: {cfg.model_path} has no config.json (an HF-format model directory)")
    mcfg = read_model_config(cfg.model_path)
    mcfg.training_block_size()  # a config.json that names no block size is refused here, by name
    if not ray.is_initialized():
        init_ray()
    start = time.perf_counter()
    datasets, sequences, probe_rows, skipped = prepare_data(cfg, mcfg)
    # on the driver's node: a worker node that is lost must not take the run's step log with it
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    progress = Progress.options(scheduling_strategy=here).remote()
    config = {"cfg": cfg.model_dump(mode="json"), "progress": progress, "sequences": sequences,
              "probe_rows": probe_rows, "parquet_rows": datasets["train"].count() if datasets else 0}
    trainer = build_trainer(cfg, config, datasets)
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as e:  # re-raised in the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=fit, name="mbd-train-fit", daemon=True)
    thread.start()
    if show_progress:
        print(one_time_note(cfg), flush=True)
    history = follow(progress, thread, cfg.steps, cfg.run.name, show_progress)
    if "error" in outcome:
        raise outcome["error"]
    export_dir = None
    checkpoint = outcome["result"].checkpoint
    if checkpoint is not None:
        export_dir = cfg.run.export_dir or storage.join(cfg.run.run_dir, "export")
        with checkpoint.as_directory() as d, storage.local_dir_for(export_dir) as out:
            export_checkpoint(Path(d), out)
    lines = "".join(json.dumps(m) + "\n" for m in history)
    storage.append_text(storage.join(cfg.run.run_dir, "metrics.jsonl"), lines)
    steps = [m for m in history if "loss" in m]
    return TrainSummary(run_dir=cfg.run.run_dir, last_step=int(steps[-1]["step"]) if steps else 0,
                        checkpoint=checkpoint.path if checkpoint is not None else None, export_dir=export_dir,
                        final=steps[-1] if steps else {}, history=history,
                        wall_s=round(time.perf_counter() - start, 3), skipped_records=skipped)


# ---------------------------------------------------------------- CLI

def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mbd train", description="MultiTF training on Ray Train + DeepSpeed ZeRO.")
    ap.add_argument("--config", required=True, help="YAML TrainConfig (configs/train/*.yaml)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field, e.g. --set steps=10 --set deepspeed.zero_stage=3")
    ap.add_argument("--no-progress", action="store_true",
                    help="no redrawn progress line: a full one every 30 s (log-friendly)")
    args = ap.parse_args(argv)
    try:
        cfg = load_yaml(args.config, TrainConfig, sets=args.overrides)
        check_train(cfg)  # refuse a run whose ranks cannot hold it, before Ray starts or weights load
        local = "://" not in cfg.run.storage_path
        log_dir = Path(cfg.run.run_dir).resolve() if local else Path(tempfile.mkdtemp(prefix="mbd-train-"))
        with ray_session(log_dir):
            summary = run_train(cfg, show_progress=not args.no_progress)
    except ConfigError as e:
        print(f"mbd train: {e}", file=sys.stderr)
        return 2
    print(summary.model_dump_json(indent=2, exclude={"history"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
