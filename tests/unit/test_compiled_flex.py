"""Compiled FlexAttention on CPU (torch.compile, inductor) in the engine: every decode forward's logits equal
SDPA's on the same inputs within a stated tolerance, and the kernel compiles once per static shape (batch bucket,
query slots, key span), never per step.

Each engine step runs the decode forward twice on the same buffers and cache: compiled flex first, then SDPA,
whose K/V are the ones left in the cache, so the run is exactly the SDPA engine's (asserted) and every step
compares the two kernels on identical inputs. fp32 (inductor's CPU flex kernel takes no float64); tolerance
1e-4 absolute on logits of order 10 (the two kernels sum in different orders). A compile costs ~10 s of CPU on
2 cores (the first one in a process ~20 s), so the default suite runs one shape; the B=4 / B=32 x SingleBD /
MultiBD matrix with changing spans and batch buckets is `slow`.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from mbd.config import DecodeConfig, EngineConfig
from mbd.decoding import Engine
from mbd.model import build_model
from tests.conftest import tiny_cfg

ATOL = 1e-4


def tempered(block: int):
    model = build_model(tiny_cfg("sdar", block_size=block, max_position_embeddings=512), seed=0).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return model


def compare_kernels(engine: Engine) -> tuple[list[float], set[tuple[int, int, int]]]:
    """Make every decode forward of `engine` run compiled flex then SDPA; returns the per-step max |logit
    difference| list and the set of flex shapes (batch, query positions, key span) it was called with."""
    runner, diffs, shapes = engine.runner, [], set()
    forward = runner.forward

    def both(b, slots, span, active, chunks=(), home=False):
        runner.attention, runner.compile = "flex", "default"
        runner._inputs.clear()
        flex = forward(b, slots, span, active, chunks, home)[0].clone()
        runner.attention = "sdpa"
        runner._inputs.clear()
        out = forward(b, slots, span, active, chunks, home)
        diffs.append((flex - out[0]).abs().max().item() if flex.numel() else 0.0)
        shapes.add((b, slots * runner.block, span))
        return out

    runner.forward = both
    return diffs, shapes


def run_case(block: int, n_buf: int, rows: int, buckets: list[int], prompts: list[list[int]], new: int,
             joins: int = 0):
    """Decode `prompts` through a dual-kernel engine (the last `joins` of them admitted mid-run, so the batch
    bucket changes) and through a plain SDPA engine; returns (diffs, shapes, compiles, tokens equal)."""
    model = tempered(block)
    dc = DecodeConfig(buffer_size=n_buf, tau_add=0.25 if n_buf > 1 else None, tau_semi=0.5, tau_m2t=0.2,
                      max_length=512, max_new_tokens=new, max_nfe=400)
    ecfg = EngineConfig(max_batch_rows=rows, batch_buckets=buckets, cuda_graphs="off")
    engine = Engine(model, None, dc, ecfg)
    diffs, shapes = compare_kernels(engine)
    before = counters["stats"]["unique_graphs"]
    ids = [engine.add_request(p) for p in prompts[: len(prompts) - joins]]
    out: dict[str, list[int]] = {}
    while engine.has_unfinished() or len(ids) < len(prompts):
        if engine.scheduler.running and len(ids) < len(prompts):
            ids.append(engine.add_request(prompts[len(ids)]))
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    compiles = counters["stats"]["unique_graphs"] - before
    want = Engine(model, None, dc, ecfg).generate(prompts)
    return diffs, shapes, compiles, [out[i] for i in ids] == [r.token_ids for r in want]


def check(diffs, shapes, compiles, same, steps_per_compile: float = 2.0):
    assert same, "the dual-kernel run left the SDPA engine's trajectory"
    assert max(diffs) < ATOL, max(diffs)
    # one compilation per static shape, none per step: flex_kernel is cached per process, so a shape compiled
    # by an earlier test is not compiled again (compiles <= shapes), and a new one is compiled exactly once
    assert compiles <= len(shapes) and len(diffs) >= steps_per_compile * max(compiles, 1), (compiles, shapes, len(diffs))


def test_compiled_flex_logits_equal_sdpa_singlebd_b4():
    """One static shape (batch bucket 2, one slot, key span 64): one compile, then replays for every step."""
    prompts = [list(range(3, 13)), [5, 9, 2, 7, 11, 4]]
    diffs, shapes, compiles, same = run_case(4, 1, 2, [2], prompts, 24)
    assert shapes == {(2, 4, 64)}
    check(diffs, shapes, compiles, same, steps_per_compile=8)


@pytest.mark.slow
@pytest.mark.timeout(2400)  # each new shape compiles for ~10 s of CPU; a loaded machine stretches that
@pytest.mark.parametrize("block,n_buf", [(4, 1), (4, 2), (32, 1), (32, 2)])
def test_compiled_flex_logits_equal_sdpa_matrix(block, n_buf):
    """B=4 and B=32, SingleBD and MultiBD; a long prompt moves the key span through several buckets, and a
    request joining mid-run moves the batch bucket from 1 to 2."""
    long_prompt = [(7 * i + 3) % 60 for i in range(150)]
    prompts = [long_prompt, [(5 * i + 1) % 60 for i in range(9)]]
    diffs, shapes, compiles, same = run_case(block, n_buf, 2, [1, 2], prompts, 40 if block == 4 else 96, joins=1)
    assert len({s[2] for s in shapes}) >= 2 and len({s[0] for s in shapes}) == 2, shapes
    check(diffs, shapes, compiles, same)
