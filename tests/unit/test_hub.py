"""Hugging Face Hub ids (mbd/model/hub.py), offline, against a hub cache this test lays out itself in the
layout huggingface_hub writes (models--ORG--NAME/{refs,snapshots}/...)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants
from huggingface_hub.utils import filter_repo_objects

from mbd.config import REPO_ROOT, ConfigError
from mbd.hub import ALLOW_PATTERNS, parse_hub_id, resolve_model

TINY = REPO_ROOT / "mbd" / "assets" / "tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """Cache holding `mbd-test/tiny-sdar` at two commits: main -> COMMIT (the tiny model), tag v0 -> OLD (a
    snapshot without weights, so that resolving the wrong revision would show)."""
    repo = tmp_path / "hub" / "models--mbd-test--tiny-sdar"
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / f, snap / f)
    (repo / "snapshots" / OLD).mkdir()
    (repo / "snapshots" / OLD / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v0").write_text(OLD)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    from mbd import hub
    hub._snapshot.cache_clear()
    yield tmp_path / "hub"
    hub._snapshot.cache_clear()


def test_hub_ids_parse():
    assert parse_hub_id("JetLM/SDAR-8B-Chat") == ("JetLM/SDAR-8B-Chat", None)
    assert parse_hub_id("inclusionAI/LLaDA2.0-mini@v1.0") == ("inclusionAI/LLaDA2.0-mini", "v1.0")
    assert parse_hub_id(f"org/name@{COMMIT}") == ("org/name", COMMIT)
    for not_an_id in ("mbd/assets/tiny/x", "/abs/dir", "./org/name", "org/../x", "name", "org/name@"):
        assert parse_hub_id(not_an_id) is None, not_an_id


def test_revisions_resolve_from_the_cache_offline(hub_cache):
    snap = hub_cache / "models--mbd-test--tiny-sdar" / "snapshots"
    assert resolve_model("mbd-test/tiny-sdar") == snap / COMMIT
    assert resolve_model("mbd-test/tiny-sdar@main") == snap / COMMIT
    assert resolve_model("mbd-test/tiny-sdar@v0") == snap / OLD
    assert resolve_model(f"mbd-test/tiny-sdar@{OLD}") == snap / OLD


def test_local_directories_still_win(hub_cache):
    assert resolve_model("mbd/assets/tiny").resolve() == TINY
    assert resolve_model(str(TINY)) == TINY


def test_offline_miss_says_so(hub_cache):
    with pytest.raises(ConfigError, match="offline .*not in the Hugging Face cache"):
        resolve_model("mbd-test/not-cached")
    with pytest.raises(ConfigError, match="offline"):
        resolve_model("mbd-test/tiny-sdar@v9")


def test_only_weights_config_tokenizer_and_template_are_fetched():
    """The file list of a real SDAR repository (JetLM/SDAR-4B-Chat-b64), filtered by huggingface_hub's own
    matcher with our patterns: what the loader reads (the chat template too, rendered in a sandbox), no
    modeling/configuration/tokenization code."""
    files = [".gitattributes", "README.md", "added_tokens.json", "chat_template.jinja", "config.json",
             "configuration_sdar.py", "generation_config.json", "merges.txt", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors", "model.safetensors.index.json", "modeling_sdar.py",
             "special_tokens_map.json", "tokenization_qwen2.py", "tokenization_qwen2_fast.py", "tokenizer.json",
             "tokenizer_config.json", "vocab.json"]
    got = sorted(filter_repo_objects(files, allow_patterns=ALLOW_PATTERNS))
    assert got == ["chat_template.jinja", "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                   "model-00002-of-00002.safetensors", "model.safetensors.index.json", "special_tokens_map.json",
                   "tokenizer.json", "tokenizer_config.json"]


def test_environment_variables_are_respected(hub_cache):
    """A fresh process reads HF_HUB_OFFLINE and HF_HUB_CACHE from its environment."""
    code = "import sys; from mbd.hub import resolve_model; print(resolve_model(sys.argv[1]))"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache), "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", code, "mbd-test/tiny-sdar@v0"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == hub_cache / "models--mbd-test--tiny-sdar" / "snapshots" / OLD


def test_cli_generates_from_a_hub_id(hub_cache, capsys):
    """`mbd generate --model ORG/NAME@REV` gives the same tokens as the local directory; a miss exits 2."""
    from mbd.config import load_decode
    from mbd.decoding import build_engine
    from pipelines.generate import main

    args = ["--config", "configs/decode/tiny_multibd.yaml", "--json", "3*4+2*7-5"]
    assert main(args + ["--model", f"mbd-test/tiny-sdar@{COMMIT}"]) == 0
    got = json.loads(capsys.readouterr().out.splitlines()[0])["token_ids"]
    engine = build_engine(str(TINY), *load_decode(REPO_ROOT / "configs/decode/tiny_multibd.yaml"))
    assert got == engine.generate(["3*4+2*7-5"])[0].token_ids
    assert main(args + ["--model", "mbd-test/absent"]) == 2
    assert "offline" in capsys.readouterr().err
