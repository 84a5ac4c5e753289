"""Structured output through the engine: 200 requests x 5 JSON schemas on a random-weight model with a byte-level
BPE tokenizer built here, under continuous batching and forced preemption, with SingleBD, Block Buffer MultiBD
and DMax decoding. Validity must hold whatever the weights: every output parses and validates."""

import json
import random

import jsonschema
import pytest
import torch

from mbd.config import DecodeConfig, EngineConfig
from mbd.decoding import Engine
from mbd.decoding.constraints import ConstraintError, ConstraintSpec
from mbd.model import KVCache, build_model
from mbd.tokenizer import Tokenizer
from tests.conftest import tiny_cfg
from tests.unit.structured_helpers import SCHEMAS, build_bpe

MASK = 3
STRATEGIES = {  # name: (decode overrides, requests per schema)
    "multibd": (dict(buffer_size=3, tau_add=0.25, tau_semi=0.5, tau_m2t=0.2), 120),
    "singlebd": (dict(buffer_size=1, tau_add=None, tau_m2t=0.2), 40),
    "dmax": (dict(strategy="dmax", buffer_size=1, tau_add=None, tau_m2t=0.5, tau_t2t=0.0), 40),
}


@pytest.fixture(scope="module")
def setup():
    hf = build_bpe()
    cfg = tiny_cfg(vocab_size=416, mask_token_id=MASK, eos_token_id=0, pad_token_id=0, max_position_embeddings=512)
    model = build_model(cfg, seed=0).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # tempered: some positions pass tau_m2t, so steps fill several tokens
    return model, Tokenizer(hf, "sdar", MASK, 0, 0)


def engine(setup, kv_pages: int | None = None, **kw) -> Engine:
    model, tok = setup
    dc = DecodeConfig(**{**dict(max_length=320, max_new_tokens=120, max_nfe=300), **kw})
    # kv_pages: a pool that small makes admission wait and decoding preempt
    budget = None if kv_pages is None else kv_pages * KVCache.page_bytes(model.cfg, 16, torch.float32)
    return Engine(model, tok, dc, EngineConfig(max_batch_rows=32, page_size=16, kv_cache_bytes=budget))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_output_validates(setup, strategy):
    overrides, per_schema = STRATEGIES[strategy]
    eng = engine(setup, kv_pages=48 if strategy == "multibd" else None, **overrides)
    rng = random.Random(strategy)
    jobs = [(name, [rng.randrange(4, 400) for _ in range(rng.randrange(3, 24))])
            for name in SCHEMAS for _ in range(per_schema)]
    rng.shuffle(jobs)  # schemas interleaved in every batch: per-request matchers
    specs = {name: ConstraintSpec.json_schema(s) for name, s in SCHEMAS.items()}
    results = eng.generate([p for _, p in jobs], constraints=[specs[n] for n, _ in jobs])
    for (name, _), r in zip(jobs, results):
        assert r.finish_reason == "eos", (name, r.finish_reason, r.text)
        jsonschema.validate(json.loads(r.text), SCHEMAS[name])
    if strategy == "multibd":
        assert eng.stats.preemptions > 0  # matcher state survived preemption
    if strategy != "dmax":  # (DMax's T2T keeps revising a random model's blocks)
        assert sum(r.num_generated for r in results) > sum(r.nfe for r in results)  # parallel: TPF > 1
    assert 0 < eng.stats.grammar_s < eng.stats.step_s


def test_unconstrained_rows_decode_as_without_constraints(setup):
    """A constrained request in the batch changes nothing for the others (exactly the same tokens)."""
    prompts = [[5, 6, 7, 8, 9], list(range(20, 37)), [44, 45]]
    alone = engine(setup, **STRATEGIES["multibd"][0]).generate(prompts)
    spec = ConstraintSpec.json_schema(SCHEMAS["enum"])
    mixed = engine(setup, **STRATEGIES["multibd"][0]).generate(prompts + [[7, 7, 7]], constraints=[None] * 3 + [spec])
    assert [r.token_ids for r in mixed[:3]] == [r.token_ids for r in alone]
    assert json.loads(mixed[3].text)["status"] in ("open", "closed", "pending")


def test_refusals_happen_at_admission(setup):
    eng = engine(setup, **STRATEGIES["multibd"][0])
    with pytest.raises(ConstraintError, match="uniqueItems"):
        eng.add_request([5, 6], constraint=ConstraintSpec.json_schema({"type": "array", "uniqueItems": True}))
    assert not eng.has_unfinished()


def test_tiny_model_regex_and_choice():
    """The tiny model's alphabet has no braces or quotes: it is constrained to its answer format by a regex
    (every output matches it) and to a choice (every output is one of them); JSON is refused as inexpressible."""
    import re

    from benchmarks.structured_output import TINY_REGEX
    from mbd.decoding import build_engine
    from mbd.tiny.benchmark import TinyMath
    from pipelines.generate import load_decode_config

    cfg = load_decode_config("configs/decode/tiny_multibd.yaml")
    eng = build_engine("mbd/assets/tiny", cfg, EngineConfig(device="cpu", max_batch_rows=8))
    problems = [p.prompt_text for p in TinyMath().load(limit=6)]
    regex = ConstraintSpec("regex", TINY_REGEX, "regex")
    choice = ConstraintSpec.choice(["yes", "no", "42"])
    res = eng.generate(problems + problems[:3], constraints=[regex] * 6 + [choice] * 3)
    assert all(re.fullmatch(TINY_REGEX, r.text) for r in res[:6]), [r.text for r in res[:6]]
    assert all(r.text in ("yes", "no", "42") and r.finish_reason == "eos" for r in res[6:])
    with pytest.raises(ConstraintError, match="vocabulary cannot express"):
        eng.add_request([5, 6], constraint=ConstraintSpec("json_object"))
