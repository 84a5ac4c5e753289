"""`mbd pretrain-tiny`: train the embedded tiny BD-LM (`mbd/assets/tiny`) from scratch, from a seed.

    mbd pretrain-tiny                                  # configs/train/tiny_pretrain.yaml -> mbd/assets/tiny
    mbd pretrain-tiny --steps 200 --out /tmp/tiny --set train.deepspeed.lr=2e-3

Three stages, all a pure function of the seed: (1) the tinymath pretrain part as a prompt/response JSONL
corpus (`mbd.tiny.task`: disjoint from the post-training corpus and the held-out problems by construction),
(2) the char-level tokenizer (`mbd.tiny.vocab`) and a randomly initialised `sdar` model written as an HF
directory, (3) block-diffusion teacher forcing (`layouts.mode: tf`, every response block its own noise-group)
through the same Ray Train + DeepSpeed path as MultiTF (`run_train`), whose
final checkpoint is exported to --out. This is the SingleBD base of the project, as the paper's base
models are ordinary BD-LMs before MultiTF. A re-run with the same work directory resumes the Ray Train run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

from pydantic import Field

from mbd.config import REPO_ROOT, ConfigError, ModelConfig, StrictModel, apply_sets, read_yaml, resolve_path, validate
from mbd.model import build_model, save_checkpoint
from mbd.tiny.task import SPLITS, Split, generate, split_size, write_jsonl
from mbd.tiny.vocab import save_tokenizer, special_token_ids, vocab
from mbd.train_config import TrainConfig

DEFAULT_CONFIG = REPO_ROOT / "configs" / "train" / "tiny_pretrain.yaml"
DEFAULT_OUT = REPO_ROOT / "mbd" / "assets" / "tiny"
DECODE_CONFIGS = {"singlebd": "configs/decode/tiny_singlebd.yaml",
                  "multibd_training_free": "configs/decode/tiny_multibd.yaml"}
PROVENANCE = "pretrain.json"


class ArchSection(StrictModel):
    """The tiny `sdar` backbone's shape; the vocabulary and special ids always come from `mbd.tiny.vocab`."""

    hidden_size: int = Field(default=128, gt=0)
    intermediate_size: int = Field(default=384, gt=0)
    num_hidden_layers: int = Field(default=4, gt=0)
    num_attention_heads: int = Field(default=4, gt=0)
    num_key_value_heads: int = Field(default=2, gt=0)
    head_dim: int = Field(default=32, gt=0)
    max_position_embeddings: int = Field(default=256, gt=0)
    block_size: int = Field(default=4, gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)


class CorpusSection(StrictModel):
    problems: int = Field(default=80000, gt=0, description="pretrain-part problems in the corpus")


class PretrainConfig(StrictModel):
    """`train` is a full TrainConfig: its model_path receives the random init, its data.jsonl the corpus."""

    seed: int = Field(default=0, ge=0, description="seeds the corpus, the init and the training rows")
    model: ArchSection = ArchSection()
    corpus: CorpusSection = CorpusSection()
    train: TrainConfig


def model_config(arch: ArchSection) -> ModelConfig:
    ids = special_token_ids()
    return ModelConfig(family="sdar", vocab_size=len(vocab()), tie_word_embeddings=True,
                       mask_token_id=ids["mask_token_id"], eos_token_id=ids["eos_token_id"],
                       pad_token_id=ids["pad_token_id"], **arch.model_dump())


def prepare(cfg: PretrainConfig) -> ModelConfig:
    """Write the corpus and the random-init model directory named by `cfg.train` (idempotent for a seed)."""
    n, available = cfg.corpus.problems, split_size("pretrain")
    if n > available:
        raise ConfigError(f"corpus.problems={n}: the tinymath pretrain part holds only {available} problems")
    write_jsonl(cfg.train.data.jsonl, generate("pretrain", n, cfg.seed))
    mcfg = model_config(cfg.model)
    init = Path(cfg.train.model_path)
    save_checkpoint(build_model(mcfg, seed=cfg.seed), mcfg, init)
    save_tokenizer(init)
    return mcfg


def load_pretrain_config(path: Path, sets: Sequence[str], steps: int | None, seed: int | None) -> PretrainConfig:
    """The YAML with `--set` items (and the --steps / --seed shorthands) applied; one seed for corpus, init and
    training rows."""
    sets = [*sets, *([f"train.steps={steps}"] if steps is not None else []),
            *([f"seed={seed}"] if seed is not None else [])]
    data = apply_sets(read_yaml(path), sets)
    if isinstance(data.get("train"), dict):
        data["train"]["seed"] = data.get("seed", 0)
    return validate(PretrainConfig, data, str(path))


def pretrain(cfg: PretrainConfig, out: Path, show_progress: bool = True) -> dict:
    """Run all three stages; returns a JSON-able summary (also written to <run_dir>/pretrain_summary.json)."""
    from pipelines.train_multitf import run_train

    t0 = time.perf_counter()
    mcfg = prepare(cfg)
    train = cfg.train.model_copy(deep=True)
    train.run.export_dir = str(out)
    summary = run_train(train, show_progress=show_progress)
    params = sum(p.numel() for p in build_model(mcfg, seed=None).parameters())
    steps = [m for m in summary.history if "loss" in m]
    tail = steps[-min(50, len(steps)):]
    result = {
        "seed": cfg.seed, "steps": summary.last_step, "parameters": params,
        "wall_s": round(time.perf_counter() - t0, 1), "train_wall_s": summary.wall_s,
        "final_loss": summary.final.get("loss"), "final_probe_loss": summary.final.get("probe_loss"),
        "mean_loss_last_50": sum(m["loss"] for m in tail) / len(tail) if tail else None,
        "tokens_per_s": sum(m["tokens"] for m in steps) / sum(m["step_s"] for m in steps) if steps else None,
        "run_dir": summary.run_dir,
    }
    Path(summary.run_dir, "pretrain_summary.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def evaluate(model_dir: Path, n: int, split: Split = "dev") -> dict:
    """Exact match and TPF of the exported model under SingleBD and training-free MultiBD (greedy, CPU fp32, the
    first n problems of `split` drawn with seed 0): the dev split by default, so no choice made from it (steps,
    recipe) has seen a test problem."""
    from mbd.decoding import EngineConfig, build_engine
    from mbd.tiny.benchmark import TinyMath
    from pipelines.generate import load_decode_config

    bench = TinyMath(split=split)
    problems = bench.load(limit=n)
    out: dict = {"split": split, "split_seed": bench.seed}
    for name, path in DECODE_CONFIGS.items():
        engine = build_engine(model_dir, load_decode_config(resolve_path(path)),
                              EngineConfig(device="cpu", dtype="float32", max_batch_rows=16))
        results = engine.generate([p.prompt_text for p in problems])
        correct = sum(bench.score(p, r.text).correct for p, r in zip(problems, results))
        generated, nfe = sum(r.num_generated for r in results), sum(r.nfe for r in results)
        out[name] = {"config": path, "n": len(problems), "correct": correct, "accuracy": correct / len(problems),
                     "tpf": generated / nfe}
    return out


def write_provenance(out: Path, record: dict) -> Path:
    """Merge `record` into <out>/pretrain.json: how the shipped checkpoint was made and what it measures."""
    path = out / PROVENANCE
    data = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps(data | record, indent=2) + "\n")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mbd pretrain-tiny", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="pretraining YAML (seed, model, corpus, train)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="where the trained HF model directory is exported")
    ap.add_argument("--steps", type=int, default=None, help="optimiser steps (overrides train.steps)")
    ap.add_argument("--seed", type=int, default=None, help="overrides seed")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field, e.g. --set train.deepspeed.lr=2e-3 --set corpus.problems=20000")
    ap.add_argument("--eval-problems", type=int, default=200, help="problems evaluated after export")
    ap.add_argument("--eval-split", default="dev", choices=SPLITS, help="the tinymath split they come from")
    ap.add_argument("--eval-only", action="store_true", help="only (re)evaluate the model already in --out")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (log-friendly)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    try:
        if args.eval_only:
            if not (out / "config.json").is_file():
                raise ConfigError(f"--out {out}: no exported model to evaluate (config.json missing)")
            result = {}
        else:
            cfg = load_pretrain_config(Path(args.config), args.overrides, args.steps, args.seed)
            result = {"command": "mbd pretrain-tiny " + " ".join(argv if argv is not None else sys.argv[1:]),
                      **pretrain(cfg, out, show_progress=not args.no_progress)}
    except ConfigError as e:
        print(f"mbd pretrain-tiny: {e}", file=sys.stderr)
        return 2
    result["eval"] = evaluate(out, args.eval_problems, args.eval_split)
    write_provenance(out, {k: v for k, v in result.items() if k != "run_dir"})  # no machine-specific paths
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
