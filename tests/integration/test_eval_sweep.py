"""An evaluation sweep end to end through Ray on a tiny RANDOM model: decoder actor, scoring pool, results store,
report and plots; then resume after an interruption decodes only the problems whose records are missing."""

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
        batch_size=2, trace_problems=2, device="cpu", workers=1, cpus_per_worker=0.5, cpus_per_scorer=0.25)


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
    assert [c.model_dump(exclude={"tps", "step_latency_ms"}) for c in second.cells] == \
        [c.model_dump(exclude={"tps", "step_latency_ms"}) for c in first.cells]  # greedy decoding: same records

    third = run_sweep(cfg, progress=False)  # nothing left: no actor is even started
    assert (third.decoded, third.skipped) == (0, n)
