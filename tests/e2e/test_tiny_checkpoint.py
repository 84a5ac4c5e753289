"""The shipped tiny checkpoint (mbd/assets/tiny): it loads, matches the code that made it, and still solves
held-out tinymath problems at the accuracy its provenance file documents.

The documented accuracy p was measured on the first DOC_N held-out problems; here the first SAMPLE of them
are decoded (greedy SingleBD, so the run is deterministic), and the bound allows three binomial standard
errors of a SAMPLE-problem estimate below p: a regression of the weights, the tokenizer, the chat format or
the engine fails it, sampling noise between the 40 and the full sample does not.
"""

import json
import math
import re
from pathlib import Path

import pytest

from mbd.config import ModelConfig, read_json
from mbd.decoding import EngineConfig, build_engine
from mbd.tiny.benchmark import TinyMath
from mbd.tiny.vocab import build_tokenizer
from pipelines.generate import load_decode_config
from pipelines.pretrain_tiny import DEFAULT_CONFIG, DEFAULT_OUT, load_pretrain_config, model_config

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = 40
ANSWER_LINE = re.compile(r"#### (\d+)$")


@pytest.fixture(scope="module")
def provenance() -> dict:
    return json.loads((DEFAULT_OUT / "pretrain.json").read_text())


@pytest.fixture(scope="module")
def singlebd_results():
    engine = build_engine(DEFAULT_OUT, load_decode_config(str(ROOT / "configs/decode/tiny_singlebd.yaml")),
                          EngineConfig(device="cpu", dtype="float32", max_batch_rows=SAMPLE))
    problems = TinyMath().load(limit=SAMPLE)
    return problems, engine.generate([p.prompt_text for p in problems])


def test_checkpoint_matches_the_pretraining_recipe():
    """config.json is what `mbd pretrain-tiny` builds from its YAML, and the tokenizer is mbd.tiny.vocab's."""
    shipped = ModelConfig.from_hf(read_json(DEFAULT_OUT / "config.json"))
    recipe = model_config(load_pretrain_config(DEFAULT_CONFIG, [], None, None).model)
    assert shipped == recipe
    assert json.loads((DEFAULT_OUT / "tokenizer.json").read_text()) == json.loads(build_tokenizer().to_str())


def test_checkpoint_stays_small():
    assert (DEFAULT_OUT / "model.safetensors").stat().st_size < 8 * 1024**2


def test_singlebd_reaches_documented_accuracy(provenance, singlebd_results):
    problems, results = singlebd_results
    bench = TinyMath()
    doc = provenance["eval"]["singlebd"]
    assert doc["n"] >= SAMPLE and provenance["eval"]["heldout_seed"] == bench.seed
    p = doc["accuracy"]
    bound = p - 3 * math.sqrt(p * (1 - p) / SAMPLE)
    correct = sum(bench.score(prob, r.text).correct for prob, r in zip(problems, results))
    assert correct / SAMPLE >= bound, f"{correct}/{SAMPLE} correct, documented {p:.3f} (bound {bound:.3f})"


def test_generate_ends_with_a_parseable_answer(singlebd_results):
    """Every completion ends its text with the GSM8K answer line, and that number is what the scorer reads."""
    problems, results = singlebd_results
    bench = TinyMath()
    for prob, r in zip(problems, results):
        m = ANSWER_LINE.search(r.text)
        assert r.finish_reason == "eos" and m is not None, f"{prob.prompt_text!r} -> {r.text!r} ({r.finish_reason})"
        assert bench.score(prob, r.text).extracted == m.group(1)
        assert r.nfe >= 1 and r.tpf == pytest.approx(r.num_generated / r.nfe)
