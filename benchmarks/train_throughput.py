"""Training throughput of ZeRO-2 vs ZeRO-3 through the real `run_train` path (Ray Train + DeepSpeed, gloo).

    python -m benchmarks.train_throughput [--steps 30] [--workers 2] [--hidden 128] [--layers 4]

A randomly initialised SDAR-family model of the embedded tiny model's shape, the synthetic task's training
split expanded on the fly (MultiTF, Gmax 4, N_rand 2). tokens/s counts the non-pad tokens of both streams
of the dual-stream input, all workers together; the median over steps after the first `--skip` (warm-up)
is reported, with ZeRO-3 / ZeRO-2 measured in the same process (the machine is shared: compare ratios;
`--repeats 2` runs the stages in ABBA order and keeps each stage's median).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import ray

from mbd.config import ModelConfig
from mbd.model import build_model, save_checkpoint
from mbd.tiny.task import generate, write_jsonl
from mbd.tiny.vocab import save_tokenizer, special_token_ids, vocab
from mbd.train_config import TrainConfig
from pipelines.ray_session import init_ray
from pipelines.train_multitf import run_train


def setup(root: Path, hidden: int, layers: int) -> tuple[Path, Path]:
    ids = special_token_ids()
    cfg = ModelConfig(family="sdar", vocab_size=len(vocab()), hidden_size=hidden, intermediate_size=3 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=hidden // 4, mask_token_id=ids["mask_token_id"], eos_token_id=ids["eos_token_id"],
                      pad_token_id=ids["pad_token_id"], block_size=4, max_position_embeddings=256)
    model_dir = root / "model"
    save_checkpoint(build_model(cfg, seed=0), cfg, model_dir)
    save_tokenizer(model_dir)
    corpus = write_jsonl(root / "train.jsonl", generate("pretrain", 512, seed=0))
    return model_dir, corpus


def measure(root: Path, model_dir: Path, corpus: Path, stage: int, index: int, args) -> dict[str, float]:
    cfg = TrainConfig.model_validate({
        "run": {"name": f"bench-zero{stage}-{index}", "storage_path": str(root / "runs")},
        "model_path": str(model_dir),
        "data": {"jsonl": str(corpus), "max_length": 128},
        "layouts": {"gmax": 4, "n_rand": 2},
        "deepspeed": {"zero_stage": stage, "micro_batch_size": args.micro_batch, "lr": 1e-3},
        "steps": args.steps, "checkpoint_every": args.steps, "num_workers": args.workers,
        "cpus_per_worker": 2 / args.workers if args.workers > 2 else 1,
    })
    summary = run_train(cfg, show_progress=False)
    steps = [m for m in summary.history if "loss" in m][args.skip:]
    return {"zero_stage": stage, "tokens_per_s": statistics.median(m["tokens_per_s"] for m in steps),
            "step_s": statistics.median(m["step_s"] for m in steps), "tokens_per_step": steps[0]["tokens"],
            "final_loss": steps[-1]["loss"], "wall_s": summary.wall_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--micro-batch", dest="micro_batch", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1, help="runs per stage, in ABBA order")
    args = ap.parse_args()
    init_ray(num_cpus=max(2, args.workers), log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir, corpus = setup(root, args.hidden, args.layers)
        order = [s for i in range(args.repeats) for s in ((2, 3) if i % 2 == 0 else (3, 2))]
        runs = [measure(root, model_dir, corpus, stage, i, args) for i, stage in enumerate(order)]
    rows = []
    for stage in (2, 3):
        mine = [r for r in runs if r["zero_stage"] == stage]
        rows.append({**mine[0], "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                     "step_s": statistics.median(r["step_s"] for r in mine)})
    ray.shutdown()
    print(f"{'ZeRO':>5} {'tokens/s':>10} {'step s':>8} {'tokens/step':>12} {'final loss':>10}")
    for r in rows:
        print(f"{r['zero_stage']:>5} {r['tokens_per_s']:>10.0f} {r['step_s']:>8.3f} {r['tokens_per_step']:>12.0f} "
              f"{r['final_loss']:>10.4f}")
    print(f"ZeRO-3 / ZeRO-2 tokens/s: {rows[1]['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
