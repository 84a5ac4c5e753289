"""Paged KV cache: prefix reuse and preemption never change a greedy output, hits compare tokens, reference
counts return to zero, the same bytes hold more short requests than per-row rows did, and TP ranks keep the same
page tables. Tiny tempered float64 models as in test_decoding_engine (several blocks active at once)."""

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from mbd.decoding import Engine, EngineConfig, cache_manager
from mbd.decoding.runner import span_bucket
from mbd.model import KVCache, TPGroup, build_model, load_checkpoint, save_checkpoint
from tests.conftest import tiny_cfg
from tests.unit.test_decoding_engine import dcfg, tempered_model
from tests.unit.gloo import free_port, gloo_group

SHARED = [3 + (7 * i) % 58 for i in range(40)]  # a 40-token "system prompt": two full pages of 16
MODES = {"singlebd": dict(buffer_size=1), "multibd": dict(buffer_size=3),
         # DMax's token merge: a filled token's confidence weights its embedding in the next forward
         "dmax": dict(buffer_size=1, tau_add=None, tau_t2t=0.0, strategy="dmax")}


def prompts(n: int) -> list[list[int]]:
    """n prompts of 45 tokens: SHARED, then 5 tokens that differ from prompt to prompt."""
    return [SHARED + [3 + (11 * j + 3 * k) % 57 for k in range(5)] for j in range(n)]


def drained(engine: Engine) -> bool:
    """Every page back in the pool: no row maps one, no reference is left."""
    kv = engine.kv
    return kv.used() == 0 and not any(kv.ref) and all(t == [] for t in kv.tables) and not kv.inflight


@pytest.mark.parametrize("mode", MODES)
def test_prefix_reuse_keeps_greedy_outputs_and_skips_shared_pages(mode):
    model, _ = tempered_model("sdar")
    cfg = dcfg(**MODES[mode])
    ps = prompts(8)
    off = Engine(model, None, cfg, EngineConfig(max_batch_rows=4, prefix_caching=False))
    want = [r.token_ids for r in off.generate(ps)]
    assert off.stats.prefix_hit_tokens == 0
    eng = Engine(model, None, cfg, EngineConfig(max_batch_rows=4))
    assert [r.token_ids for r in eng.generate(ps)] == want
    P = eng.kv.page
    # the first request prefills the shared pages while the others wait a step for them; the other 7 reuse them
    assert eng.stats.prefix_query_tokens == 8 * (45 // 4 * 4)
    assert eng.stats.prefix_hit_tokens == 7 * (len(SHARED) // P * P)
    assert eng.stats.prefill_tokens == off.stats.prefill_tokens - eng.stats.prefix_hit_tokens
    assert drained(eng)


@pytest.mark.parametrize("mode", MODES)
def test_a_follow_up_turn_reuses_the_committed_generated_pages(mode):
    """Committed generated blocks are registered too: a prompt that extends an earlier sequence (a chat's next
    turn) skips the prefill of every full page of it."""
    model, _ = tempered_model("sdar")
    cfg = dcfg(**MODES[mode], tau_m2t=0.1)
    eng = Engine(model, None, cfg, EngineConfig(max_batch_rows=2))
    first = eng._add(prompts(1)[0], None, None)
    while eng.has_unfinished():
        eng.step()
    assert first.finish_reason == "length"
    turn2 = first.prompt_ids + first.output + [5, 6, 7, 8, 9]
    hits0 = eng.stats.prefix_hit_tokens
    got = eng.generate([turn2])[0].token_ids
    P = eng.kv.page
    assert eng.stats.prefix_hit_tokens - hits0 == first.committed // P * P > len(first.prompt_ids)
    assert got == Engine(model, None, cfg, EngineConfig(max_batch_rows=2, prefix_caching=False)).generate([turn2])[0].token_ids
    assert drained(eng)


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_preemption_under_a_tiny_pool_keeps_every_output(mode, caching):
    model, mcfg = tempered_model("sdar")
    cfg = dcfg(**MODES[mode])
    ps = prompts(3) + [list(range(3, 13)), [5, 9, 2], list(range(30, 47))]
    want = Engine(model, None, cfg, EngineConfig(max_batch_rows=4, prefix_caching=False)).generate(ps)
    # the longest request needs ceil((84 + 3 * 4) / 16) = 6 pages at most; the pool holds 8
    eng = Engine(model, None, cfg, EngineConfig(max_batch_rows=4, prefix_caching=caching, kv_cache_bytes=9 * KVCache.page_bytes(mcfg, 16, torch.float64)))
    assert eng.kv.capacity == 8
    got = eng.generate(ps)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    # the Block Buffer comes back as it was: the same decisions, so the same forwards
    assert [(r.finish_reason, r.nfe) for r in got] == [(r.finish_reason, r.nfe) for r in want]
    assert eng.stats.preemptions > 0
    assert drained(eng)


def test_a_request_larger_than_the_pool_is_refused_with_the_reason():
    model, mcfg = tempered_model("sdar")
    eng = Engine(model, None, dcfg(), EngineConfig(max_batch_rows=2, kv_cache_bytes=5 * KVCache.page_bytes(mcfg, 16, torch.float64)))
    with pytest.raises(ValueError, match="KV pages"):
        eng.add_request(prompts(1)[0])
    eng.add_request([3, 4, 5], {"max_new_tokens": 8})  # small enough: accepted


def test_hash_collisions_are_misses_never_wrong_pages(monkeypatch):
    """With every page under one hash the manager must compare tokens: only the one page whose tokens match
    is reused (16 tokens per later request instead of 32), and outputs stay exact."""
    monkeypatch.setattr(cache_manager, "page_hash", lambda prev, tokens: 0)
    model, _ = tempered_model("sdar")
    cfg = dcfg(buffer_size=3)
    ps = prompts(8)
    eng = Engine(model, None, cfg, EngineConfig(max_batch_rows=4))
    got = [r.token_ids for r in eng.generate(ps)]
    assert got == [r.token_ids for r in Engine(model, None, cfg, EngineConfig(max_batch_rows=4, prefix_caching=False)).generate(ps)]
    assert eng.stats.prefix_hit_tokens == 7 * eng.kv.page
    assert drained(eng)


def test_the_same_kv_bytes_hold_four_times_the_short_requests():
    """Per-row caches gave 8 rows of max_length; the same bytes as pages hold all 32 short requests at once."""
    model, _ = tempered_model("sdar")
    cfg = dcfg(buffer_size=2, max_new_tokens=8)
    budget = Engine(model, None, cfg, EngineConfig(max_batch_rows=8)).runner.cache.nbytes()
    eng = Engine(model, None, cfg, EngineConfig(max_batch_rows=32, kv_cache_bytes=budget))
    assert eng.runner.cache.nbytes() <= budget
    for j in range(32):
        eng.add_request([3 + (j + k) % 50 for k in range(10)])
    peak = 0
    while eng.has_unfinished():
        eng.step()
        peak = max(peak, sum(r.decoding for r in eng.scheduler.running.values()))
    assert peak == 32 >= 2 * 8 and eng.stats.preemptions == 0
    assert drained(eng)


def _tp_worker(rank, world, port, ckpt, out):
    with gloo_group(rank, world, port):
        model, mcfg = load_checkpoint(ckpt, tp=TPGroup(rank, world))
        eng = Engine(model, None, dcfg(buffer_size=3), EngineConfig(max_batch_rows=4, kv_cache_bytes=9 * KVCache.page_bytes(mcfg, 16, torch.float32, model.tp)))
        for p in prompts(6):
            eng.add_request(p)
        tables = []
        while eng.has_unfinished():
            eng.step()
            tables.append([list(t) for t in eng.kv.tables])
        Path(f"{out}.{rank}").write_text(json.dumps(
            {"tables": tables, "stats": [eng.stats.preemptions, eng.stats.prefix_hit_tokens]}))


def test_tp2_ranks_keep_the_same_page_tables(tmp_path):
    cfg = tiny_cfg("sdar")
    model = build_model(cfg, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    save_checkpoint(model, cfg, tmp_path / "ck")
    out = tmp_path / "tables"
    mp.start_processes(_tp_worker, args=(2, free_port(), str(tmp_path / "ck"), str(out)), nprocs=2, start_method="spawn")
    r0, r1 = (json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1))
    assert r0 == r1
    preemptions, hits = r0["stats"]
    assert preemptions > 0 and hits > 0


def test_a_memory_fraction_sizes_the_pool(monkeypatch):
    """kv_cache_fraction: that share of the memory free after loading (host memory on CPU), in whole pages."""
    from types import SimpleNamespace

    import psutil

    from mbd.config import DecodeConfig
    from mbd.decoding import build_engine

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=10_000_000))
    spec = EngineConfig(device="cpu", max_batch_rows=4, kv_cache_fraction=0.5)
    eng = build_engine("mbd/assets/tiny", DecodeConfig(max_length=256, max_new_tokens=16), spec)
    cache = eng.runner.cache
    page = KVCache.page_bytes(eng.model.cfg, cache.page_size, torch.float32)
    assert cache.num_pages == 5_000_000 // page and cache.nbytes() <= 5_000_000
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(kv_cache_bytes=1 << 20, kv_cache_fraction=0.5)


def test_reads_at_home_equal_gathered_reads():
    """A default pool gives each row home pages: while a batch maps only those, keys are a view, not a gather,
    and the logits are the gathered ones exactly; a shared prefix page takes the batch off that path."""
    model, _ = tempered_model("sdar")
    eng = Engine(model, None, dcfg(buffer_size=3), EngineConfig(max_batch_rows=2))
    for p in (list(range(3, 30)), list(range(30, 47))):
        eng.add_request(p)
    eng.step()
    eng.step()
    runner, kv = eng.runner, eng.kv
    runner.sync(eng.scheduler.decode_batch().layout)  # the device state the next forward would see
    assert kv.at_home(2)
    span = span_bucket(int(runner.cache.lengths.max()) + 3 * 4, runner.cache.size)
    with torch.inference_mode():
        home = runner._logits(2, 3, 3, runner._dense(2, 3, span, True))[0].clone()
        gathered = runner._logits(2, 3, 3, runner._dense(2, 3, span, False))[0]
    assert torch.equal(home, gathered)
    # hits: copied home in a default pool (rows stay at home), shared by reference in a budgeted one (not home)
    for budget, home in ((None, True), (9 * KVCache.page_bytes(model.cfg, 16, torch.float64), False)):
        eng = Engine(model, None, dcfg(buffer_size=3), EngineConfig(max_batch_rows=2, kv_cache_bytes=budget))
        eng.generate(prompts(1))
        eng.add_request(prompts(2)[1])  # both hit the first prompt's cached pages
        eng.add_request(prompts(1)[0])
        eng.step()
        assert eng.stats.prefix_hit_tokens == 2 * 32 and eng.kv.at_home(2) == home
