"""Decoding benchmark: SingleBD vs Block Buffer MultiBD (N_buf 2 and 4) on the tiny model, in one run.

Reports per configuration: TPF, TPS (generated tokens / decode wall time, prefill excluded), mean step
latency, token efficiency eta_tok = TPF / (N_buf * B) (sec:efficiency_analysis), and engine overhead =
step wall time / pure model-forward time of the same shape. The pure forward is timed right after every
engine step, on the same buffer and cache (it rewrites only scratch K/V), so load changes on a shared
machine hit both sides of the ratio alike.

    python benchmarks/decode.py                     # embedded tiny model if present, else a random one
    python benchmarks/decode.py --model DIR --prompts 16
    python benchmarks/decode.py --llada2-mini       # GPU only: LLaDA2-Mini-sized random weights, N_buf 1 vs 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbd.config import DecodeConfig, ModelConfig, load_yaml, read_json  # noqa: E402
from mbd.decoding import Engine  # noqa: E402
from mbd.model import build_model, load_checkpoint  # noqa: E402
from mbd.model.masks import block_causal_dense  # noqa: E402
from mbd.decoding.state import SlotState  # noqa: E402
from mbd.tokenizer import Tokenizer  # noqa: E402

TINY_DIR = ROOT / "mbd" / "assets" / "tiny"
QUESTIONS = ["3*4+2*7-5", "6*7-3*2+8", "9*2+5*5-4", "8*8-7*3+1", "2*9+4*6-7", "5*3-2*4+6", "7*7+3*3-9", "4*6-5*2+3"]


def random_tiny() -> tuple[torch.nn.Module, ModelConfig]:
    """A random sdar config the size of the embedded tiny model (d=128, 4 layers, B=4), lm_head tempered
    so that some tokens pass tau_m2t and several blocks are active at once."""
    cfg = ModelConfig(family="sdar", vocab_size=64, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, mask_token_id=63, eos_token_id=62,
                      pad_token_id=62, block_size=4, max_position_embeddings=512)
    model = build_model(cfg, seed=0).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    return model, cfg


def load(args) -> tuple[torch.nn.Module, ModelConfig, Tokenizer | None, str]:
    path = Path(args.model) if args.model else TINY_DIR
    if (path / "config.json").is_file():
        model, cfg = load_checkpoint(path)
        tok = Tokenizer.from_dir(path, cfg) if (path / "tokenizer.json").is_file() else None
        return model, cfg, tok, f"checkpoint {path}"
    model, cfg = random_tiny()
    return model, cfg, None, "RANDOM tiny sdar config (no embedded checkpoint at mbd/assets/tiny): d=128, 4 layers, B=4"


def prompts_for(tok: Tokenizer | None, n: int, seed: int = 0) -> list[list[int]]:
    if tok is not None:
        return [tok.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]) for i in range(n)]
    rng = random.Random(seed)
    return [[rng.randrange(0, 60) for _ in range(rng.randrange(10, 30))] for _ in range(n)]


def configs(cfg: ModelConfig, random_model: bool, max_new: int) -> dict[str, DecodeConfig]:
    single = load_yaml(ROOT / "configs/decode/tiny_singlebd.yaml", DecodeConfig)
    multi = load_yaml(ROOT / "configs/decode/tiny_multibd.yaml", DecodeConfig)
    over = {"max_new_tokens": max_new, "max_length": cfg.max_position_embeddings}
    if random_model:  # a random model is rarely confident: lower tau_m2t so that M2T is not fallback-only
        over["tau_m2t"] = 0.1
    return {
        "SingleBD (N_buf=1)": single.model_copy(update=over),
        "Block Buffer N_buf=2": multi.model_copy(update={**over, "buffer_size": 2}),
        "Block Buffer N_buf=4": multi.model_copy(update={**over, "buffer_size": 4}),
    }


class Clock:
    """Wall time (synchronised on CUDA) and, on CPU, this thread's CPU time: the CPU clock is not charged
    while the process waits for a core, so its ratios stay meaningful on a loaded shared machine."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def now(self) -> tuple[float, float]:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter(), (0.0 if self.cuda else time.thread_time())


@torch.inference_mode()
def measure(model, tok, dc: DecodeConfig, prompts: list[list[int]], device: str) -> dict:
    engine = Engine(model, tok, dc, max_batch_slots=1, device=device)
    engine.generate(prompts[:1])  # warm-up (and CUDA Graph capture)
    runner, buf, B, clock = engine.runner, engine.buf, engine.block, Clock(device)
    prefill_cost = [0.0, 0.0]
    prefill = runner.prefill

    def timed_prefill(row, ids):  # subtracted from the step that admits a request
        a = clock.now()
        prefill(row, ids)
        b = clock.now()
        prefill_cost[0] += b[0] - a[0]
        prefill_cost[1] += b[1] - a[1]

    runner.prefill = timed_prefill
    step_wall, step_cpu, fwd_wall, fwd_cpu, tokens, nfe = [], [], [], [], 0, 0
    for prompt in prompts:
        engine.add_request(prompt)
        while engine.has_unfinished():
            prefill_cost[:] = [0.0, 0.0]
            a = clock.now()
            outs = engine.step()
            b = clock.now()
            step_wall.append(b[0] - a[0] - prefill_cost[0])
            step_cpu.append(b[1] - a[1] - prefill_cost[1])
            for o in outs:
                if o.finished:
                    tokens, nfe = tokens + o.num_generated, nfe + o.nfe
            # the pure model forward of the same shape, on the same buffer and cache
            pos = runner.positions(1)
            visible = runner.cache.lengths[:1] + (buf.state[:1] != SlotState.DUMMY).sum(1) * B
            mask = block_causal_dense(pos, runner.cache.size, visible, B)
            a = clock.now()
            model(buf.tokens[:1], pos, mask, cache=runner._views[1])
            b = clock.now()
            fwd_wall.append(b[0] - a[0])
            fwd_cpu.append(b[1] - a[1])
    tpf = tokens / nfe
    return {
        "tpf": tpf, "tps": tokens / sum(step_wall), "step_ms": 1e3 * statistics.mean(step_wall),
        "eta_tok": tpf / (dc.buffer_size * B), "nfe": nfe, "tokens": tokens,
        "overhead_wall": statistics.median(s / f for s, f in zip(step_wall, fwd_wall)),
        "overhead_cpu": sum(step_cpu) / sum(fwd_cpu) if sum(fwd_cpu) else float("nan"),
    }


def table(rows: dict[str, dict]) -> str:
    head = (f"{'configuration':<22} {'TPF':>6} {'TPS':>9} {'step ms':>8} {'eta_tok':>8} "
            f"{'overhead(wall,median)':>22} {'overhead(cpu)':>14}")
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        lines.append(f"{name:<22} {r['tpf']:>6.2f} {r['tps']:>9.1f} {r['step_ms']:>8.3f} {r['eta_tok']:>8.3f} "
                     f"{r['overhead_wall']:>22.3f} {r['overhead_cpu']:>14.3f}")
    return "\n".join(lines)


def llada2_mini() -> None:
    """Step latency of a LLaDA2-Mini-sized random model at N_buf 1 vs 2 (GPU only)."""
    if not torch.cuda.is_available():
        print("--llada2-mini needs a CUDA device; skipped")
        return
    cfg = ModelConfig.from_hf(read_json(ROOT / "configs/model/llada2-mini-shape.json"))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # ~16B random parameters: allocate and initialise on the GPU
    with torch.device("cuda"):
        model = build_model(cfg, seed=0).eval()
    torch.set_default_dtype(default)
    rng = random.Random(0)
    prompt = [rng.randrange(0, 150000) for _ in range(256)]
    rows = {}
    for n_buf in (1, 2):
        dc = DecodeConfig(buffer_size=n_buf, tau_add=0.1 if n_buf > 1 else None, max_new_tokens=256, max_length=2048,
                          max_nfe=64, tau_m2t=0.95)
        rows[f"LLaDA2-Mini N_buf={n_buf}"] = measure(model, None, dc, [prompt], "cuda")
    print(table(rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: the embedded tiny model if present)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: stable timings on a shared box)")
    ap.add_argument("--llada2-mini", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.llada2_mini:
        llada2_mini()
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, cfg, tok, what = load(args)
    model = model.to(device)
    print(f"model: {what}\ndevice: {device}{' (CUDA Graphs)' if device == 'cuda' else ' (eager)'}, "
          f"threads {torch.get_num_threads()}, {args.prompts} prompts, max_new_tokens {args.max_new_tokens}\n")
    prompts = prompts_for(tok, args.prompts)
    rows = {name: measure(model, tok, dc, prompts, device)
            for name, dc in configs(cfg, tok is None, args.max_new_tokens).items()}
    print(table(rows))
    print("\nTPS, step ms: decode steps only (prefill excluded). overhead = engine step / pure model forward of the\n"
          "same shape, timed after every step: median of per-step wall-time ratios, and total thread CPU time\n"
          "(robust to other processes on the machine).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
