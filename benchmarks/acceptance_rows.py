"""The engine rows of `benchmarks.gpu_acceptance`, each checked against its reference (the training and serving
rows are in `benchmarks.acceptance_train`). Each row runs in a process of its own (the orchestrator's child) and
returns a `Row`; on CPU the same code runs at the quick sizes, CUDA-only rows say "skipped (no CUDA)".
"""

from __future__ import annotations

import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.bf16_drift import random_drift, tinymath_drift
from benchmarks.hf_baseline import PlainBlockDiffusion, random_sdar, to_qwen3
from benchmarks.step_floor import measure, random_model, shape_config, top_kernels
from mbd.config import DecodeConfig, EngineConfig
from mbd.decoding import Engine
from mbd.decoding.compiled import decode_shapes

SKIPPED = "skipped (no CUDA)"


@dataclass(frozen=True)
class Sizes:
    """What each row runs: GPU sizes, or the quick CPU ones (same code)."""

    floor_shapes: tuple[str, str] = ("sdar-8b", "llada2-mini")
    floor_block: int = 32
    floor_batches: tuple[int, ...] = (1, 16)
    floor_new: int = 256
    floor_repeats: int = 2
    small: str = "60m"  # hf_baseline.SIZES: the correctness rows' dense model
    moe: str = "tiny-moe"  # step_floor's tiny LLaDA2 shape (the MoE correctness rows)
    prompt: int = 64
    new: int = 128
    compare_buckets: tuple[int, ...] = (4, 16)  # the correctness rows' batch buckets (16 rows)
    compare_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    compare_families: tuple[str, ...] = ("sdar", "llada2")  # the CPU test suite compiles both families already
    warmup_shape: str = "sdar-8b"
    warmup_block: int = 32
    # configs/serve/sdar-8b-tp2.yaml's shapes (48 graphs over 24 (rows, slots) pairs): with automatic dynamic shapes
    # they compile into 3-5 layer graphs (tiny SDAR on CPU: 3 in 39 s; static shapes compiled 24 in 229 s)
    warmup_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    warmup_n_buf: int = 4
    hf_model: str = "0.5b"
    problems: int = 1000
    train_model: str = "0.5b"
    train_rows: int = 4
    train_len: int = 256


# The quick warm-up compiles the very shapes of the quick compiled row (the same tiny SDAR, 16 rows, N_buf 2, block
# 4): run first, it leaves them in the run's compile cache and the compiled row only reads them back.
QUICK = Sizes(floor_shapes=("tiny", "tiny-moe"), floor_block=4, floor_batches=(1, 4), floor_new=16, floor_repeats=0,
              small="tiny", prompt=16, new=24, compare_buckets=(16,), compare_dtypes=("float32",),
              compare_families=("sdar",), warmup_shape="tiny", warmup_block=4, warmup_buckets=(16,), warmup_n_buf=2,
              hf_model="tiny", problems=48, train_model="tiny", train_rows=4, train_len=32)


@dataclass
class Row:
    check: str
    result: str  # PASS | FAIL | MEASURED | skipped (...) | TIMEOUT
    detail: str
    seconds: float = 0.0
    data: dict = field(default_factory=dict)


def prompts_for(vocab: int, n: int, length: int, seed: int, ragged: bool = False) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(length // 2, length + 1, (n,), generator=g).tolist() if ragged else [length] * n
    return [torch.randint(0, vocab - 2, (k,), generator=g).tolist() for k in lens]


def multibd(n_buf: int, new: int, max_len: int = 1024) -> DecodeConfig:
    extra = dict(tau_add=0.1, tau_semi=0.5) if n_buf > 1 else {}
    return DecodeConfig(buffer_size=n_buf, tau_m2t=0.9, max_new_tokens=new, max_length=max_len, max_nfe=100_000,
                        **extra)


def same_outputs(a: list, b: list) -> tuple[bool, str]:
    tok = sum(x.token_ids == y.token_ids for x, y in zip(a, b))
    nfe = sum(x.nfe == y.nfe for x, y in zip(a, b))
    return tok == nfe == len(a), f"tokens equal {tok}/{len(a)}, NFE equal {nfe}/{len(a)}"


def models(s: Sizes, device: str, dtype: torch.dtype) -> dict[str, tuple[torch.nn.Module, int]]:
    """The correctness rows' models: a dense SDAR and a small LLaDA2-MoE, random and tempered, with their vocab."""
    out = {}
    if "sdar" in s.compare_families:
        dense, cfg = random_sdar(s.small, 4, 1024)
        out["sdar"] = dense.to(device, dtype), cfg.vocab_size
    if "llada2" in s.compare_families:
        moe_cfg = shape_config(s.moe, 4)
        out["llada2"] = random_model(moe_cfg, device, dtype), moe_cfg.vocab_size
    return out


def compare(model, vocab: int, a: EngineConfig, b: EngineConfig, s: Sizes) -> tuple[bool, list[str]]:
    """SingleBD and N_buf 2 on 16 ragged prompts through 16 rows (the batch bucket shrinks as requests end)."""
    ok, parts, ps = True, [], prompts_for(vocab, 16, s.prompt, 1, ragged=True)
    for n_buf in (1, 2):
        x = Engine(model, None, multibd(n_buf, s.new), a).generate(ps)
        y = Engine(model, None, multibd(n_buf, s.new), b).generate(ps)
        good, text = same_outputs(x, y)
        ok &= good
        parts.append(f"N_buf={n_buf}: {text}")
    return ok, parts


def compile_cache(out: Path) -> Path:
    """The run's compile cache, beside the output folder (so that the folder stays small to copy back): every
    compiled engine of the run reads and fills it, so a shape compiles once per run; the cold warm-up empties it."""
    return out.parent / f"{out.name}-compile-cache"


def fx_graphs() -> dict[str, int]:
    """This process's compiled graphs so far: those Inductor compiled from scratch (FX graph cache misses), those
    it read back from the cache (hits), and those it compiled without looking (bypasses)."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return {"compiled": c["fxgraph_cache_miss"], "cache_hits": c["fxgraph_cache_hit"],
            "bypassed": c["fxgraph_cache_bypass"]}


def compiled_row(s: Sizes, device: str, out: Path) -> Row:
    """float32, so that only compilation differs: the compiled decode layers (no graphs) == the same paged attention
    eager, for both families (the MoE's float32 dispatch); bfloat16 (the MoE's grouped GEMMs): agreement reported."""
    ok, parts = True, []
    for dtype in (getattr(torch, d) for d in s.compare_dtypes):
        for name, (model, vocab) in models(s, device, dtype).items():
            base = dict(device=device, max_batch_rows=16, batch_buckets=list(s.compare_buckets), attention="flex",
                        cuda_graphs="off")
            good, text = compare(model, vocab, EngineConfig(**base, compile="default",
                                                            compile_cache=str(compile_cache(out))),
                                 EngineConfig(**base, compile="off"), s)
            ok &= good or dtype == torch.bfloat16
            parts.append(f"{name} {str(dtype)[6:]}: " + "; ".join(text))
    return Row("compiled forward == eager", "PASS" if ok else "FAIL", " | ".join(parts),
               data={"fx_graphs": fx_graphs()})


def graphs_row(s: Sizes, device: str, out: Path) -> Row:
    """CUDA Graph replay of the compiled forward == the same compiled forward without graphs (bit-identical
    kernels), bfloat16, both families; every shape captured at start-up."""
    if device != "cuda":
        return Row("CUDA Graph replay == no graphs", SKIPPED, "needs a GPU")
    ok, parts = True, []
    for name, (model, vocab) in models(s, device, torch.bfloat16).items():
        base = dict(device=device, max_batch_rows=16, batch_buckets=list(s.compare_buckets), attention="flex",
                    compile="default", compile_cache=str(compile_cache(out)))  # the compiled row's graphs
        good, text = compare(model, vocab, EngineConfig(**base, cuda_graphs="on"),
                             EngineConfig(**base, cuda_graphs="off"), s)
        ok &= good
        parts.append(f"{name}: " + "; ".join(text))
    return Row("CUDA Graph replay == no graphs", "PASS" if ok else "FAIL", " | ".join(parts))


def floor_row(index: int, compile: str = "auto"):
    def row(s: Sizes, device: str, out: Path) -> Row:
        """ms per step of SingleBD and N_buf 2 at batch 1 and 16 against each cell's weight-streaming floor (the
        experts its steps read) and, side by side, the floor with every routed expert read; the copy rate. With a
        compile mode named (max-autotune: GEMMs autotuned for the decode shapes, no cuBLAS split-K), batch 1 only,
        on a GPU only (CPU's autotuned C++ GEMM templates are another question)."""
        if compile != "auto" and device != "cuda":
            return Row(f"step vs floor: {s.floor_shapes[index]}, compile {compile}", SKIPPED, "needs a GPU")
        batches = list(s.floor_batches) if compile == "auto" else list(s.floor_batches[:1])
        m = measure(s.floor_shapes[index], batches, [1, 2], s.floor_block, s.floor_new, s.floor_repeats, device,
                    compile)
        one = [c for c in m["cells"] if c["batch"] == s.floor_batches[0]]
        text = "; ".join(f"batch {c['batch']} N_buf {c['n_buf']}: {c['ms_step']:.2f} ms = {c['x_floor']:.2f}x floor "
                         f"{c['floor_ms']:.2f} ms" + (f" ({c['x_naive_floor']:.2f}x all-experts floor "
                                                     f"{c['naive_floor_ms']:.2f} ms)" if c["experts_read"] else "")
                         + f", TPF {c['tpf']:.2f}, TPS {c['tps']:.0f}"
                         + (f", {c['kernels_layer']:.1f} kernels/layer taking {c['device_ms_step']:.2f} ms of the step"
                            if c["kernels_layer"] else "")
                         for c in m["cells"])
        ratio = one[1]["ms_step"] / one[0]["ms_step"]
        top = "".join(f"; {top_kernels(c, m['layers'])[2:]}" for c in one[:1] if c["kernels_top"])
        name = f"step vs floor: {m['shape']}" + (f", compile {compile}" if compile != "auto" else "")
        return Row(name, "MEASURED", f"copy rate {m['copy_rate_tb_s']:.3g} TB/s; {text}; "
                   f"N_buf 2 / SingleBD step {ratio:.2f}{top}", data=m)
    return row


def warmup_row(cold: bool):
    which = "first (a fresh compile cache)" if cold else "again from that cache"

    def row(s: Sizes, device: str, out: Path) -> Row:
        """Engine construction for shapes of the SDAR-8B serve config: compile and capture every graph; the cold
        run empties the run's compile cache first, the second run reads what it left. The counts say what was
        compiled from scratch and what was read back (the second run should compile nothing)."""
        if cold:
            shutil.rmtree(compile_cache(out), ignore_errors=True)
        cfg = shape_config(s.warmup_shape, s.warmup_block)
        model = random_model(cfg, device, torch.bfloat16 if device == "cuda" else torch.float32)
        ecfg = EngineConfig(device=device, max_batch_rows=max(s.warmup_buckets), batch_buckets=list(s.warmup_buckets),
                            attention="flex", compile="default", compile_cache=str(compile_cache(out)))
        eng = Engine(model, None, multibd(s.warmup_n_buf, 64), ecfg)
        shapes, fx = decode_shapes(eng.scheduler.buckets, s.warmup_n_buf), fx_graphs()
        return Row(f"warm-up, {which}", "MEASURED", f"{len(shapes)} shapes in {eng.warmup_s:.1f} s; graphs compiled "
                   f"{fx['compiled']}, read from the cache {fx['cache_hits']}, uncached {fx['bypassed']}",
                   data={"seconds": eng.warmup_s, "shapes": len(shapes), "fx_graphs": fx})
    return row


def batch_invariance_row(s: Sizes, device: str, out: Path) -> Row:
    """A request decoded alone and inside a batch of 16 (the engine's dtype on the device): how many are identical."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, cfg = random_sdar(s.small, 4, 1024)
    model = model.to(device, dtype)
    ps = prompts_for(cfg.vocab_size, 16, s.prompt, 3, ragged=True)
    eng = Engine(model, None, multibd(2, s.new), EngineConfig(device=device, max_batch_rows=16))
    together = eng.generate(ps)
    alone = [eng.generate([p])[0] for p in ps]
    same = sum(a.token_ids == b.token_ids for a, b in zip(alone, together))
    tokens = sum(sum(x == y for x, y in zip(a.token_ids, b.token_ids)) for a, b in zip(alone, together))
    total = sum(len(a.token_ids) for a in alone)
    return Row(f"batch invariance ({str(dtype)[6:]})", "MEASURED", f"requests identical {same}/16, tokens at equal "
               f"positions {tokens}/{total}", data={"requests": same, "tokens": tokens, "total": total})


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts); None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def hf_row(s: Sizes, device: str, out: Path) -> Row:
    """The plain transformers loop on the same weights: its tokens equal our SingleBD's in float32 (our engine eager
    with SDPA, the plainest kernels: the compiled row checks compiled == eager); decode TPS of SingleBD and N_buf 2
    (the default engine) against it in the device's dtype, batch 1, B=32, medians of ABC/CBA repeats."""
    model, cfg = random_sdar(s.hf_model, 32, 1024)
    model = model.to(device)
    ps = prompts_for(cfg.vocab_size, 1, s.prompt, 2)
    plain = PlainBlockDiffusion(to_qwen3(model, cfg), 32, cfg.mask_token_id, {cfg.eos_token_id})
    eager = EngineConfig(device=device, max_batch_rows=1, attention="sdpa", compile="off", cuda_graphs="off")
    theirs = plain.generate(ps, 0.9, s.new, 1024).token_ids
    mine = [r.token_ids for r in Engine(model, None, multibd(1, s.new), eager).generate(ps)]
    diverge = [first_divergence(a, b) for a, b in zip(theirs, mine)]
    equal = diverge == [None] * len(ps)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = model.to(dtype)
    plain = PlainBlockDiffusion(to_qwen3(model, cfg), 32, cfg.mask_token_id, {cfg.eos_token_id})
    ours = {n: Engine(model, None, multibd(n, s.new), EngineConfig(device=device, max_batch_rows=1)) for n in (1, 2)}
    tps: dict = {"plain": [], 1: [], 2: []}
    for rep in range(3):
        for name in (["plain", 1, 2] if rep % 2 else [2, 1, "plain"]):
            if name == "plain":
                r = plain.generate(ps, 0.9, s.new, 1024)
                tps[name].append(sum(r.num_generated) / r.decode_s)
            else:
                e, t0 = ours[name], ours[name].stats.step_s
                res = e.generate(ps)
                tps[name].append(sum(x.num_generated for x in res) / (e.stats.step_s - t0))
    med = {str(k): statistics.median(v[1:]) for k, v in tps.items()}
    return Row(f"engine vs transformers loop ({s.hf_model})", "PASS" if equal else "FAIL",
               f"tokens equal in float32: {equal} (first divergence per request: {diverge}); TPS plain "
               f"{med['plain']:.0f}, SingleBD {med['1'] / med['plain']:.2f}x, N_buf 2 {med['2'] / med['plain']:.2f}x",
               data={"equal": equal, "first_divergence": diverge, "tps": med})


def bf16_row(s: Sizes, device: str, out: Path) -> Row:
    """Accuracy may not drop significantly (paired exact McNemar p < 0.05 with bf16 below fp32 fails)."""
    t = tinymath_drift(s.problems, device)
    r = random_drift(s.small, 4, 2, 16, s.new, device)
    worse = t["acc_bf16"] < t["acc_fp32"] and t["p_mcnemar"] < 0.05
    detail = (f"tiny tinymath n={s.problems}: {t['acc_fp32']:.1f}% -> {t['acc_bf16']:.1f}% ({t['paired']}), "
              f"identical outputs {100 * t['identical']:.0f}%; random {s.small} N_buf 2: identical "
              f"{100 * r['identical']:.0f}%, prefix tokens {100 * r['prefix_tokens']:.0f}%")
    return Row("bf16 drift vs fp32", "FAIL" if worse else "PASS", detail, data={"tinymath": t, "random": r})
