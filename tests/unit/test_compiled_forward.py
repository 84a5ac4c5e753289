"""The compiled decode forward on CPU (inductor's C++ backend, float32): one decoder layer of each family compiles
`fullgraph` (a graph break fails) at most once per (layer kind, batch rows, slots), fewer once Dynamo's automatic
dynamic shapes make rows and query positions symbolic, all at the engine's warm-up and never again while it
decodes; and every engine suite gives the tokens of eager decoding with it: the Block Buffer against the naive
MultiBD and SingleBD references, requests joining mid-run, prefix reuse and preemption, DMax, structured output and
TP=2 over gloo. The LLaDA2 experts' grouped GEMMs (bfloat16) compile too.

One engine shape for all of them (batch buckets 2 and 4, N_buf 2, B = 4, a pool of POOL_PAGES pages): a layer
compiles in ~5-15 s of CPU on 2 cores, so each family's layers compile once for the module (`shared`) and every
later engine of that shape finds them in Dynamo's cache (kept on the compiled function's code, whatever the model's
weights). Only DMax (N_buf 1) and the TP ranks (their own processes) compile shapes of their own. float32, as
inductor's flex kernel takes no float64; the eager side is the same paged attention uncompiled (`compile: off`) or
the sdpa references.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.multiprocessing as mp
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from mbd.config import DecodeConfig, EngineConfig
from mbd.decoding import Engine, NaiveMultiBD, SingleBD
from mbd.decoding.compiled import compiled_layer, decode_shapes
from mbd.decoding.constraints import ConstraintSpec
from mbd.model import KVCache, TPGroup, build_model, load_checkpoint, save_checkpoint
from mbd.model.base import call_layer
from mbd.model.layers import rope_cos_sin
from mbd.model.llada2_moe import LLaDA2SparseMoE
from mbd.tokenizer import Tokenizer
from tests.conftest import tiny_cfg
from tests.unit.gloo import free_port, gloo_group
from tests.unit.structured_helpers import SCHEMAS, build_bpe

PROMPTS = [list(range(3, 13)), [5, 9, 2], list(range(20, 28)), list(range(30, 47))]
POOL_PAGES = 9  # every engine's KV pool (16-token pages): part of a compiled layer's shapes, so shared too


def engine_cfg(model, compile: str = "default", **kw) -> EngineConfig:
    pool = POOL_PAGES * KVCache.page_bytes(model.cfg, 16, torch.float32)
    base = dict(max_batch_rows=4, batch_buckets=[2, 4], attention="flex", compile=compile, kv_cache_bytes=pool)
    return EngineConfig(**{**base, **kw})


def tempered(family: str, seed: int = 0, **cfg):
    model = build_model(tiny_cfg(family, **cfg), seed=seed).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return model


def dcfg(**kw) -> DecodeConfig:
    base = dict(buffer_size=2, max_length=160, max_new_tokens=28, max_nfe=200, tau_add=0.25, tau_semi=0.5, tau_m2t=0.2)
    return DecodeConfig(**{**base, **kw})


def tokens(results) -> list[tuple[list[int], int]]:
    return [(r.token_ids, r.nfe) for r in results]


def unique_graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def shared() -> dict[str, tuple[int, Engine]]:
    """The module's compiled engines, built by the first test that asks (`compiled_engine`), from an empty Dynamo
    cache."""
    torch._dynamo.reset()
    return {}


def compiled_engine(shared: dict[str, tuple[int, Engine]], family: str) -> tuple[int, Engine]:
    """The family's compiled engine of the module's shape, and the layer graphs its warm-up compiled."""
    if family not in shared:
        before = unique_graphs()
        model = tempered(family)
        eng = Engine(model, None, dcfg(), engine_cfg(model))
        shared[family] = unique_graphs() - before, eng
    return shared[family]


def test_warmup_compiles_every_shape_once_fullgraph(family, shared):
    """Warm-up compiles the 4 (rows, slots) pairs of buckets 2 and 4 x slots 1 and 2 into at most 3 graphs per layer
    kind (automatic dynamic shapes: the first static, then query positions, then rows symbolic; fewer when an earlier
    engine of the process already made them symbolic), decoding compiles nothing more (rows 4 included), and neither
    does another engine of the same shape (other weights); the LLaDA2 model has MoE layers, so its routed experts are
    in the compiled graph (no host sync, no break)."""
    compiled, eng = compiled_engine(shared, family)
    kinds = 2 if any(isinstance(m, LLaDA2SparseMoE) for m in eng.model.modules()) else 1
    assert kinds == (2 if family == "llada2_moe" else 1)
    pairs = {(b, s) for b, s, _ in decode_shapes([2, 4], 2)}
    assert len(pairs) == 4 and kinds <= compiled <= kinds * 3 and eng.warmup_s > 0
    before = unique_graphs()
    eng.generate(PROMPTS)
    assert unique_graphs() == before, "a decode step compiled a new shape"
    assert {(b, q // 4) for b, q, _ in eng.runner.shapes} <= pairs and any(b == 4 for b, _, _ in eng.runner.shapes)
    other = tempered(family, seed=1)
    Engine(other, None, dcfg(), engine_cfg(other)).generate(PROMPTS[:2])
    assert unique_graphs() == before, "an engine of the same shape compiled its layers again"


def test_compiled_engine_equals_the_references(family, shared):
    """Block Buffer MultiBD == naive MultiBD, and N_buf 1 == SingleBD, with a request joining mid-run."""
    model = tempered(family)
    eng = Engine(model, None, dcfg(), engine_cfg(model))
    for dc, ref in ((dcfg(tau_m2t=0.1), NaiveMultiBD), (dcfg(buffer_size=1, tau_add=None), SingleBD)):
        first = [eng.add_request(p, dc) for p in PROMPTS[:3]]
        out: dict[str, list[int]] = {}
        late, steps = None, 0
        while eng.has_unfinished():
            for o in eng.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
            steps += 1
            if late is None and steps == 3:
                late = eng.add_request(PROMPTS[3], dc)
        reference = ref(model, dc, [model.cfg.eos_token_id])
        assert [out[i] for i in first + [late]] == [reference.generate(p).token_ids for p in PROMPTS]


def test_compiled_prefix_reuse_and_preemption_equal_eager(shared):
    """A pool small enough to preempt, and prompts sharing prefixes: compiled == eager (same paged attention,
    uncompiled), with pages reused and requests preempted and readmitted."""
    model = tempered("sdar")
    shared_prefix = list(range(3, 35))
    prompts = [shared_prefix + [40, 41], shared_prefix + [50], list(range(36, 55)), shared_prefix + [7, 8, 9]]
    runs = {}
    for mode in ("default", "off"):
        eng = Engine(model, None, dcfg(tau_m2t=0.1, max_new_tokens=40), engine_cfg(model, mode))
        runs[mode] = tokens(eng.generate(prompts))
        assert eng.stats.prefix_hit_tokens > 0 and eng.stats.preemptions > 0
    assert runs["default"] == runs["off"]


def test_compiled_dmax_token_merge_equals_eager():
    model = tempered("llada2_moe", seed=3)
    dc = DecodeConfig(buffer_size=1, max_length=128, max_new_tokens=24, max_nfe=60, tau_m2t=0.05, tau_t2t=0.0,
                      strategy="dmax")
    runs = [tokens(Engine(model, None, dc, engine_cfg(model, mode)).generate(PROMPTS[:2]))
            for mode in ("default", "off")]
    assert runs[0] == runs[1]


def test_compiled_structured_output_equals_eager(shared):
    mask = 3
    cfg = dict(vocab_size=416, mask_token_id=mask, eos_token_id=0, pad_token_id=0, max_position_embeddings=512)
    model = build_model(tiny_cfg(**cfg), seed=0).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    tok = Tokenizer(build_bpe(), "sdar", mask, 0, 0)
    spec = ConstraintSpec.json_schema(SCHEMAS["enum"])
    dc = dcfg(max_new_tokens=60)
    runs = [Engine(model, tok, dc, engine_cfg(model, mode)).generate([[5, 6, 7], [44, 45, 9]], constraints=[spec, None])
            for mode in ("default", "off")]
    assert tokens(runs[0]) == tokens(runs[1]) and runs[0][0].finish_reason == "eos"


def tp_dcfg() -> DecodeConfig:
    """N_buf 1: half the layer shapes of N_buf 2 for each rank to compile (the slots are not what TP changes)."""
    return dcfg(buffer_size=1, tau_add=None)


def _tp_worker(rank: int, world: int, port: int, ckpt: str, out: str) -> None:
    with gloo_group(rank, world, port):
        model, _ = load_checkpoint(ckpt, tp=TPGroup(rank, world))
        with torch.no_grad():
            model.lm_head.weight.mul_(10.0)
        res = Engine(model, None, tp_dcfg(), engine_cfg(model)).generate(PROMPTS[:2])
        if rank == 0:
            torch.save({"tokens": [r.token_ids for r in res]}, out)


@pytest.mark.timeout(1200)
def test_compiled_tp2_over_gloo_equals_tp1(tmp_path):
    """Each rank compiles its shard's layer with the all-reduces traced as functional collectives."""
    cfg = tiny_cfg("sdar")
    save_checkpoint(build_model(cfg, seed=7), cfg, tmp_path / "ck")
    mp.start_processes(_tp_worker, args=(2, free_port(), str(tmp_path / "ck"), str(tmp_path / "out.pt")), nprocs=2,
                       start_method="spawn")
    model, _ = load_checkpoint(tmp_path / "ck")
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    want = Engine(model, None, tp_dcfg(), EngineConfig(max_batch_rows=2, batch_buckets=[2])).generate(PROMPTS[:2])
    assert torch.load(tmp_path / "out.pt", weights_only=True)["tokens"] == [r.token_ids for r in want]


def test_grouped_expert_dispatch_compiles_in_bfloat16():
    """bfloat16 sends LLaDA2's routed experts through torch._grouped_mm (which CPU runs too): the MoE block
    compiles fullgraph with it (no host sync) and gives the eager block's output."""
    moe = build_model(tiny_cfg("llada2_moe"), seed=2).model.layers[1].mlp.to(torch.bfloat16)
    assert isinstance(moe, LLaDA2SparseMoE)
    x = torch.randn(2, 8, moe.gate.cfg.hidden_size).bfloat16()
    compiled = torch.compile(moe, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        want = moe(x)
        got, code = run_and_get_code(compiled, x)  # resets Dynamo: the module's shared graphs are gone after it
    assert got.dtype == torch.bfloat16 and any("_grouped_mm" in c for c in code)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * want.abs().max().item(), rtol=0)


def test_compiled_layer_writes_the_pool_in_place_in_nine_kernels():
    """The compiled layer scatters its tokens' K/V into the pool where they lie: inductor's code touches the
    written positions, never the whole pool (a reshape of the pool inside the compiled region made it copy all of
    it back every layer: the pool's size then appears as a loop bound in the generated code). And it launches 9
    kernels (11 before the residual add moved into the next layer's norm and RoPE before the head transpose)."""
    model = tempered("sdar")
    eng = Engine(model, None, dcfg(), engine_cfg(model, "off"))
    runner = eng.runner
    cache = runner.cache
    pool_elems = cache.k[0].numel()  # one layer's K pool
    attn = runner._paged(2, 1)  # the shape the module's engines compile first: inductor's cache may hold it
    layer = eng.model.model.layers[0]
    h = torch.randn(2, 4, eng.model.cfg.hidden_size)
    cos, sin = rope_cos_sin(runner.paged.q_pos[:2, :4], eng.model.cfg.rotary_dim, eng.model.cfg.rope_theta, h.dtype)
    compiled = compiled_layer("default")
    before = cache.k[0].clone()
    with torch.inference_mode():
        out, code = run_and_get_code(compiled, layer, h, torch.zeros_like(h), cos, sin, attn.layer(0))  # resets Dynamo
        want = call_layer(layer, h, torch.zeros_like(h), cos, sin, attn.layer(0))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    loops = re.compile(rf"<\s*static_cast<int64_t>\({pool_elems}L\)")  # a loop over the whole pool
    assert any("flex" in c for c in code), "no generated code was read"  # an inductor cache hit returns it too
    assert not any(loops.search(c) for c in code), "the compiled layer copies the whole K/V pool"
    # One SDAR layer is 4 GEMMs (q|k|v, o, gate|up, down) and 5 fused kernels: the previous layer's residual add
    # with the input RMSNorm; q/k norm + RoPE + the K/V scatter; attention; o's residual + RMSNorm; SiLU * up.
    # No kernel for the closing residual add (the next layer's first does it) nor for merging attention's heads
    # (RoPE runs before the heads move to dim 1, so attention writes [b, n, h, d] and the merge is a view).
    calls = [m.group(1) for c in code for m in re.finditer(r"^\s+(cpp_fused_\w+|extern_kernels\.mm)\(", c, re.M)]
    assert calls.count("extern_kernels.mm") == 4 and len(calls) == 9, calls
    changed = (cache.k[0] != before).any(-1).flatten()
    assert 0 < int(changed.sum()) <= 2 * 4 * cache.k.shape[1]
