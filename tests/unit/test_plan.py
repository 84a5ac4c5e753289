"""The memory plan (`mbd plan`, mbd/plan.py): its exact terms equal what a real engine allocates at small scale,
its real-size weights equal the architecture's arithmetic, and configs that cannot fit are refused by `mbd serve`
and `mbd train` before anything loads, with the plan and the reason."""

import json
import shutil

import pytest
import torch

from mbd.config import DecodeConfig, ModelConfig, read_json, resolve_path
from mbd.config import EngineConfig
from mbd.decoding.spec import build_engine
from mbd.model import build_model
from mbd.model.tp import TPGroup
from mbd.plan import H100_80GB, GiB, ServeShape, TrainShape, serve_plan, train_plan, weight_bytes, zero_states
from mbd.plan_check import check_serve, model_config, serve_shape
from tests.conftest import tiny_cfg

TINY = "mbd/assets/tiny"
SDAR8B = "configs/model/sdar-8b-shape.json"


def allocated_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a tied head shares the embedding's)."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_equal_the_allocated_model(family, tp, dtype):
    cfg = tiny_cfg(family, tie_word_embeddings=(family == "sdar"))
    model = build_model(cfg, TPGroup(0, tp)).to(dtype)
    assert weight_bytes(cfg, tp, dtype) == allocated_bytes([*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("budget", [None, 300_000])
def test_kv_pool_and_weights_equal_a_real_engine(dtype, budget):
    cfg = EngineConfig(device="cpu", dtype=dtype, max_batch_rows=4, kv_cache_bytes=budget)
    decode = DecodeConfig(buffer_size=2, tau_add=0.5, max_length=200)
    engine = build_engine(TINY, decode, cfg)
    mcfg, _ = model_config(TINY)
    plan = serve_plan(mcfg, decode, serve_shape(cfg, 1), H100_80GB)
    cache = engine.runner.cache
    assert plan.item("KV page pool") == cache.k.nbytes + cache.v.nbytes
    assert plan.facts["KV pages (scratch incl.)"] == f"{cache.num_pages:,}"
    model = engine.model
    assert plan.item("weights") == allocated_bytes([*model.parameters(), *model.buffers()])


def sdar8b_elements(tp: int) -> int:
    """SDAR-8B (Qwen3-8B shape) per tensor-parallel rank, by hand: full embedding, vocab-sharded head, sharded
    projections and MLP, replicated norms."""
    d, v, ff, layers, hd, h, kv = 4096, 151936, 12288, 36, 128, 32, 8
    layer = (d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * ff) // tp + 2 * d + 2 * hd
    return v * d + v * d // tp + layers * layer + d


@pytest.mark.parametrize("tp", [1, 2])
def test_real_size_sdar8b_weights_and_pool(tp):
    mcfg = ModelConfig.from_hf(read_json(resolve_path(SDAR8B)))
    decode = DecodeConfig(buffer_size=4, block_size=32, tau_add=0.1, max_length=4096)
    shape = ServeShape(tp=tp, dtype=torch.bfloat16, cuda=True, max_batch_rows=32, kv_cache_fraction=0.8)
    plan = serve_plan(mcfg, decode, shape, H100_80GB)
    weights = 2 * sdar8b_elements(tp)
    assert plan.item("weights") == weights
    page_bytes = 2 * 36 * 32 * (8 // tp) * 128 * 2  # K and V, every layer, 32 tokens, this rank's heads, bf16
    pages = int((H100_80GB.usable - weights) * 0.8) // page_bytes
    assert plan.facts["KV pages (scratch incl.)"] == f"{pages:,}"
    assert plan.facts["requests at max length"].startswith(f"{(pages - 1) // -(-(4096 + 32 + 128) // 32):,} ")


def test_zero_states_follow_the_stage():
    n = 1_000_000_000
    z2 = {i.name: i.bytes for i in zero_states(n, TrainShape(2, 2, True, 1, 2048))}
    z3 = {i.name: i.bytes for i in zero_states(n, TrainShape(2, 3, True, 1, 2048))}
    assert z2["parameters"] == 2 * n  # replicated bf16
    assert z2["optimizer states"] == z3["optimizer states"] == 12 * n // 2  # fp32 master + m + v, halved
    assert z3["parameters"] == 2 * (n // 2 + n // 2)  # own half + the other half gathered (under 1e9 live)


def big_model_dir(tmp_path):
    d = tmp_path / "sdar-8b"
    d.mkdir()
    shutil.copy(resolve_path(SDAR8B), d / "config.json")
    return d


def test_serve_refuses_a_deployment_that_cannot_fit(tmp_path, capsys):
    from pipelines.serve import main

    cfg = {"model": {"path": str(big_model_dir(tmp_path)), "tensor_parallel_size": 1, "num_gpus_per_rank": 1},
           "engine": {"device": "cuda", "dtype": "bfloat16", "kv_cache_bytes": 80 * GiB},
           "decode": {"buffer_size": 2, "block_size": 4, "tau_add": 0.1}}
    (tmp_path / "serve.yaml").write_text(json.dumps(cfg))
    assert main(["--config", str(tmp_path / "serve.yaml")]) == 2
    err = capsys.readouterr().err
    assert "does not fit, refused before loading" in err
    assert "| KV page pool" in err and "80.00 GiB" in err and "the largest part is KV page pool" in err


def test_a_fitting_deployment_passes_the_check():
    from serve_app.config import load_serve_config

    cfg = load_serve_config("configs/serve/tiny.yaml")
    assert check_serve(cfg.model.path, cfg.engine, 1, cfg.decode).fits


def test_train_refuses_a_run_that_cannot_fit(tmp_path, capsys):
    from pipelines.train_multitf import main

    cfg = {"run": {"name": "big", "storage_path": str(tmp_path / "runs")}, "model_path": str(big_model_dir(tmp_path)),
           "data": {"jsonl": str(tmp_path / "none.jsonl")}, "steps": 1, "num_workers": 1, "use_gpu": True}
    (tmp_path / "train.yaml").write_text(json.dumps(cfg))
    assert main(["--config", str(tmp_path / "train.yaml")]) == 2
    err = capsys.readouterr().err
    assert "training run 'big' does not fit" in err and "| optimizer states" in err
    assert "91.54 GiB" in err  # 12 bytes x 8.19B parameters on one rank
    assert not (tmp_path / "runs").exists()  # refused before the run started


def test_plan_cli_prints_both_tensor_parallel_sizes(capsys):
    from pipelines.plan import main

    assert main(["--config", "configs/serve/sdar-8b-tp2.yaml"]) == 0
    out = capsys.readouterr().out
    assert "*TP=2, 2x H100 80GB" in out and "TP=1, 1x H100 80GB" in out
    assert f"{2 * sdar8b_elements(2) / GiB:.2f} GiB" in out  # the TP=2 rank's weights


def test_train_plan_cli_lists_zero_2_and_3():
    from pipelines.plan import main

    assert main(["--config", "configs/train/mbd-sdar-8b-chat-b32-math.yaml", "--set", "attention=flex"]) == 0
    mcfg = ModelConfig.from_hf(read_json(resolve_path(SDAR8B)))
    plan = train_plan(mcfg, TrainShape(8, 2, True, 1, 2048, "flex"), H100_80GB)
    assert plan.fits and plan.item("optimizer states") == -(-sdar8b_elements(1) // 8) * 12


@pytest.mark.slow
def test_llada2_mini_tp2_plan(capsys):
    from pipelines.plan import main

    assert main(["--config", "configs/serve/llada2-mini-tp2.yaml"]) == 0
    out = capsys.readouterr().out
    assert "24 graphs in one shared pool" in out
