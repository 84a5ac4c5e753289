"""Triton kernels of LLaDA2's fused MoE (`mbd.model.fused_moe` launches them; imported only there, lazily, since
Triton comes with torch's CUDA wheels and `mbd` imports without it).

Five kernels per MoE layer, every grid fixed by the shapes alone (no host synchronisation: CUDA Graph capturable):
- `route`: the router's fp32 logits, sigmoid, the expert bias, group-limited top-k and the weights' normalisation,
  one program per BLOCK_T tokens (the whole router in one launch);
- `align`: the token copies (token, k-th choice) ordered by expert and each expert's run padded to a multiple of
  BLOCK_M, so that every tile of rows belongs to one expert (`block_expert`; -1 for unused tiles);
- `gate_up`: per (tile, column block) the gate and up GEMMs of the tile's expert side by side, SiLU(gate) * up in
  the epilogue (one pass over the tile's rows and the expert's gate|up rows);
- `down`: the down GEMM, the routing weight multiplied in the epilogue, each copy's row written at its own place;
- `combine`: each token's k rows summed in a fixed order (deterministic, no atomics) plus the shared expert.

WIDEN (constexpr) widens 16-bit tiles to float32 before `tl.dot`: Triton's CPU interpreter multiplies bfloat16 as
its raw integers, so the tests set it there; the products are the same (bf16 -> fp32 is exact, the accumulator is
fp32 either way). On a GPU it is off and the tensor cores take the 16-bit tiles.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def route(x_ptr, w_ptr, bias_ptr, idx_ptr, wt_ptr, T, D, stride_x, stride_w, scale,
          E: tl.constexpr, E_PAD: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
          K: tl.constexpr, K_PAD: tl.constexpr, NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    cols = tl.arange(0, E_PAD)
    cmask = cols < E
    ds = tl.arange(0, BLOCK_D)
    logits = tl.zeros([BLOCK_T, E_PAD], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dmask = d0 + ds < D
        xt = tl.load(x_ptr + rows[:, None] * stride_x + (d0 + ds)[None, :], mask=rmask[:, None] & dmask[None, :],
                     other=0.0).to(tl.float32)
        wt = tl.load(w_ptr + cols[None, :] * stride_w + (d0 + ds)[:, None], mask=cmask[None, :] & dmask[:, None],
                     other=0.0).to(tl.float32)
        logits = tl.dot(xt, wt, logits, input_precision="ieee")
    scores = tl.sigmoid(logits)
    bias = tl.load(bias_ptr + cols, mask=cmask, other=0.0)
    choice = tl.where(cmask[None, :], scores + bias[None, :], float("-inf"))
    group = cols // (E // G)
    gcols = tl.arange(0, G_PAD)
    gscore = tl.full([BLOCK_T, G_PAD], float("-inf"), tl.float32)
    for g in tl.static_range(G):  # a group's score: the sum of its top-2 choices (top-1 for one-expert groups)
        v = tl.where((group == g)[None, :], choice, float("-inf"))
        top = tl.argmax(v, axis=1)
        s = tl.max(v, axis=1)
        if E // G > 1:
            s += tl.max(tl.where(cols[None, :] == top[:, None], float("-inf"), v), axis=1)
        gscore = tl.where(gcols[None, :] == g, s[:, None], gscore)
    kept = tl.zeros([BLOCK_T, E_PAD], dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.argmax(gscore, axis=1)
        kept = kept | (group[None, :] == best[:, None])
        gscore = tl.where(gcols[None, :] == best[:, None], float("-inf"), gscore)
    choice = tl.where(kept, choice, float("-inf"))
    kcols = tl.arange(0, K_PAD)
    chosen = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int64)
    weight = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.argmax(choice, axis=1)
        hit = cols[None, :] == best[:, None]
        chosen = tl.where(kcols[None, :] == j, best.to(tl.int64)[:, None], chosen)
        weight = tl.where(kcols[None, :] == j, tl.sum(tl.where(hit, scores, 0.0), axis=1)[:, None], weight)
        choice = tl.where(hit, float("-inf"), choice)
    if NORM:
        weight = weight / (tl.sum(weight, axis=1)[:, None] + 1e-20)
    out = rows[:, None] * K + kcols[None, :]
    omask = rmask[:, None] & (kcols < K)[None, :]
    tl.store(idx_ptr + out, chosen, mask=omask)
    tl.store(wt_ptr + out, weight * scale, mask=omask)


@triton.jit
def align(eid_ptr, N, sorted_ptr, block_expert_ptr, P_MAX, NB_MAX, E: tl.constexpr, E_PAD: tl.constexpr,
          BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    ecols = tl.arange(0, E_PAD)
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, N, CHUNK):
        e = tl.load(eid_ptr + c0 + offs, mask=c0 + offs < N, other=E_PAD)
        counts += tl.sum((e[:, None] == ecols[None, :]).to(tl.int32), axis=0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    total = tl.sum(padded, axis=0)
    fill = tl.arange(0, 8 * CHUNK)
    for p0 in range(0, P_MAX, 8 * CHUNK):
        tl.store(sorted_ptr + p0 + fill, N, mask=p0 + fill < P_MAX)
    for b0 in range(0, NB_MAX, CHUNK):  # a tile's expert: how many experts' runs end at or before its first row
        b = b0 + offs
        ex = tl.sum(((end[None, :] <= (b * BLOCK_M)[:, None]) & (ecols < E)[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(b * BLOCK_M < total, ex, -1), mask=b < NB_MAX)
    tl.debug_barrier()  # the padding above is written before the copies below land on some of it
    placed = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, N, CHUNK):  # copies in index order: stable within an expert, like a stable argsort
        e = tl.load(eid_ptr + c0 + offs, mask=c0 + offs < N, other=E_PAD)
        onehot = (e[:, None] == ecols[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - 1 + (start + placed)[None, :]
        dest = tl.sum(onehot * rank, axis=1)
        tl.store(sorted_ptr + dest, c0 + offs, mask=c0 + offs < N)
        placed += tl.sum(onehot, axis=0)


@triton.jit
def gate_up(x_ptr, gate_ptr, up_ptr, h_ptr, sorted_ptr, block_expert_ptr, n_copies, D, F, stride_x, s_we, s_wn,
            s_wk, stride_h, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, WIDEN: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    sid = tl.load(sorted_ptr + rows)
    valid = sid < n_copies
    tok = sid // TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < F
    ks = tl.arange(0, BLOCK_K)
    w_off = e.to(tl.int64) * s_we + cols[None, :] * s_wn + ks[:, None] * s_wk  # [BLOCK_K, BLOCK_N]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        kmask = k0 + ks < D
        a = tl.load(x_ptr + tok[:, None] * stride_x + (k0 + ks)[None, :], mask=valid[:, None] & kmask[None, :],
                    other=0.0)
        wmask = kmask[:, None] & cmask[None, :]
        g = tl.load(gate_ptr + w_off + k0 * s_wk, mask=wmask, other=0.0)
        u = tl.load(up_ptr + w_off + k0 * s_wk, mask=wmask, other=0.0)
        if WIDEN:
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], h.to(h_ptr.dtype.element_ty),
             mask=valid[:, None] & cmask[None, :])


@triton.jit
def down(h_ptr, down_ptr, out_ptr, sorted_ptr, block_expert_ptr, route_w_ptr, n_copies, D, F, stride_h, s_we,
         s_wn, s_wk, stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
         WIDEN: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    sid = tl.load(sorted_ptr + rows)
    valid = sid < n_copies
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < D
    ks = tl.arange(0, BLOCK_K)
    w_off = e.to(tl.int64) * s_we + cols[None, :] * s_wn + ks[:, None] * s_wk  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        kmask = k0 + ks < F
        a = tl.load(h_ptr + rows[:, None] * stride_h + (k0 + ks)[None, :], mask=valid[:, None] & kmask[None, :],
                    other=0.0)
        w = tl.load(down_ptr + w_off + k0 * s_wk, mask=kmask[:, None] & cmask[None, :], other=0.0)
        if WIDEN:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    acc = acc * tl.load(route_w_ptr + sid, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + sid[:, None] * stride_out + cols[None, :], acc, mask=valid[:, None] & cmask[None, :])


@triton.jit
def combine(copies_ptr, shared_ptr, out_ptr, T, D, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr,
            BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows < T)[:, None] & (cols < D)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(copies_ptr + (rows * TOP_K + j)[:, None] * D + cols[None, :], mask=mask, other=0.0)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
