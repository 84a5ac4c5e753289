"""Block Buffer engine vs its references on tiny random models of both families (float64, so that the
different but mathematically equal computations cannot flip a greedy decision).

The random models are tempered (lm_head scaled) so that some positions pass tau_m2t and others need the
semi-complete fallback, and tau_add is low so that several blocks are active at once: every equivalence
test asserts that more than one block was active, so it cannot pass on the trivial SingleBD path.
"""

import pytest
import torch

from mbd.config import DecodeConfig
from mbd.decoding import Engine, EngineConfig, NaiveMultiBD, SingleBD
from mbd.decoding.runner import span_bucket
from mbd.decoding.trace import summarize
from mbd.model import KVCache, build_model
from mbd.model.attention import Cached
from mbd.model.layers import attend
from mbd.model.masks import PagedDecodeMask, block_causal_dense
from tests.conftest import tiny_cfg


def block_histories(trace: list[dict], aligned_prompt: int, block: int) -> dict[int, list[str]]:
    """Per generated block index, its state at every forward (IN_CACHE once committed, DUMMY before)."""
    out: dict[int, list[str]] = {}
    n_blocks = max((e["prefix_len"] - aligned_prompt) // block + len(e["states"]) for e in trace) if trace else 0
    for e in trace:
        first = (e["prefix_len"] - aligned_prompt) // block
        for k in range(n_blocks):
            j = k - first
            state = "IN_CACHE" if j < 0 else (e["states"][j] if j < len(e["states"]) else "DUMMY")
            out.setdefault(k, []).append(state)
    return out


PROMPTS = [list(range(3, 13)), list(range(20, 28)), [5, 9, 2], list(range(30, 47))]  # tails 2, 0, 3, 1


def tempered_model(family, scale=10.0, seed=0, **kw):
    cfg = tiny_cfg(family, **kw)
    model = build_model(cfg, seed=seed).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model, cfg


def dcfg(**kw):
    base = dict(buffer_size=3, max_length=160, max_new_tokens=36, max_nfe=200, tau_add=0.25, tau_semi=0.5, tau_m2t=0.2)
    base.update(kw)
    return DecodeConfig(**base)


def max_active(trace):
    return max(sum(s == "ACTIVE" for s in e["states"]) for e in trace)


@pytest.mark.parametrize("kw", [
    dict(tau_m2t=0.1),
    dict(tau_m2t=0.2, tau_stable=0.5),
    dict(tau_m2t=0.5, tau_add=0.5, tau_semi=0.75),
    dict(tau_m2t=0.1, tau_t2t=0.5, max_nfe=60),
    dict(buffer_size=2, tau_m2t=0.1),
])
def test_engine_equals_naive_multibd(family, kw):
    model, cfg = tempered_model(family)
    dc = dcfg(**kw)
    engine = Engine(model, None, dc, EngineConfig(max_batch_rows=1, trace=True))
    naive = NaiveMultiBD(model, dc, [cfg.eos_token_id])
    multi = False
    for prompt in PROMPTS:
        got = engine.generate([prompt])[0]
        want = naive.generate(prompt)
        assert (got.token_ids, got.nfe, got.finish_reason, got.num_generated) == \
            (want.token_ids, want.nfe, want.finish_reason, want.num_generated)
        assert max_active(got.trace) == max(want.active_counts)
        multi |= max(want.active_counts) > 1
    assert multi, "no step had more than one active block: the test would be trivial"


@pytest.mark.parametrize("buffer_size,tau_add", [(1, None), (3, 1.5), (4, 1.01)])
def test_singlebd_equivalences(family, buffer_size, tau_add):
    model, cfg = tempered_model(family)
    dc = dcfg(buffer_size=buffer_size, tau_add=tau_add, tau_m2t=0.1)
    engine = Engine(model, None, dc, EngineConfig(max_batch_rows=1, trace=True))
    ref = SingleBD(model, dc, [cfg.eos_token_id])
    for prompt in PROMPTS:
        got, want = engine.generate([prompt])[0], ref.generate(prompt)
        assert (got.token_ids, got.nfe, got.finish_reason) == (want.token_ids, want.nfe, want.finish_reason)
        assert max_active(got.trace) == 1


def test_kv_cached_decoding_equals_full_recompute(family):
    model, cfg = tempered_model(family)
    for dc in (dcfg(tau_m2t=0.1), dcfg(buffer_size=1, tau_add=None, tau_m2t=0.1)):
        engine = Engine(model, None, dc, EngineConfig(max_batch_rows=1))
        full = NaiveMultiBD(model, dc, [cfg.eos_token_id], recompute=True)
        single_full = SingleBD(model, dc, [cfg.eos_token_id], recompute=True)
        for prompt in PROMPTS[:3]:
            got = engine.generate([prompt])[0]
            want = full.generate(prompt)
            assert (got.token_ids, got.nfe) == (want.token_ids, want.nfe)
            if dc.buffer_size == 1:
                assert single_full.generate(prompt).token_ids == got.token_ids


def test_forward_shapes_come_from_buckets():
    """Shapes are static per bucket: batch = a batch bucket, queries = k whole slots (k <= N_buf: only
    trailing DUMMY slots are skipped), keys = a span bucket; a fully static batch stays at batch_slots."""
    model, _ = tempered_model("sdar")
    engine = Engine(model, None, dcfg(tau_m2t=0.1), EngineConfig(max_batch_rows=1))
    engine.generate(PROMPTS)
    shapes = engine.runner.shapes
    assert {b for b, _, _ in shapes} == {1} and {q for _, q, _ in shapes} == {4, 8, 12}
    assert all(span == span_bucket(span, engine.runner.cache.size) for _, _, span in shapes)
    assert shapes.total() == engine.stats.steps
    engine = Engine(model, None, dcfg(tau_m2t=0.1), EngineConfig(max_batch_rows=3, batch_buckets=[3]))
    engine.generate(PROMPTS + PROMPTS[:2])
    assert {b for b, _, _ in engine.runner.shapes} == {3}


def run_batch_with_joins(engine, jobs):
    """jobs: (step at which to add, prompt, params). Returns {request_id: tokens} and the running-set sizes."""
    out, occupancy, step, ids = {}, [], 0, {}
    pending = sorted(jobs, key=lambda j: j[0])
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            ids[engine.add_request(prompt, params)] = prompt
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        occupancy.append(len(engine.scheduler.running))
        step += 1
    return ids, out, occupancy


def test_batch_equals_alone_with_joins_and_leaves(family):
    model, cfg = tempered_model(family)
    dc = dcfg(tau_m2t=0.1)
    naive = NaiveMultiBD(model, dc, [cfg.eos_token_id])
    jobs = [(0, PROMPTS[0], None), (0, PROMPTS[1], {"max_new_tokens": 6}), (2, PROMPTS[2], {"buffer_size": 2}),
            (3, PROMPTS[3], None), (5, PROMPTS[1], {"max_new_tokens": 13, "tau_m2t": 0.3}), (9, [7, 7, 7, 7, 7], None)]
    for buckets in (None, [3]):
        engine = Engine(model, None, dc, EngineConfig(max_batch_rows=3, batch_buckets=buckets))
        ids, out, occupancy = run_batch_with_joins(engine, jobs)
        assert max(occupancy) == 3 and 0 < min(occupancy[:-1]) < 3  # full at times, requests left mid-run
        for (rid, prompt), (_, _, params) in zip(ids.items(), jobs):
            alone = NaiveMultiBD(model, engine.resolve_params(params), [cfg.eos_token_id]).generate(prompt)
            assert out[rid] == alone.token_ids
        assert engine.num_free_rows() == 3 and not engine.has_unfinished()
    assert naive.generate(PROMPTS[0]).token_ids == out[next(iter(ids))]


ORDER = ["DUMMY", "ACTIVE", "TO_CACHE", "IN_CACHE"]


def test_slot_transitions_and_decode_store_overlap(family):
    model, _ = tempered_model(family)
    engine = Engine(model, None, dcfg(tau_m2t=0.1, max_new_tokens=40), EngineConfig(max_batch_rows=1, trace=True))
    for prompt in PROMPTS:
        res = engine.generate([prompt])[0]
        aligned = len(prompt) // 4 * 4
        histories = block_histories(res.trace, aligned, 4)
        assert len(histories) >= 5
        for k, hist in histories.items():
            ranks = [ORDER.index(s) for s in hist]
            assert all(b - a in (0, 1) for a, b in zip(ranks, ranks[1:])), (k, hist)  # only the next state
            if "IN_CACHE" in hist:  # committed only after a forward that re-ran its final tokens
                assert hist.index("TO_CACHE") < hist.index("IN_CACHE")
        overlap = [e for e in res.trace if e["states"][0] == "TO_CACHE" and "ACTIVE" in e["states"]]
        assert overlap, "a completed block was never stored while a later block was decoded"
        stats = summarize([res.trace])
        hist = stats["active_blocks_hist"]
        assert stats["forwards"] == res.nfe == sum(hist.values())
        last = res.trace[-1]  # the forward that stores the last blocks ends the request and decodes nothing
        assert all(r is None for r in last["mask_ratio"]) and "TO_CACHE" in last["states"]
        decoding = sum(k * v for k, v in hist.items()) / (res.nfe - hist.get(0, 0))
        assert 1 <= decoding <= 3 and all(0 <= r <= 1 for r in stats["mask_ratio_by_rank"].values())


def test_committed_kv_equals_full_forward(family):
    model, cfg = tempered_model(family)
    engine = Engine(model, None, dcfg(tau_m2t=0.1, max_new_tokens=30), EngineConfig(max_batch_rows=2))
    prompt = PROMPTS[0]
    reqs = [engine._add(p, None, None) for p in (PROMPTS[2], prompt)]  # the second request decodes in row 1
    while engine.has_unfinished():
        engine.step()
    res = [engine.result(r) for r in reqs]
    assert res[1].finish_reason == "length"
    cache = engine.runner.cache
    assert 1 not in engine.scheduler.running and engine.kv.tables[1] == []  # a finished row holds nothing
    # its committed full pages stay in the pool, registered for reuse under the sequence's tokens
    seq = (prompt + res[1].token_ids)[: reqs[1].committed]
    pages = [p for p, _ in engine.kv.match(seq)]
    n = len(pages) * cache.page_size
    assert n > len(prompt) + 8 and n > reqs[1].committed - cache.page_size
    ref = KVCache(cfg, 1, n, dtype=torch.float64, page_size=cache.page_size)
    pos = torch.arange(n)[None]
    with torch.no_grad():
        model(torch.tensor([seq[:n]]), pos, Cached(ref, block_causal_dense(pos, n, torch.tensor([n]), 4), pos))
    for got, want in ((cache.k, ref.k), (cache.v, ref.v)):  # [layers, kvh, pages, page, d] -> positions
        torch.testing.assert_close(got[:, :, pages].flatten(2, 3), want[:, :, 1:1 + len(pages)].flatten(2, 3),
                                   atol=1e-10, rtol=1e-10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_equals_eager():
    cfg = tiny_cfg("sdar")
    model = build_model(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    model = model.cuda()
    dc = dcfg(tau_m2t=0.1)
    graph = Engine(model, None, dc, EngineConfig(max_batch_rows=4, attention="flex", compile="off", cuda_graphs="on"))
    eager = Engine(model, None, dc, EngineConfig(max_batch_rows=4, attention="sdpa"))
    compiled = Engine(model, None, dc, EngineConfig(max_batch_rows=4, attention="flex", cuda_graphs="on"))
    a, b, c = graph.generate(PROMPTS), eager.generate(PROMPTS), compiled.generate(PROMPTS)
    assert graph.runner.compiled.graphs and compiled.runner.compiled.graphs, "no graph was captured"
    assert [r.token_ids for r in a] == [r.token_ids for r in b] == [r.token_ids for r in c]
    assert [r.nfe for r in a] == [r.nfe for r in b] == [r.nfe for r in c]


def test_span_bucket_bounds():
    size = 5000
    spans = set()
    for need in range(1, size + 1):
        s = span_bucket(need, size)
        assert need <= s <= size and (s <= need + 63 or s <= need * 1.25), (need, s)
        spans.add(s)
    assert len(spans) <= 40  # O(log size) shapes: one CUDA Graph each


def test_span_buckets_equal_full_cache(family):
    """Prompts of very different lengths share a batch: every forward attends over the bucketed span of the
    longest row only, and each request still decodes exactly what the full-cache reference decodes alone."""
    model, _ = tempered_model(family)
    model.cfg = tiny_cfg(family, max_position_embeddings=1024)
    dc = dcfg(max_length=600, max_new_tokens=24, tau_m2t=0.1)
    long_prompts = [list(range(3, 13)), [(7 * i) % 60 for i in range(131)], [(5 * i + 1) % 60 for i in range(330)]]
    engine = Engine(model, None, dc, EngineConfig(max_batch_rows=2))
    jobs = [(0, long_prompts[0], None), (0, long_prompts[1], None), (4, long_prompts[2], {"buffer_size": 2}),
            (6, long_prompts[0], {"max_new_tokens": 40})]
    ids, out, _ = run_batch_with_joins(engine, jobs)
    for (rid, prompt), (_, _, params) in zip(ids.items(), jobs):
        alone = NaiveMultiBD(model, engine.resolve_params(params), [model.cfg.eos_token_id]).generate(prompt)
        assert out[rid] == alone.token_ids
    spans = {s[2] for s in engine.runner.shapes}
    assert len(spans) >= 3 and max(spans) < engine.runner.cache.size, spans


def test_span_forward_equals_full_cache_forward():
    model, cfg = tempered_model("sdar")
    engine = Engine(model, None, dcfg(tau_m2t=0.1), EngineConfig(max_batch_rows=2))
    for p in (PROMPTS[3], PROMPTS[0]):
        engine.add_request(p)
    for _ in range(6):
        engine.step()
    runner = engine.runner
    runner.sync(engine.scheduler.decode_batch().layout)  # the device state the next forward would see
    n_buf, size, longest = engine.n_buf, runner.cache.size, int(runner.cache.lengths.max())
    with torch.inference_mode():
        # a window of all n_buf slots starts at slot 0: logits of every position
        short = runner.forward(2, n_buf, n_buf, longest)[0].clone()
        full = runner._logits(2, n_buf, n_buf, runner._dense(2, n_buf, size, False))[0].clone()
        first = runner.forward(2, 1, 1, longest)[0]
    assert span_bucket(longest + n_buf * 4, size) < size
    torch.testing.assert_close(short, full, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(first, full[:, :4], atol=1e-10, rtol=1e-10)  # a slot's logits ignore later slots


def test_paged_mask_reads_each_rows_pages_where_they_lie():
    """The paged BlockMask over the whole pool, for rows with scattered and shared pages, partial prefixes,
    DUMMY slots and a free row: its blocks are right by construction (full pages wholly visible to every query,
    no visible key in a skipped page), and attention over the pool equals the dense mask over each row's keys
    gathered in logical order."""
    B, P, n_buf, num_pages, width = 4, 8, 3, 12, 6
    tables = [[3, 7, 1], [3, 9], [10, 2, 5, 4], []]  # row 1 shares row 0's first page (a cached prefix)
    lengths = torch.tensor([12, 8, 16, 0])  # committed: mid-page, page-aligned, two pages, a free row
    resident = torch.tensor([2, 3, 1, 0])
    page_table = torch.zeros(4, width, dtype=torch.long)
    for r, t in enumerate(tables):
        page_table[r, :len(t)] = torch.tensor(t, dtype=torch.long)
    m = PagedDecodeMask(4, n_buf, B, P, num_pages, width, torch.device("cpu"))
    m.update(lengths, resident, page_table)
    Q = n_buf * B
    bm = m.block_mask(4, n_buf)
    q_pos = lengths[:, None] + torch.arange(Q)
    visible = lengths + resident * B
    k, v = torch.randn(2, 1, 2, num_pages * P, 8, dtype=torch.float64)
    q = torch.randn(4, 4, Q, 8, dtype=torch.float64)
    got = attend(q, k, v, bm)
    for r, t in enumerate(tables):
        n_full, n_part = int(bm.full_kv_num_blocks[r, 0, 0]), int(bm.kv_num_blocks[r, 0, 0])
        full, part = bm.full_kv_indices[r, 0, 0, :n_full].tolist(), bm.kv_indices[r, 0, 0, :n_part].tolist()
        assert full == t[: int(lengths[r]) // P] and not set(full) & set(part)
        span = width * P
        dense = block_causal_dense(q_pos[r:r + 1], span, visible[r:r + 1], B)[0, 0]  # [Q, logical keys]
        dense &= torch.arange(span) < len(t) * P  # unmapped logical pages hold nobody's keys
        for j, page in enumerate(t):
            keys = dense[:, j * P:(j + 1) * P]
            if page in full:
                assert keys.all()
            elif page not in part:
                assert not keys.any(), (r, j)
        if not t:
            assert not got[r].any()  # a free row sees nothing and gets zeros, not NaN
            continue
        logical = torch.cat([torch.arange(p * P, (p + 1) * P) for p in t])
        ref = attend(q[r:r + 1], k[:, :, logical], v[:, :, logical], dense[None, None, :, :len(t) * P])
        torch.testing.assert_close(got[r:r + 1], ref, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("block", [4, 8])
def test_flex_engine_equals_sdpa_engine(block):
    """Eager paged flex == sdpa. Block 8, N_buf 3: the BlockMask's query block is the largest buffer's (32), larger
    than the 8 or 16 query positions of a 1- or 2-slot step."""
    model, cfg = tempered_model("sdar", block_size=block)
    dc = dcfg(tau_m2t=0.1)
    flex = Engine(model, None, dc, EngineConfig(max_batch_rows=2, attention="flex", compile="off"))
    sdpa = Engine(model, None, dc, EngineConfig(max_batch_rows=2))
    a, b = flex.generate(PROMPTS[::2]), sdpa.generate(PROMPTS[::2])
    assert [r.token_ids for r in a] == [r.token_ids for r in b] and [r.nfe for r in a] == [r.nfe for r in b]


def head_rows_per_step(engine, prompts):
    """Run `prompts` (all added at once) step by step; per step, the positions the LM head computed."""
    rows: list[int] = []
    hook = engine.model.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[:-1].numel()))
    reqs = [engine._add(p, None, None) for p in prompts]
    per_step = []
    try:
        while engine.has_unfinished():
            rows.clear()
            engine.step()
            per_step.append(sum(rows))
    finally:
        hook.remove()
    return reqs, per_step


def test_logits_only_for_active_slots(family):
    """The head runs on ACTIVE slots' positions only: at batch 1 exactly B per ACTIVE slot of the forward
    (none for TO_CACHE slots being stored, none for DUMMY slots, none for the prefill); in a batch, the
    window of the row with the most ACTIVE slots, per row. Decisions stay the naive reference's."""
    model, cfg = tempered_model(family)
    dc = dcfg(tau_m2t=0.1)
    engine = Engine(model, None, dc, EngineConfig(max_batch_rows=1, trace=True))
    naive = NaiveMultiBD(model, dc, [cfg.eos_token_id])
    for prompt in PROMPTS:
        (req,), per_step = head_rows_per_step(engine, [prompt])
        states = [e["states"] for e in req.trace]
        assert per_step == [4 * s.count("ACTIVE") for s in states]
        assert any("TO_CACHE" in s for s in states) and sum(per_step) < 4 * sum(len(s) - s.count("DUMMY") for s in states)
        assert req.output == naive.generate(prompt).token_ids
    engine = Engine(model, None, dc, EngineConfig(max_batch_rows=2, trace=True))
    reqs, per_step = head_rows_per_step(engine, PROMPTS[:2])
    counts = [[e["states"].count("ACTIVE") for e in r.trace] for r in reqs]
    steps = max(map(len, counts))
    want = [2 * 4 * max(c[i] if i < len(c) else 0 for c in counts) if i < min(map(len, counts)) else
            4 * max(c[i] for c in counts if i < len(c)) for i in range(steps)]
    assert per_step == want
    assert engine.stats.logit_rows == sum(want) < engine.stats.positions_run


@pytest.mark.parametrize("first_budget,join_step,row", [(None, 3, 2), (6, 12, 0)])
def test_chunked_prefill_never_stalls_decoding(family, first_budget, join_step, row):
    """A long prompt admitted mid-run is prefilled in chunks of at most prefill_budget tokens carried by the
    decode steps: the decoding rows emit the same tokens as without it, no step prefills on its own while
    rows decode, and the new request decodes what it decodes alone. Its row lies past the decode batch
    bucket, or (row 0, freed by a finished request) inside it as an all-DUMMY row."""
    model, _ = tempered_model(family)
    model.cfg = tiny_cfg(family, max_position_embeddings=1024)
    dc = dcfg(max_length=400, max_new_tokens=40, tau_m2t=0.1)
    long_prompt = [(7 * i + 3) % 60 for i in range(131)]  # 128 tokens prefilled, a 3-token tail
    early = [(0, PROMPTS[0], first_budget and {"max_new_tokens": first_budget}), (0, PROMPTS[3], {"buffer_size": 2, "max_new_tokens": 80})]
    alone = Engine(model, None, dc, EngineConfig(max_batch_rows=3))
    ids0, out0, _ = run_batch_with_joins(alone, early)
    engine = Engine(model, None, dc, EngineConfig(max_batch_rows=3, prefill_budget=18))  # 16: whole blocks
    chunk_sizes: list[int] = []
    fused = engine.runner._fused
    engine.runner._fused = lambda *a: (chunk_sizes.append(sum(len(c.ids) for c in a[3])), fused(*a))[1]
    rows = []
    activate = engine.scheduler.activate
    engine.scheduler.activate = lambda req: (rows.append(req.row), activate(req))[1]
    ids, out, _ = run_batch_with_joins(engine, early + [(join_step, long_prompt, None)])
    assert rows[-1] == row
    assert [out[i] for i in ids][:2] == [out0[i] for i in ids0]
    assert engine.stats.prefills == 2 and engine.stats.chunked_steps == len(chunk_sizes) == 8  # 2: at step 0
    assert chunk_sizes == [16] * 8 and engine.stats.prefill_tokens == 8 + 16 + 128
    ref = NaiveMultiBD(model, dc, [model.cfg.eos_token_id]).generate(long_prompt)
    assert out[list(ids)[2]] == ref.token_ids
    assert engine.scheduler.running == {} and not engine.has_unfinished()
