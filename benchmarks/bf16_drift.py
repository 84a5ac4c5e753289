"""bf16 against fp32, same engine, same prompts: how far do the decoded tokens drift, and does accuracy move?

Two measurements. The embedded tiny model on `tinymath`'s held-out problems, SingleBD (its native decoding):
accuracy under both dtypes with the paired 95% interval and exact McNemar test of the difference, plus token
agreement. A random tempered SDAR (`benchmarks.hf_baseline.random_sdar`, default the 60M one) on random prompts:
token agreement only (a random model has no accuracy). Token agreement: the share of requests whose outputs are
identical, and the mean share of each output that is equal up to the first differing token.

    python -m benchmarks.bf16_drift                         # 1,000 problems + the 60M model, on CPU
    python -m benchmarks.bf16_drift --problems 64 --size small --device cuda
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.hf_baseline import random_sdar  # noqa: E402
from mbd.config import DecodeConfig, load_yaml  # noqa: E402
from mbd.decoding import Engine  # noqa: E402
from mbd.decoding.spec import EngineSpec, build_engine  # noqa: E402
from mbd.eval.stats import paired_difference  # noqa: E402
from mbd.tiny.benchmark import TinyMath  # noqa: E402

TINY = "mbd/assets/tiny"
SINGLEBD = "configs/decode/tiny_singlebd.yaml"


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Share of identical outputs, and mean share of tokens equal before the first difference."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix.append(n / max(len(x), len(y), 1))
    return {"identical": same / len(a), "prefix_tokens": sum(prefix) / len(prefix)}


def tinymath_drift(problems: int, device: str = "cpu", rows: int = 16) -> dict:
    """fp32 vs bf16 of the tiny model on the first `problems` held-out tinymath problems, SingleBD."""
    bench, decode = TinyMath(), load_yaml(ROOT / SINGLEBD, DecodeConfig)
    items = bench.load(limit=problems)
    out, correct, seconds = {}, {}, {}
    for dtype in ("float32", "bfloat16"):
        engine = build_engine(EngineSpec(path=TINY, device=device, dtype=dtype, max_batch_slots=rows), decode)
        t0 = time.perf_counter()
        res = engine.generate([p.prompt_text for p in items])
        seconds[dtype] = time.perf_counter() - t0
        out[dtype] = [r.token_ids for r in res]
        correct[dtype] = [bench.score(p, r.text).correct for p, r in zip(items, res)]
    diff = paired_difference(correct["float32"], correct["bfloat16"])
    return {"problems": problems, "acc_fp32": diff.acc_a, "acc_bf16": diff.acc_b, "paired": diff.text(),
            "ci_pp": (diff.ci_low_pp, diff.ci_high_pp), "p_mcnemar": diff.p_mcnemar,
            **agreement(out["float32"], out["bfloat16"]), "seconds": seconds}


def random_drift(size: str = "60m", block: int = 4, n_buf: int = 2, prompts: int = 16, new: int = 64,
                 device: str = "cpu", rows: int = 16) -> dict:
    """Token agreement of a random tempered SDAR decoded in fp32 and in bf16 (Block Buffer, N_buf `n_buf`)."""
    model, cfg = random_sdar(size, block, max_len=64 + new + 2 * block)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size - 2, (prompts, 32), generator=g).tolist()
    decode = DecodeConfig(buffer_size=n_buf, tau_add=0.5 if n_buf > 1 else None, tau_m2t=0.9,
                          max_new_tokens=new, max_length=64 + new)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        engine = Engine(model.to(dtype), None, decode, max_batch_slots=rows, device=device)
        out[dtype] = [r.token_ids for r in engine.generate(ids)]
    return {"size": size, "block": block, "n_buf": n_buf, "prompts": prompts, "new_tokens": new,
            **agreement(out[torch.float32], out[torch.bfloat16])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=1000)
    ap.add_argument("--size", default="60m", help="random SDAR size (benchmarks.hf_baseline.SIZES)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t = tinymath_drift(args.problems, args.device)
    print(f"tiny model, tinymath held-out, SingleBD, n={t['problems']}: accuracy fp32 {t['acc_fp32']:.2f}% "
          f"-> bf16 {t['acc_bf16']:.2f}%: {t['paired']}")
    print(f"  identical outputs {100 * t['identical']:.1f}%, tokens equal before the first difference "
          f"{100 * t['prefix_tokens']:.1f}% (fp32 {t['seconds']['float32']:.1f} s, bf16 {t['seconds']['bfloat16']:.1f} s)")
    for block, n_buf in ((4, 1), (4, 2), (32, 2)):
        r = random_drift(args.size, block, n_buf, args.prompts, args.new, args.device)
        print(f"random SDAR {args.size}, B={block}, N_buf={n_buf}, {args.prompts} prompts x {args.new} tokens: "
              f"identical outputs {100 * r['identical']:.1f}%, tokens equal before the first difference "
              f"{100 * r['prefix_tokens']:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
