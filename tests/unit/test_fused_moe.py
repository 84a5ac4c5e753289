"""LLaDA2's fused MoE (mbd/model/fused_moe.py, its Triton kernels in mbd/model/moe_kernels.py) on CPU, under
Triton's interpreter: the alignment by expert is exact, the router kernel
chooses the torch router's experts with its weights, the routed experts equal the dense sum over every expert
written here (float64, weighted by the routing, 0 for experts not chosen) over ragged loads (empty experts, an
expert over several tiles), and a whole tiny LLaDA2 model's logits equal the reference's. Which path each device,
dtype and gradient mode takes is checked without Triton.

The interpreter must be on before Triton is first imported (Triton's own jit helpers, tl.sum and the like, are
built at import), and other test modules import Triton through inductor: so the kernel tests run in a child
pytest of this file with TRITON_INTERPRET=1 from its start (`test_kernels_under_the_interpreter`), and are
skipped in the parent.

Tolerances: float32 within 1e-5 of the output's scale (the same products summed in another order); bfloat16
within 3e-2 of it (h = SiLU(gate) * up is stored in bfloat16, and the interpreter rounds to bfloat16 toward zero
where a GPU rounds to nearest). Shapes stay small: each kernel launch costs the interpreter about a second.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mbd.model import build_model, fused_moe
from mbd.model.attention import Masked
from mbd.model.llada2_moe import LLaDA2Experts, LLaDA2Gate, LLaDA2SparseMoE
from mbd.model.masks import block_causal_dense
from tests.conftest import tiny_cfg


INTERPRETED = fused_moe.interpreting()  # this process is the child


@pytest.fixture
def interpret():
    pytest.importorskip("triton")
    if not INTERPRETED:
        pytest.skip("runs in test_kernels_under_the_interpreter's child process")


def test_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("this is the child")
    root = Path(__file__).resolve().parents[2]
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", __file__],
                           cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                           timeout=540)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and "failed" not in child.stdout


def dense(x, idx, w, gate, up, down) -> torch.Tensor:
    """Every expert on every token in float64, weighted by the routing (0 where not chosen)."""
    x, gate, up, down = x.double(), gate.double(), up.double(), down.double()
    route = torch.zeros(x.shape[0], gate.shape[0], dtype=torch.float64).scatter(1, idx, w.double())
    h = F.silu(torch.einsum("td,efd->tef", x, gate)) * torch.einsum("td,efd->tef", x, up)
    return torch.einsum("tef,edf,te->td", h, down, route)


def ragged_routing(t: int, E: int, k: int, seed: int) -> torch.Tensor:
    """idx [t, k] of distinct experts per token, skewed: expert 0 most loaded (several BLOCK_M tiles once
    t >= 2 * BLOCK_M), the last quarter of the experts never chosen."""
    g = torch.Generator().manual_seed(seed)
    p = torch.tensor([0.0 if e >= E - E // 4 else 2.0 ** -e for e in range(E)])
    p[0] = 50.0
    return torch.stack([torch.multinomial(p, k, generator=g) for _ in range(t)])


def weights(E: int, d: int, ff: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) * 0.2 for s in ((E, ff, d), (E, ff, d), (E, d, ff))]


def test_align_puts_every_copy_once_in_its_experts_tiles(interpret):
    t, E, k = 64, 16, 4
    idx = ragged_routing(t, E, k, seed=1)
    sorted_ids, block_expert = fused_moe.align(idx, E)
    n, bm = t * k, fused_moe.BLOCK_M
    counts = torch.bincount(idx.flatten(), minlength=E)
    assert counts[0] > 2 * bm and counts[-1] == 0  # one expert spans several tiles, some have none
    padded = (counts + bm - 1) // bm * bm
    assert len(block_expert) == -(-n // bm) + min(n, E)
    used = int(padded.sum()) // bm
    assert block_expert[:used].tolist() == torch.repeat_interleave(torch.arange(E), padded // bm).tolist()
    assert bool((block_expert[used:] == -1).all()) and bool((sorted_ids[used * bm:] == n).all())
    rows = sorted_ids[: used * bm].view(used, bm)
    real = rows < n
    assert sorted(rows[real].tolist()) == list(range(n))  # each copy exactly once
    flat = idx.flatten()
    for tile, e in enumerate(block_expert[:used].tolist()):
        assert bool((flat[rows[tile][real[tile]].long()] == e).all())
    for e in range(E):  # within an expert, copies keep their order (a stable sort)
        mine = sorted_ids[: used * bm][(sorted_ids[: used * bm] < n)]
        mine = mine[flat[mine.long()] == e]
        assert mine.tolist() == sorted(mine.tolist())


@pytest.mark.parametrize("t,E,k,groups,topk_group,norm", [(7, 8, 2, 4, 2, True), (32, 16, 4, 4, 2, True),
                                                          (64, 16, 1, 1, 1, True), (1, 8, 4, 2, 1, False)])
def test_router_kernel_equals_the_torch_router(interpret, t, E, k, groups, topk_group, norm):
    cfg = tiny_cfg("llada2_moe", num_experts=E, num_experts_per_tok=k, n_group=groups, topk_group=topk_group,
                   norm_topk_prob=norm)
    gate = LLaDA2Gate(cfg).to(torch.bfloat16)
    g = torch.Generator().manual_seed(t)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(E, cfg.hidden_size, generator=g))
        gate.expert_bias.copy_(torch.randn(E, generator=g))
    x = torch.randn(t, cfg.hidden_size, generator=g).bfloat16()
    choice = torch.sigmoid(x.float() @ gate.weight.float().t()) + gate.expert_bias
    assert choice.sort(-1).values.diff(dim=-1).min() > 1e-5  # ties-free input
    assert gate.expert_bias.dtype == torch.float32
    with torch.no_grad():
        want_idx, want_w = gate(x, "grouped_mm")
        idx, w = gate(x, "triton")
    assert idx.tolist() == want_idx.tolist()
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-7)


SHAPES = [(1, 8, 1), (7, 16, 2), (32, 8, 4), (64, 16, 4)]


@pytest.mark.parametrize("t,E,k", SHAPES)
def test_fused_experts_equal_the_dense_sum_in_float32(interpret, t, E, k):
    d, ff = 32, 16
    gate, up, down = weights(E, d, ff, seed=t)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(k))
    idx = ragged_routing(t, E, k, seed=t + k)
    w = torch.rand(t, k, generator=torch.Generator().manual_seed(E))
    with torch.no_grad():
        got = fused_moe.experts(x, idx, w, gate, up, down, None, None)
    want = dense(x, idx, w, gate, up, down)
    torch.testing.assert_close(got.double(), want, atol=1e-5 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("t,E,k", [SHAPES[1], SHAPES[2]])
def test_fused_experts_equal_the_dense_sum_in_bfloat16_with_the_shared_expert(interpret, t, E, k):
    d, ff = 32, 16
    gate, up, down = (p.bfloat16() for p in weights(E, d, ff, seed=t))
    g = torch.Generator().manual_seed(k)
    x = torch.randn(t, d, generator=g).bfloat16()
    shared_gate_up, shared_down = (torch.randn(2 * ff, d, generator=g) * 0.2).bfloat16(), \
        (torch.randn(d, ff, generator=g) * 0.2).bfloat16()
    idx = ragged_routing(t, E, k, seed=t + k)
    w = torch.rand(t, k, generator=g)
    with torch.no_grad():
        got = fused_moe.experts(x, idx, w, gate, up, down, shared_gate_up, shared_down)
    assert got.dtype == torch.bfloat16
    sg, su = shared_gate_up.double().chunk(2)
    shared = (F.silu(x.double() @ sg.t()) * (x.double() @ su.t())) @ shared_down.double().t()
    want = dense(x, idx, w, gate, up, down) + shared
    torch.testing.assert_close(got.double(), want, atol=3e-2 * want.abs().max().item(), rtol=0)


def test_tiny_llada2_logits_fused_equal_the_dense_reference(interpret, monkeypatch):
    """A whole model with two MoE layers, n_group 4 / topk_group 2: the fused path's logits (router kernel,
    aligned experts, shared expert summed in) against the same model whose experts are the dense sum above."""
    cfg = tiny_cfg("llada2_moe", num_experts=16, num_experts_per_tok=4)
    model = build_model(cfg, seed=4).eval()
    ids = torch.randint(0, cfg.vocab_size - 3, (2, 8), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(8).expand(2, 8)
    mask = Masked(block_causal_dense(pos, 8, torch.full((2,), 8), cfg.block_size))
    with torch.no_grad():
        got = model(ids, pos, mask)
        monkeypatch.delenv("TRITON_INTERPRET")  # the reference: the torch router and the dense experts

        def reference(self, x, idx, w, shared=None, path=None):
            return (dense(x, idx, w, self.gate_proj, self.up_proj, self.down_proj).to(x.dtype) + shared(x))

        monkeypatch.setattr(LLaDA2Experts, "forward", reference)
        want = model(ids, pos, mask)
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=0)


def test_fused_moe_block_compiles_fullgraph(interpret):
    """The fused ops are opaque to Dynamo (custom ops with fake kernels): an MoE block with them compiles fullgraph
    (no graph break, as the compiled decode layer needs on CUDA) and gives the eager block's output."""
    moe = build_model(tiny_cfg("llada2_moe"), seed=5).model.layers[1].mlp
    h = torch.randn(1, 6, tiny_cfg("llada2_moe").hidden_size)
    with torch.no_grad():
        want = moe(h)
        got = torch.compile(moe, fullgraph=True, backend="aot_eager")(h)
    assert torch.equal(got, want)


def test_every_dtype_takes_a_grouped_path(monkeypatch):  # runs in both processes
    """float16 and float32 no longer run every expert on every token: CPU inference and training take
    torch._grouped_mm, float64 the per-expert loop, and the tokens' sum equals the loop over chosen experts."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.zeros(2, 4)
    with torch.no_grad():
        assert [fused_moe.expert_path(x.to(dt)) for dt in (torch.float32, torch.bfloat16, torch.float16)] == \
            ["grouped_mm"] * 3
        assert fused_moe.expert_path(x.double()) == "loop"
    assert fused_moe.expert_path(x) == "grouped_mm"  # gradients: the Triton kernels have no backward
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with torch.no_grad():
        assert fused_moe.expert_path(x.half()) == "triton"
    assert fused_moe.expert_path(x.half()) == "grouped_mm"
    moe = build_model(tiny_cfg("llada2_moe"), seed=1).model.layers[1].mlp
    assert isinstance(moe, LLaDA2SparseMoE)
    monkeypatch.delenv("TRITON_INTERPRET")
    h = torch.randn(9, tiny_cfg("llada2_moe").hidden_size)
    with torch.no_grad():
        idx, w = moe.gate(h)
        for dt, tol in ((torch.float16, 2e-2), (torch.float32, 1e-5)):
            m = moe.to(dt)
            got = m.experts(h.to(dt), idx, w)
            want = dense(h.to(dt), idx, w, m.experts.gate_proj, m.experts.up_proj, m.experts.down_proj)
            torch.testing.assert_close(got.double(), want, atol=tol * want.abs().max().item(), rtol=0)


def test_moe_step_benchmark_reads_its_floor_and_compares_the_paths(interpret):
    """benchmarks/moe_step.py at the tiny shape on CPU: the floor counts each chosen expert once plus the shared
    expert and the router (written out here), and the fused output equals the grouped_mm one."""
    from benchmarks.moe_step import measure, moe_layer

    m = measure("tiny-moe", tokens=4, device="cpu", dtype=torch.float32)
    moe = moe_layer("tiny-moe", "cpu", torch.float32)
    E, ff, d = moe.experts.gate_proj.shape
    assert m["floor_bytes"] == 4 * (m["experts_touched"] * 3 * ff * d + E * d + E + 3 * ff * d)
    assert 4 <= m["experts_touched"] <= 16
    assert m["fused_vs_grouped_mm"] < 1e-5


def signatures(dt: str) -> dict[str, tuple[dict, dict, int]]:
    """Each kernel's argument types, constexprs at LLaDA2-Mini's sizes (E 256, 8 groups, top-4 groups, k 8) and
    warps, as `fused_moe` launches it in dtype `dt`."""
    rows = dict(sorted_ptr="*i32", block_expert_ptr="*i32", n_copies="i32", D="i32", F="i32")
    tiles = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, WIDEN=False, PRECISION="ieee" if dt == "fp32" else "tf32")
    return {
        "route": (dict(x_ptr=f"*{dt}", w_ptr=f"*{dt}", bias_ptr="*fp32", idx_ptr="*i64", wt_ptr="*fp32", T="i32",
                       D="i32", stride_x="i32", stride_w="i32", scale="fp32"),
                  dict(E=256, E_PAD=256, G=8, G_PAD=8, TOPK_GROUP=4, K=8, K_PAD=8, NORM=True, BLOCK_T=16,
                       BLOCK_D=64), 8),
        "align": (dict(eid_ptr="*i64", N="i32", sorted_ptr="*i32", block_expert_ptr="*i32", P_MAX="i32",
                       NB_MAX="i32"), dict(E=256, E_PAD=256, BLOCK_M=16, CHUNK=64), 8),
        "gate_up": (dict(x_ptr=f"*{dt}", gate_ptr=f"*{dt}", up_ptr=f"*{dt}", h_ptr=f"*{dt}", **rows, stride_x="i32",
                         s_we="i32", s_wn="i32", s_wk="i32", stride_h="i32"), dict(TOP_K=8, **tiles), 4),
        "down": (dict(h_ptr=f"*{dt}", down_ptr=f"*{dt}", out_ptr="*fp32", sorted_ptr="*i32", block_expert_ptr="*i32",
                      route_w_ptr="*fp32", n_copies="i32", D="i32", F="i32", stride_h="i32", s_we="i32", s_wn="i32",
                      s_wk="i32", stride_out="i32"), tiles, 4),
        "combine": (dict(copies_ptr="*fp32", shared_ptr=f"*{dt}", out_ptr=f"*{dt}", T="i32", D="i32"),
                    dict(TOP_K=8, HAS_SHARED=True, BLOCK_T=16, BLOCK_D=128), 4),
    }


@pytest.mark.slow
@pytest.mark.parametrize("dt", ["bf16", "fp16", "fp32"])
def test_kernels_compile_for_an_h100_without_one(dt):
    """Triton's whole GPU pipeline (TTIR, TTGIR, LLVM IR, PTX, ptxas to a cubin) for sm_90 on this CPU machine:
    what the interpreter does not check (dot shapes and layouts, early returns, shared memory within the H100's
    227 KiB per block). About a minute per dtype on 2 cores."""
    triton = pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("the interpreter replaces the compiler in this process")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mbd.model import moe_kernels

    for name, (sig, const, warps) in signatures(dt).items():
        src = ASTSource(getattr(moe_kernels, name), {**sig, **{c: "constexpr" for c in const}}, const)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        assert "cubin" in compiled.asm and compiled.metadata.shared <= 227 * 1024, name
