"""The packed Block Buffer forward (issue 64): an sdpa decode step runs each decoding row's resident slots only,
packed end to end, and decides what the padded flex layout and the naive reference decide."""

import pytest
import torch

from mbd.decoding import Engine, EngineConfig, NaiveMultiBD
from mbd.decoding.runner import token_bucket
from tests.unit.test_decoding_engine import PROMPTS, dcfg, tempered_model

JOBS = [PROMPTS[0], PROMPTS[3], PROMPTS[2], PROMPTS[1] + [9, 9]]


class StepLog:
    """Wraps `engine.runner.run`: per decode step, the resident slots of each decoding row (capped at the slots
    run) before the forward, and the query positions the forward ran."""

    def __init__(self, engine: Engine):
        self.engine, self.run, self.steps = engine, engine.runner.run, []
        engine.runner.run = self

    def __call__(self, batch):
        n_res = [min(r.n_res, batch.slots) for r in batch.requests]
        out = self.run(batch)
        self.steps.append((n_res, self.engine.runner.step_positions))
        return out


@pytest.mark.parametrize("family", ["sdar", "llada2_moe"])
def test_packed_forward_decides_what_padded_and_naive_decide(family):
    """Batch 4, rows holding different numbers of resident slots in the same step: the packed sdpa engine gives
    the padded flex engine's tokens and NFE, and each request the naive MultiBD reference's tokens alone."""
    model, cfg = tempered_model(family)
    dc = dcfg(tau_m2t=0.1)
    packed = Engine(model, None, dc, EngineConfig(max_batch_rows=4))
    log = StepLog(packed)
    padded = Engine(model, None, dc, EngineConfig(max_batch_rows=4, attention="flex", compile="off"))
    a, b = packed.generate(JOBS), padded.generate(JOBS)
    assert [r.token_ids for r in a] == [r.token_ids for r in b] and [r.nfe for r in a] == [r.nfe for r in b]
    naive = NaiveMultiBD(model, dc, [cfg.eos_token_id])
    assert [r.token_ids for r in a] == [naive.generate(p).token_ids for p in JOBS]
    assert any(len(n) > 1 and len(set(n)) > 1 for n, _ in log.steps)  # rows of different resident slot counts


def test_positions_computed_are_positions_needed():
    """Every packed forward runs exactly the rows' resident positions (below 16 blocks of B = 4 a token bucket
    pads nothing), so the engine's positions_run equals its resident positions; the forward shapes are the
    distinct totals that occurred, and a padded layout would have run more."""
    model, _ = tempered_model("sdar")
    engine = Engine(model, None, dcfg(tau_m2t=0.1), EngineConfig(max_batch_rows=4))
    log = StepLog(engine)
    engine.generate(JOBS)
    B = engine.block
    needed = [B * sum(n) for n, _ in log.steps]
    assert [ran for _, ran in log.steps] == needed
    assert engine.stats.positions_run == engine.stats.resident_positions == sum(needed)
    padded = sum(4 * B * max(n) for n, _ in log.steps)  # bucket 4 x the fullest row, as the padded layout ran
    assert sum(needed) < padded
    tokens = {t for _, t, _ in engine.runner.shapes}
    assert tokens == set(needed) and len(tokens) <= 4 * engine.n_buf


def test_token_buckets_are_few_and_pad_little():
    """Token buckets: whole blocks, at most 12.5% over the need (none up to 8 blocks), O(8 log n) sizes."""
    for block in (4, 32):
        sizes = {token_bucket(k * block, block) for k in range(1, 1025)}
        for k in range(1, 1025):
            t = token_bucket(k * block, block)
            assert t % block == 0 and k * block <= t <= k * block * 1.125
            assert k > 8 or t == k * block
        assert len(sizes) <= 8 + 8 * 7


def test_packed_forward_with_prompt_chunks_and_token_merge():
    """A prompt chunk riding in a packed step and DMax's merge weights gathered into the packed input: the same
    tokens as the padded flex engine."""
    model, _ = tempered_model("sdar")
    dc = dcfg(tau_m2t=0.5, strategy="dmax", tau_t2t=0.5, buffer_size=1, tau_add=None)
    kw = dict(max_batch_rows=3, prefill_budget=8, prefill_chunk=8)
    jobs = [PROMPTS[0], list(range(3, 40)), PROMPTS[2]]
    packed = Engine(model, None, dc, EngineConfig(**kw))
    with torch.inference_mode():
        a = packed.generate(jobs)
        b = Engine(model, None, dc, EngineConfig(attention="flex", compile="off", **kw)).generate(jobs)
    assert [r.token_ids for r in a] == [r.token_ids for r in b] and packed.stats.chunked_steps > 0
