"""How LLaDA2's MoE runs: the one choice of path (`expert_path`) and the fused Triton path (kernels in
`mbd.model.moe_kernels`).

Paths, by device, dtype and whether gradients are needed (each named; none falls back silently to another):
- "triton": inference on CUDA in float32 / bfloat16 / float16 (and on CPU under Triton's interpreter,
  TRITON_INTERPRET=1, which the tests use): the router in one kernel, token copies aligned by expert, gate|up as one
  GEMM with SiLU * up in its epilogue, down with the routing weight in its epilogue, a fixed-order sum per token;
  the shared expert overlaps the routed experts on a second CUDA stream. No backward.
- "grouped_mm": torch._grouped_mm over the copies sorted by expert (each used expert's weights read once; static
  shapes): CPU inference in the config's dtypes, and training (it has a backward; on CUDA bfloat16 runs CUTLASS,
  other dtypes torch's per-expert fallback, which synchronises with the host).
- "loop": float64 (tests' references; torch._grouped_mm refuses it, the config never asks for it, and float64 is
  never compiled or captured): a Python loop over the experts some token chose.

Each path runs every expert only on the tokens that chose it (the sum over all experts that float16 and float32
once ran, E / k times the FLOPs, is gone). Both Triton entry points are torch custom ops, so a compiled decoder
layer calls them as opaque kernels (`fullgraph` holds) and a CUDA Graph captures their launches.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch
import torch.nn.functional as F

Path = Literal["triton", "grouped_mm", "loop"]
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_M = 16  # rows per tile: the smallest tensor-core tile, as a decode step gives each expert a few copies
BLOCK_N, BLOCK_K = 64, 64  # untuned starting points for the card's run to tune (benchmarks/moe_step.py)


def interpreting() -> bool:
    """Triton's CPU interpreter is on (TRITON_INTERPRET=1): its kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def expert_path(x: torch.Tensor) -> Path:
    """The one place the MoE's path is chosen, for the router and the experts alike (module docstring)."""
    if x.dtype == torch.float64:
        return "loop"
    if not torch.is_grad_enabled() and x.dtype in TRITON_DTYPES and (x.is_cuda or interpreting()):
        return "triton"
    return "grouped_mm"


@functools.cache
def kernels():
    """The Triton kernels, imported on first use (Triton is absent from CPU-only installs)."""
    import mbd.model.moe_kernels as moe_kernels

    return moe_kernels


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@torch.library.custom_op("mbd::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm (rows of a [n, k] grouped by the ends `offs`, group g times b[g] [k, m]) as an op whose
    fake kernel takes every dtype the CPU kernel takes: torch's own takes bfloat16 only, which fails a compiled
    float32 layer. The "grouped_mm" path's inference; it has no backward, so training calls torch._grouped_mm."""
    return torch._grouped_mm(a, b, offs=offs)


@grouped_mm.register_fake
def _(a, b, offs):
    return a.new_empty(a.shape[0], b.shape[-1])


@torch.library.custom_op("mbd::llada2_route", mutates_args=())
def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
          norm: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`LLaDA2Gate`'s routing in one kernel: fp32 logits of x [t, d] against weight [E, d], sigmoid scores, the
    fp32 expert bias steering the group-limited top-k, the chosen scores (normalised, scaled) as weights.
    Returns idx [t, top_k] int64, w [t, top_k] float32."""
    x = x.contiguous()
    t, d = x.shape
    e = weight.shape[0]
    idx = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    w = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    if t:
        block_t = 16
        kernels().route[(_cdiv(t, block_t),)](
            x, weight, bias.float(), idx, w, t, d, x.stride(0), weight.stride(0), scale, E=e,
            E_PAD=max(16, _next_pow2(e)), G=n_group, G_PAD=_next_pow2(n_group), TOPK_GROUP=topk_group, K=top_k,
            K_PAD=_next_pow2(top_k), NORM=norm and top_k > 1, BLOCK_T=block_t, BLOCK_D=64, num_warps=8)
    return idx, w


@route.register_fake
def _(x, weight, bias, n_group, topk_group, top_k, norm, scale):
    return x.new_empty(x.shape[0], top_k, dtype=torch.int64), x.new_empty(x.shape[0], top_k, dtype=torch.float32)


def align(idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The copies of idx [t, k] (flat index token * k + j) ordered by expert, each expert's run padded to a multiple
    of BLOCK_M with the index t * k (no copy): sorted [tiles * BLOCK_M], and each tile's expert (-1: unused tile).
    The number of tiles is the most any routing needs, so every launch's grid is fixed by t, k and E."""
    n = idx.numel()
    tiles = _cdiv(n, BLOCK_M) + min(n, num_experts)
    sorted_ids = torch.empty(tiles * BLOCK_M, dtype=torch.int32, device=idx.device)
    block_expert = torch.empty(tiles, dtype=torch.int32, device=idx.device)
    kernels().align[(1,)](idx.reshape(-1), n, sorted_ids, block_expert, tiles * BLOCK_M, tiles, E=num_experts,
                          E_PAD=max(16, _next_pow2(num_experts)), BLOCK_M=BLOCK_M, CHUNK=64, num_warps=8)
    return sorted_ids, block_expert


@torch.library.custom_op("mbd::llada2_experts", mutates_args=())
def experts(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
            down: torch.Tensor, shared_gate_up: torch.Tensor | None, shared_down: torch.Tensor | None) -> torch.Tensor:
    """sum_j w[:, j] * expert_idx[:, j](x) (+ the shared expert's SwiGLU) for x [t, d]; gate, up [E, ff, d] and
    down [E, d, ff] as the checkpoint stacks them (under TP this rank's slice: a partial sum)."""
    x = x.contiguous()
    t, d = x.shape
    top_k = idx.shape[1]
    shared = _shared_expert(x, shared_gate_up, shared_down)
    out = torch.empty_like(x)
    copies = _routed_copies(x, idx, w.float().reshape(-1), gate, up, down) if t else None
    if shared is not None and x.is_cuda:  # join the shared expert's stream
        torch.cuda.current_stream(x.device).wait_stream(_side_stream(x.device))
    if t:
        kernels().combine[(_cdiv(t, 16), _cdiv(d, 128))](copies, shared, out, t, d, TOP_K=top_k,
                                                          HAS_SHARED=shared is not None, BLOCK_T=16, BLOCK_D=128)
    return out


@experts.register_fake
def _(x, idx, w, gate, up, down, shared_gate_up, shared_down):
    return torch.empty_like(x)


def _routed_copies(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                   down: torch.Tensor) -> torch.Tensor:
    """Each copy's weighted expert output [t * k, d] float32, at the copy's own row."""
    k = kernels()
    n, (num_experts, ff, d) = idx.numel(), gate.shape
    sorted_ids, block_expert = align(idx, num_experts)
    widen = interpreting() and x.dtype == torch.bfloat16
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 stays fp32 (TF32 would change the tokens)
    tiles = block_expert.shape[0]
    h = torch.empty(sorted_ids.shape[0], ff, dtype=x.dtype, device=x.device)
    assert gate.stride() == up.stride(), "gate_proj and up_proj share one layout"
    k.gate_up[(tiles, _cdiv(ff, BLOCK_N))](
        x, gate, up, h, sorted_ids, block_expert, n, d, ff, x.stride(0), *gate.stride(), h.stride(0),
        TOP_K=idx.shape[1], BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, WIDEN=widen, PRECISION=precision)
    copies = torch.empty(n, d, dtype=torch.float32, device=x.device)
    k.down[(tiles, _cdiv(d, BLOCK_N))](
        h, down, copies, sorted_ids, block_expert, w, n, d, ff, h.stride(0), *down.stride(), copies.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, WIDEN=widen, PRECISION=precision)
    return copies


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The second stream the shared expert runs on, one per device."""
    return torch.cuda.Stream(device)


def _shared_expert(x: torch.Tensor, gate_up: torch.Tensor | None, down: torch.Tensor | None) -> torch.Tensor | None:
    """The shared expert's SwiGLU (`mbd.model.layers.SwiGLU` on its weights: gate|up [2 ff, d], down [d, ff]).
    On CUDA it is queued on a second stream after an event of the current one, so that it overlaps the routed
    experts; the caller waits for that stream before reading it (`experts`). Inside a CUDA Graph capture the fork
    and the join become the graph's edges. Its output is allocated on the current stream before the fork, so no
    block is shared between the streams' allocations."""
    if gate_up is None or down is None:
        return None
    out = torch.empty(x.shape[0], down.shape[0], dtype=x.dtype, device=x.device)
    if not x.is_cuda:
        return _swiglu(x, gate_up, down, out)
    side = _side_stream(x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        _swiglu(x, gate_up, down, out)
    return out


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    g, u = F.linear(x, gate_up).chunk(2, dim=-1)
    return torch.matmul(F.silu(g) * u, down.t(), out=out)
