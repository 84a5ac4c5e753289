"""The system rows of `benchmarks.gpu_acceptance`: DeepSpeed ZeRO-2 training steps (dense and FlexAttention masks),
and one served request.

Training runs DeepSpeed in this process (one rank) on the MultiTF objective with the trainer's own pieces
(`DeepSpeedSection.ds_config`, `OnTheFlyRows`, `collate`, `compute_objective`), so it needs no Ray cluster;
`mbd train`'s Ray Train path is covered by the integration tests. The served request goes through the real
Ray Serve application over HTTP.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.hf_baseline import random_sdar
from benchmarks.step_floor import sync
from mbd.flops import matmul_rate, train_flops_per_token
from mbd.plan import TrainShape, zero_states

TINY = "mbd/assets/tiny"
SERVE_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "serve" / "tiny.yaml"


def free_port() -> int:
    """A free local port (without importing Ray: only the served-request row may)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def training_sequences(vocab: int, n: int, length: int, block: int, seed: int = 0):
    """Sequences over 16 distinct tokens (a random model starts near ln(vocab) and learns that quickly)."""
    from mbd.multitf.batching import TokenizedSequence

    rng = np.random.default_rng(seed)
    alphabet = rng.choice(vocab - 4, size=16, replace=False) + 2
    prompt = length // 4 // block * block
    return [TokenizedSequence(i, rng.choice(alphabet, size=length).astype(np.int32), prompt, length - prompt)
            for i in range(n)]


def allocated_zero2(optimizer) -> tuple[int, int]:
    """(parameter bytes, optimizer-state bytes) DeepSpeed's ZeRO-1/2 optimizer holds: the flat 16-bit (or fp32)
    parameter groups; the fp32 master partitions and every tensor of the wrapped optimizer's state."""
    params = sum(t.numel() * t.element_size() for t in optimizer.bit16_groups_flat)
    master = sum(t.numel() * t.element_size() for t in optimizer.single_partition_of_fp32_groups)
    state = sum(v.numel() * v.element_size() for s in optimizer.optimizer.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0)
    return params, master + state


def zero2_steps(size: str, device: str, steps: int, rows: int, length: int, attention: str = "dense") -> dict:
    """`steps` ZeRO-2 steps of MultiTF CE on a random SDAR of `size` with the dual-stream mask as `attention`
    (dense SDPA or FlexAttention, which has a backward only on GPUs): the losses and the plan vs what DeepSpeed
    allocated."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device == "cuda" else "cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    import deepspeed
    import torch.distributed as dist

    from mbd.multitf.batching import LayoutSection, OnTheFlyRows, collate, rows_to_columns
    from mbd.multitf.objectives import ObjectiveSection, compute_objective
    from mbd.train_config import DeepSpeedSection
    from pipelines.deepspeed_dist import init_distributed

    block = 4
    model, cfg = random_sdar(size, block, max_len=2 * length, temper=1.0)
    use_gpu = device == "cuda"
    ds = DeepSpeedSection(zero_stage=2, micro_batch_size=rows, lr=1e-3)
    model = model.to(device, torch.bfloat16 if ds.use_bf16(use_gpu) else torch.float32).train()
    init_distributed(use_gpu)
    try:
        optimizer = torch.optim.AdamW(model.parameters(), **ds.adamw_kwargs())
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds.ds_config(use_gpu))
        data = OnTheFlyRows(training_sequences(cfg.vocab_size, 4 * rows, length, block), LayoutSection(gmax=2),
                            block_size=block, mask_token_id=cfg.mask_token_id, seed=0)
        losses, times = [], []
        for step in range(steps):
            sync(device)
            t0 = time.perf_counter()
            idx = [(step * rows + i) % data.rows_per_epoch for i in range(rows)]
            batch = collate(rows_to_columns(data.rows(0, idx)), block_size=block, pad_token_id=cfg.pad_token_id,
                            attention=attention, device=device)
            out = compute_objective(engine, batch, ObjectiveSection(), cfg.mask_token_id)
            engine.backward(out.loss)
            engine.step()
            losses.append(float(out.loss.detach()))
            sync(device)
            times.append(time.perf_counter() - t0)
        n_params = sum(p.numel() for p in model.parameters())
        tokens_s = rows * 2 * length / statistics.median(times[1:])  # the dual stream: 2 x length tokens per row
        params, states = allocated_zero2(optimizer)
        plan = {i.name: i.bytes for i in zero_states(n_params, TrainShape(1, 2, ds.use_bf16(use_gpu), rows, length))}
        error = max(abs(plan["parameters"] - params) / params, abs(plan["optimizer states"] - states) / states)
        flops = train_flops_per_token(model) * tokens_s
        return {"model": f"random SDAR {size} ({n_params / 1e6:.1f}M)", "losses": losses, "first_loss": losses[0],
                "last_loss": losses[-1], "finite": all(np.isfinite(losses)), "plan_error": error,
                "tokens_s": tokens_s, "mfu": flops / matmul_rate(device, torch.bfloat16 if use_gpu else torch.float32),
                "allocated": {"parameters": params, "optimizer states": states},
                "planned": {"parameters": plan["parameters"], "optimizer states": plan["optimizer states"]}}
    finally:
        dist.destroy_process_group()


def served_request(device: str) -> dict:
    """The tiny model behind Ray Serve (on `device`), one completion over HTTP, compared with the engine."""
    import httpx
    import ray
    from ray import serve

    from mbd.config import load_yaml
    from mbd.decoding.spec import build_engine
    from pipelines.ray_session import init_ray
    from serve_app.app import build_app
    from serve_app.config import ServeConfig

    cuda = device == "cuda"
    cfg = load_yaml(SERVE_CONFIG, ServeConfig)
    engine_cfg = cfg.engine.model_copy(update={"device": device, "dtype": "bfloat16" if cuda else "float32"})
    model = cfg.model.model_copy(update={"num_gpus_per_rank": 1 if cuda else 0, "num_cpus_per_rank": 0.5})
    cfg = cfg.model_copy(update={"model": model, "engine": engine_cfg})
    engine = build_engine(TINY, cfg.decode, engine_cfg)
    prompt = "12+7="
    want = engine.generate([engine.tokenizer.encode(prompt)], {"max_new_tokens": 16})[0]
    port = free_port()
    for attempt in (1, 2, 3):  # a loaded machine can miss the raylet's fixed 30 s registration window: retry
        try:
            init_ray(num_cpus=2, num_gpus=1 if cuda else 0, object_store_memory=200 * 1024**2)
            break
        except Exception as e:
            ray.shutdown()
            if attempt == 3 or "timed out during startup" not in str(e):
                raise
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"serve_config": cfg}), name="acceptance", route_prefix="/")
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"model": model.name, "prompt": prompt, "max_tokens": 16, "return_token_ids": True})
        got = r.json()["choices"][0]["token_ids"] if r.status_code == 200 else None
        return {"status": r.status_code, "tokens": len(got or []), "equal": got == want.token_ids,
                "text": r.json()["choices"][0]["text"] if got is not None else r.text}
    finally:
        serve.shutdown()
        ray.shutdown()


def train_row(attention: str):
    """20 ZeRO-2 steps (dense) or 5 (flex, compared with the dense run's first 5 by the orchestrator), in a process
    of its own: DeepSpeed initialises its process groups once per process."""
    def row(s, device: str, out: Path):
        from benchmarks.acceptance_rows import SKIPPED, Row

        if attention == "flex" and device != "cuda":
            return Row("ZeRO-2 steps, flex dual-stream mask", SKIPPED, "FlexAttention has no backward on CPU")
        r = zero2_steps(s.train_model, device, steps=20 if attention == "dense" else 5, rows=s.train_rows,
                        length=s.train_len, attention=attention)
        ok = r["finite"] and (attention == "flex" or (r["last_loss"] < r["first_loss"] and r["plan_error"] <= 0.05))
        detail = (f"{r['model']}: loss {r['first_loss']:.3f} -> {r['last_loss']:.3f} over {len(r['losses'])} steps; "
                  f"{r['tokens_s']:.0f} training tokens/s, MFU {100 * r['mfu']:.1f}%; plan vs allocated "
                  f"{100 * r['plan_error']:.2f}% off")
        return Row(f"ZeRO-2 steps, {attention} dual-stream mask", "PASS" if ok else "FAIL", detail, data=r)
    return row


def serve_row(s, device: str, out: Path):
    """One request through Ray Serve over HTTP, equal to the engine called directly; the one row importing Ray."""
    from benchmarks.acceptance_rows import Row

    try:
        import ray  # noqa: F401
    except ImportError:
        return Row("one request served (Ray Serve, HTTP)", "skipped (no ray)", "Ray is not installed here")
    r = served_request(device)
    return Row("one request served (Ray Serve, HTTP)", "PASS" if r["equal"] else "FAIL",
               f"HTTP {r['status']}, {r['tokens']} tokens, equal to the engine called directly: {r['equal']}", data=r)
