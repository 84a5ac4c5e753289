"""`mbd forward`: load a model directory and time one block-causal forward pass (a smoke test)."""

from __future__ import annotations

import argparse
import time

import torch

from mbd.model import load_checkpoint
from mbd.model.attention import Masked
from mbd.model.masks import block_causal_dense
from mbd.tokenizer import Tokenizer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mbd forward", description=__doc__)
    ap.add_argument("--model", required=True, help="HuggingFace-format model directory")
    ap.add_argument("--prompt", default="1+2=")
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args(argv)
    model, cfg = load_checkpoint(a.model)
    tok = Tokenizer.from_dir(a.model, cfg)
    ids = torch.tensor([tok.encode_chat([{"role": "user", "content": a.prompt}])])
    n = ids.shape[1]
    pos = torch.arange(n).unsqueeze(0)
    mask = block_causal_dense(pos, n, torch.tensor([n]), cfg.block_size)
    with torch.inference_mode():
        model(ids, pos, Masked(mask))
        t0 = time.perf_counter()
        for _ in range(a.repeat):
            logits = model(ids, pos, Masked(mask))
        dt = (time.perf_counter() - t0) / a.repeat
    params = sum(p.numel() for p in model.parameters())
    print(f"{cfg.family}: {params / 1e6:.2f}M params, {n} tokens, {dt * 1e3:.2f} ms/forward, "
          f"last-position argmax: {tok.decode([int(logits[0, -1].argmax())], skip_special_tokens=False)!r}")
    return 0
