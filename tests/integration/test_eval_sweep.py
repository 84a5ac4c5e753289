"""An evaluation sweep end to end through Ray on a tiny RANDOM model: decoder actor, scoring pool, results store,
report and plots; then resume after an interruption decodes only the problems whose records are missing; and a
few-shot sweep beside zero-shot."""

import json

import pytest

from mbd.eval.sweep import ResultStore, SweepConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from mbd.model import build_model, save_checkpoint
    from mbd.tiny.vocab import save_tokenizer, special_token_ids
    from tests.conftest import tiny_cfg

    ids = special_token_ids()
    cfg = tiny_cfg("sdar", vocab_size=56, mask_token_id=ids["mask_token_id"], eos_token_id=ids["eos_token_id"],
                   pad_token_id=ids["pad_token_id"], max_position_embeddings=512)
    d = tmp_path_factory.mktemp("random_tiny")
    save_checkpoint(build_model(cfg, seed=0), cfg, d)
    save_tokenizer(d)
    return d


def sweep(model_dir, out) -> SweepConfig:
    short = {"max_length": 512, "max_new_tokens": 8, "max_nfe": 16}
    return SweepConfig(
        name="it", output_dir=str(out), models=[{"name": "rand", "path": str(model_dir)}],
        decoding=[{"name": "single", "config": "configs/decode/tiny_singlebd.yaml", "overrides": short},
                  {"name": "multi", "config": {"math": "configs/decode/tiny_multibd.yaml",
                                               "code": "configs/decode/tiny_multibd.yaml"},
                   "overrides": {**short, "buffer_size": 2}}],
        benchmarks=[{"name": "tinymath", "limit": 4}, {"name": "gsm8k", "limit": 2}, {"name": "mbpp_plus", "limit": 2}],
        engine={"device": "cpu", "max_batch_rows": 2}, trace_problems=2, workers=1, cpus_per_worker=0.5,
        cpus_per_scorer=0.25)


def test_sweep_end_to_end_and_resume(ray_cluster, model_dir, tmp_path):
    from pipelines.eval_sweep import run_sweep

    cfg = sweep(model_dir, tmp_path / "out")
    first = run_sweep(cfg, progress=False)
    n = 2 * (4 + 2 + 2)
    assert (first.decoded, first.skipped) == (n, 0)
    store = ResultStore(cfg.output_dir)
    for c in first.cells:
        stored = store.load(c.model, c.config, c.benchmark)
        assert c.n == len(stored) == {"tinymath": 4, "gsm8k": 2, "mbpp_plus": 2}[c.benchmark]
        nfe = sum(r.nfe for r in stored.values())
        assert c.tpf == pytest.approx(sum(r.num_generated for r in stored.values()) / nfe)
        assert all(1 <= r.nfe <= 16 and r.num_generated <= 8 for r in stored.values())
        if c.benchmark == "mbpp_plus":  # scored in the sandbox pool: random text is not a passing program
            assert not any(r.correct for r in stored.values())
    assert {len(store.load_traces("rand", k, "tinymath")) for k in ("single", "multi")} == {2}
    assert "| **rand** |" in first.table_markdown and "| multi |" in first.table_markdown
    assert [p.rsplit("/", 1)[-1] for p in first.plots] == ["accuracy_vs_tpf.png", "noise_activity.png"]
    assert all(open(p, "rb").read(4) == b"\x89PNG" for p in first.plots)

    # Interruption: two finished records lost and one torn mid-write. Only those three are decoded again.
    lost = store.path("rand", "multi", "tinymath")
    lines = lost.read_text().splitlines(keepends=True)
    lost.write_text("".join(lines[:2]))
    torn = store.path("rand", "single", "gsm8k")
    torn.write_bytes(torn.read_bytes()[:-20])
    second = run_sweep(cfg, progress=False)
    assert (second.decoded, second.skipped) == (3, n - 3)
    assert sorted(store.load("rand", "multi", "tinymath")) == sorted(json.loads(x)["problem_id"] for x in lines)
    assert len(torn.read_text().splitlines()) == 2
    timing = {"tps", "step_latency_ms", "prefix_hit_rate"}  # the redone units' lookups join the cells' counts
    assert [c.model_dump(exclude=timing) for c in second.cells] == \
        [c.model_dump(exclude=timing) for c in first.cells]  # greedy decoding: same records

    third = run_sweep(cfg, progress=False)  # nothing left: no actor is even started
    assert (third.decoded, third.skipped) == (0, n)


def test_fewshot_sweep_beside_zero_shot(ray_cluster, model_dir, tmp_path):
    """The same benchmark zero-shot and 2-shot in one sweep: separate results, exemplars never scored, every 2-shot
    prompt opens with the same exemplar token ids, and each cell reports its prefix-cache hit rate."""
    from mbd.eval.sweep import load_splits
    from mbd.eval.sweep_work import plan_units
    from mbd.model import load_checkpoint
    from mbd.tokenizer import Tokenizer
    from pipelines.eval_sweep import run_sweep

    cfg = SweepConfig(
        name="fs", output_dir=str(tmp_path / "out"), models=[{"name": "rand", "path": str(model_dir)}],
        decoding=[{"name": "single", "config": "configs/decode/tiny_singlebd.yaml",
                   "overrides": {"max_length": 512, "max_new_tokens": 8, "max_nfe": 16}}],
        benchmarks=[{"name": "tinymath", "limit": 3}, {"name": "tinymath", "limit": 3, "fewshot": 2}],
        engine={"device": "cpu", "max_batch_rows": 2}, trace_problems=0, workers=1, cpus_per_worker=0.5,
        cpus_per_scorer=0.25)
    splits = load_splits(cfg)
    few = splits["tinymath+2shot"]
    exemplar_ids = {p.problem_id for p in few.exemplars}
    assert len(exemplar_ids) == 2 and not exemplar_ids & {p.problem_id for p in few.scored}

    summary = run_sweep(cfg, progress=False)
    assert summary.decoded == 6
    store = ResultStore(cfg.output_dir)
    for label, split in splits.items():
        stored = store.load("rand", "single", label)
        assert sorted(stored) == sorted(p.problem_id for p in split.scored)
        assert all(r.finish_reason != "prompt_too_long" for r in stored.values())
    # what the decoder was sent: the exemplar turns, token-identical across problems, then the problem as its
    # zero-shot prompt (the template renders an exemplar answer inside the conversation, not as a final turn)
    units, _ = plan_units(cfg, {k: s.scored for k, s in splits.items()}, ResultStore(tmp_path / "empty"),
                          {k: s.exemplars for k, s in splits.items()})
    tok = Tokenizer.from_dir(model_dir, load_checkpoint(model_dir)[1])
    convs = [c for u in units if u.cell.benchmark == "tinymath+2shot" for c in u.prompts()]
    ids = [tok.encode_chat(c) for c in convs]
    tails = [tok.encode_chat(c[-1:]) for c in convs]  # each problem as its zero-shot prompt
    prefixes = [x[: len(x) - len(t)] for x, t in zip(ids, tails)]
    assert len(convs) == 3 and all(x[len(p):] == t for x, p, t in zip(ids, prefixes, tails))
    assert all(p == prefixes[0] for p in prefixes)
    assert [c[-1]["content"] for c in convs] == [p.prompt_text for p in few.scored]
    assert len(prefixes[0]) > len(tails[0])  # the shared part outweighs a whole zero-shot prompt

    lookups = store.load_prefix_cache("rand", "single", "tinymath+2shot")
    assert sorted(i for u in lookups for i in u.problem_ids) == sorted(p.problem_id for p in few.scored)
    assert all(0 <= u.hit_tokens <= u.query_tokens for u in lookups)
    cells = {c.benchmark: c for c in summary.cells}
    assert set(cells) == {"tinymath", "tinymath+2shot"}
    for c in cells.values():
        assert c.prefix_hit_rate is not None and 0.0 <= c.prefix_hit_rate <= 1.0
    # every k-shot prompt after the first finds the exemplar turns' full pages in the prefix cache
    assert cells["tinymath+2shot"].prefix_hit_rate > 0
    assert "Prefix Hit (%)" in summary.report_markdown and "tinymath (2shot) Acc" in summary.table_markdown
