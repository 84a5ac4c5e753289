"""Throughput of the MultiTF layout expansion, in training rows per second per CPU.

Two measurements in one run:
- core: `expand_sequence` + Arrow conversion (`rows_to_table`) in this single process, on synthetic
  sequences of length L (no tokenizer, no Ray): the per-CPU cost of the algorithm itself;
- job (with --ray): the whole Ray Data job (read JSONL, tokenize, expand, write Parquet) on a synthetic
  corpus with a small word-level tokenizer, on a local cluster with --cpus CPUs; rows/s is divided by
  the CPU count, and the job/core ratio shows the share lost to reading, tokenizing, writing and Ray.

    python -m benchmarks.expand_throughput                 # core only
    python -m benchmarks.expand_throughput --ray --cpus 2  # core + Ray job
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from mbd.multitf.corrupt import expand_sequence
from mbd.multitf.layouts import num_layouts
from mbd.multitf.schedulers import SchedulerConfig, build_scheduler
from pipelines.expand_layouts import rows_to_table
from pipelines.ray_session import init_ray

# (name, L, B, Gmax, N_rand): tab:appendix_train_hparams, SDAR-8B b32 and b4 rows
SETTINGS = [("sdar_b32", 2048, 32, 4, 3), ("sdar_b4", 2048, 4, 4, 2)]


def core_rows_per_s(length: int, block_size: int, gmax: int, n_rand: int, sequences: int) -> tuple[float, float]:
    """(rows/s of expand_sequence alone, rows/s including the Arrow conversion) on one CPU."""
    rng = np.random.default_rng(0)
    sched = build_scheduler(SchedulerConfig(name="chain_uniform", t_low=0.001, t_high=1.0, rho=0.1))
    seqs = []
    for i in range(sequences):
        prompt_len = int(rng.integers(64, 512))
        response_len = int(rng.integers(length // 2, length - prompt_len - block_size))
        padded = -(-(prompt_len + response_len) // block_size) * block_size
        seqs.append((rng.integers(0, 150000, padded).astype(np.int32), prompt_len, response_len, i))
    rows_to_table(expand_sequence(*seqs[0][:3], block_size=block_size, gmax=gmax, n_rand=n_rand, scheduler=sched,
                                  mask_token_id=151669, seed=0, seq_id=0, epoch=0))  # warm-up (lazy imports)
    t0 = time.perf_counter()
    all_rows = [expand_sequence(ids, p, r, block_size=block_size, gmax=gmax, n_rand=n_rand, scheduler=sched,
                                mask_token_id=151669, seed=0, seq_id=i, epoch=0) for ids, p, r, i in seqs]
    t1 = time.perf_counter()
    for rows in all_rows:
        rows_to_table(rows)
    t2 = time.perf_counter()
    n_rows = sequences * num_layouts(gmax, n_rand)
    return n_rows / (t1 - t0), n_rows / (t2 - t0)


def write_job_inputs(root: Path, sequences: int, length: int, block_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(500)]
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|pad|>", "<|mask|>", "[UNK]"]
    vocab = {w: i for i, w in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    (root / "model").mkdir()
    tok.save(str(root / "model" / "tokenizer.json"))
    (root / "model" / "config.json").write_text(json.dumps(dict(
        architectures=["SDARForCausalLM"], vocab_size=len(vocab), hidden_size=16, intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=2, eos_token_id=2, pad_token_id=3, mask_token_id=4,
        block_size=block_size)))
    rng = np.random.default_rng(1)
    with open(root / "corpus.jsonl", "w") as f:
        for _ in range(sequences):
            p, r = int(rng.integers(50, 400)), int(rng.integers(length // 2, length - 450))
            f.write(json.dumps({"prompt": " ".join(rng.choice(words, p)), "response": " ".join(rng.choice(words, r))}))
            f.write("\n")


def job_rows_per_s(cpus: int, sequences: int, length: int, block_size: int, gmax: int, n_rand: int) -> float:
    import ray

    from pipelines.expand_layouts import ExpandConfig, run_expand

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_job_inputs(root, sequences, length, block_size)
        init_ray(num_cpus=cpus, log_to_driver=False)
        try:
            s = run_expand(ExpandConfig(inputs=[str(root / "corpus.jsonl")], output_dir=str(root / "out"),
                                        model_dir=str(root / "model"), max_length=length, gmax=gmax,
                                        n_rand=n_rand))
        finally:
            ray.shutdown()
    print(f"  job summary: {s.sequences_in} sequences, {s.rows_out} rows, {s.elapsed_s:.1f} s")
    return s.rows_per_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--ray", action="store_true", help="also run the Ray Data job")
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--job-sequences", type=int, default=400)
    args = ap.parse_args()
    for name, length, block_size, gmax, n_rand in SETTINGS:
        expand, with_arrow = core_rows_per_s(length, block_size, gmax, n_rand, args.sequences)
        print(f"{name}: L={length} B={block_size} Gmax={gmax} N_rand={n_rand} |Lambda|={num_layouts(gmax, n_rand)}")
        print(f"  core (1 CPU): expand {expand:,.0f} rows/s, expand + Arrow {with_arrow:,.0f} rows/s")
        if args.ray:
            job = job_rows_per_s(args.cpus, args.job_sequences, length, block_size, gmax, n_rand)
            print(f"  Ray job ({args.cpus} CPUs): {job:,.0f} rows/s = {job / args.cpus:,.0f} rows/s per CPU; "
                  f"job per CPU / core = {job / args.cpus / with_arrow:.2f}")


if __name__ == "__main__":
    main()
