"""`mbd generate` end to end on a saved tiny checkpoint, and the decode config files of the paper's table."""

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from mbd.config import ConfigError, DecodeConfig, load_decode, load_yaml
from mbd.model import build_model, save_checkpoint
from pipelines.generate import main
from tests.conftest import tiny_cfg

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "decode"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    cfg = tiny_cfg("sdar")
    model = build_model(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    save_checkpoint(model, cfg, d)
    vocab = {f"{chr(ord('a') + i % 26)}{i // 26}": i for i in range(64)}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="a0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.Fuse()
    tok.save(str(d / "tokenizer.json"))
    return d


def test_generate_cli_json(model_dir, tmp_path, capsys):
    cfg = tmp_path / "d.yaml"
    cfg.write_text("buffer_size: 2\ntau_add: 0.25\ntau_semi: 0.5\ntau_m2t: 0.1\nmax_new_tokens: 12\nmax_length: 128\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "b0 c0 d0 e0 f0"}\n{"prompt": "g0 h0"}\n')
    rc = main(["--model", str(model_dir), "--config", str(cfg), "--prompt-file", str(prompts), "--raw", "--json",
               "i0 j0 k0"])
    assert rc == 0
    rows = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == ["i0 j0 k0", "b0 c0 d0 e0 f0", "g0 h0"]
    for r in rows:
        assert r["num_generated"] >= 1 and r["nfe"] >= 1 and "trace" not in r
    rc = main(["--model", str(model_dir), "--config", str(cfg), "--stream", "--raw", "b0 c0"])
    assert rc == 0 and capsys.readouterr().out.strip()


def test_generate_cli_errors(model_dir, tmp_path, capsys):
    assert main(["--model", str(model_dir), "--config", str(tmp_path / "missing.yaml"), "x"]) == 2
    assert "config file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("buffer_size: 2\n")
    assert main(["--model", str(model_dir), "--config", str(bad), "x"]) == 2
    assert "tau_add is required" in capsys.readouterr().err
    assert main(["--model", str(tmp_path), "--config", str(CONFIGS / "tiny_singlebd.yaml"), "x"]) == 2
    assert "config.json missing" in capsys.readouterr().err


def test_decode_configs_cover_the_table():
    table = sorted(p for p in CONFIGS.glob("*.yaml") if not p.name.startswith("tiny_"))
    assert len(table) == 32  # rows of tab:appendix_infer_hparams
    cfgs = {p.stem: load_decode(p)[0] for p in table}
    sdar_b4 = cfgs["sdar-8b-chat-b4_multibd-tf_math"]
    assert (sdar_b4.buffer_size, sdar_b4.block_size, sdar_b4.tau_add, sdar_b4.tau_semi) == (4, 4, 0.10, 0.25)
    assert cfgs["llada2-mini-dmax_mbd_code"].tau_stable == 0.5 and cfgs["llada2.1-mini_singlebd_math"].tau_t2t == 0.5
    assert all(c.buffer_size == 1 and c.tau_add is None for k, c in cfgs.items() if "_singlebd_" in k)
    assert all((c.max_length, c.max_new_tokens, c.max_nfe) == (4096, 4096, 1024) for c in cfgs.values())
    with pytest.raises(ConfigError):
        load_yaml(CONFIGS / "tiny_multibd.yaml", DecodeConfig, section="decode")


def test_generate_sets_and_prints_the_engine_config(model_dir, capsys, monkeypatch):
    """`--set engine.x=...` goes through the one config loader; -v prints the engine config once, first."""
    import mbd.decoding

    built = []
    real = mbd.decoding.build_engine
    monkeypatch.setattr(mbd.decoding, "build_engine", lambda *a: built.append(real(*a)) or built[-1])
    rc = main(["--model", str(model_dir), "--config", str(CONFIGS / "tiny_singlebd.yaml"), "--raw", "-v",
               "--set", "engine.attention=flex", "--set", "engine.compile=off", "--set", "max_new_tokens=4", "b0 c0"])
    assert rc == 0
    err = capsys.readouterr().err
    assert err.count("mbd generate: engine: ") == 1 and "attention=flex" in err and "compile=off" in err
    assert (built[0].runner.attention, built[0].cfg.max_new_tokens) == ("flex", 4)


def test_serve_prints_the_engine_config_once(monkeypatch, capsys):
    import pipelines.ray_session
    from pipelines.serve import main as serve_main

    class Stop(Exception):
        pass

    # stop where the cluster would start (whether or not this process is already connected to one)
    monkeypatch.setattr(pipelines.ray_session, "ray_cluster", lambda *a, **kw: (_ for _ in ()).throw(Stop()))
    with pytest.raises(Stop):
        serve_main(["--config", str(CONFIGS.parent / "serve" / "tiny.yaml"), "--set", "engine.attention=flex"])
    out = capsys.readouterr().out
    assert out.count("mbd serve: engine: ") == 1 and "attention=flex" in out and "max_batch_rows=8" in out
