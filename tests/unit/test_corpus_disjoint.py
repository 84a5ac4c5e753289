"""The base's pretraining corpus, the post-training corpus, the dev problems and the held-out problems share no
problem, for any seed: each is drawn from its own hash part of the tinymath space (mbd.tiny.task). Computed through
the stages that write them (`pretrain_tiny.prepare`, `stages.write_corpus`, the `tinymath` and `tinymath-dev`
benchmarks), over seeds 0-9 on both sides."""

import json
from pathlib import Path

import pytest

from mbd.config import ConfigError
from mbd.eval.benchmarks import get_benchmark
from pipelines.pretrain_tiny import DEFAULT_CONFIG as PRETRAIN, load_pretrain_config, prepare
from pipelines.stages import BENCHMARK, DEFAULT_CONFIG, DEV_BENCHMARK, load_config, write_corpus

SEEDS = range(10)


def _prompts(path: Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines()]


def test_pretraining_posttraining_dev_and_heldout_share_zero_problems_for_seeds_0_to_9(tmp_path):
    qs = load_config(DEFAULT_CONFIG)
    pretrained, posttrained = set(), set()
    for seed in SEEDS:
        cfg = load_pretrain_config(PRETRAIN, [f"train.data.jsonl={tmp_path}/pre{seed}.jsonl",
                                              f"train.model_path={tmp_path}/init{seed}"], None, seed)
        prepare(cfg)
        pre = _prompts(tmp_path / f"pre{seed}.jsonl")
        post = _prompts(write_corpus(tmp_path / f"post{seed}.jsonl", qs.corpus.problems, seed))
        assert len(set(pre)) == cfg.corpus.problems == 80000 and len(set(post)) == qs.corpus.problems == 2000
        pretrained |= set(pre)
        posttrained |= set(post)
    held = {p.prompt_text for p in get_benchmark(BENCHMARK).load(limit=qs.eval.claim_problems)}
    dev = {p.prompt_text for p in get_benchmark(DEV_BENCHMARK).load()}
    assert len(held) == qs.eval.claim_problems and len(dev) == 5000
    assert len(posttrained) > 2 * qs.corpus.problems  # the seeds draw different corpora (not one set ten times)
    assert len(pretrained & posttrained) == 0
    assert len(pretrained & held) == 0
    assert len(posttrained & held) == 0
    assert not dev & (pretrained | posttrained | held)


@pytest.mark.parametrize("seed", [-1, -1000])
def test_a_seed_outside_the_range_is_refused_naming_the_field(seed):
    with pytest.raises(ConfigError, match="seed"):
        load_pretrain_config(PRETRAIN, [], None, seed)
    with pytest.raises(ConfigError, match="seed"):
        load_config(DEFAULT_CONFIG, [f"seed={seed}"])
