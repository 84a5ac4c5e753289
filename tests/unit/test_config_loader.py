"""The one config loader: YAML + `--set key.sub=value` overrides (YAML-typed values), one dtype parser, one path
anchor; every CLI (train, pretrain-tiny, expand, eval) goes through it."""

from pathlib import Path

import pytest
import torch

from mbd.config import REPO_ROOT, ConfigError, DecodeConfig, apply_sets, load_yaml, parse_dtype, resolve_path
from mbd.train_config import TrainConfig


def test_sets_nest_parse_yaml_values_and_apply_in_order():
    data = apply_sets({"a": {"b": 1}}, ["a.b=2", "a.c=[1, 2]", "d.e.f=true", "g=none text", "a.b=0.5"])
    assert data == {"a": {"b": 0.5, "c": [1, 2]}, "d": {"e": {"f": True}}, "g": "none text"}


@pytest.mark.parametrize("item, match", [("novalue", "KEY=VALUE"), ("=3", "KEY=VALUE"), ("a.b=1", "'a' is not a section"),
                                         ("x=[1, 2", "not valid YAML")])
def test_bad_sets_name_the_item(item, match):
    with pytest.raises(ConfigError, match=match):
        apply_sets({"a": 5}, [item])


def test_load_yaml_applies_sets_before_validation(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("buffer_size: 2\ntau_add: 0.1\n")
    cfg = load_yaml(f, DecodeConfig, sets=["buffer_size=4", "tau_m2t=0.7"])
    assert (cfg.buffer_size, cfg.tau_add, cfg.tau_m2t) == (4, 0.1, 0.7)
    with pytest.raises(ConfigError, match="buffer_size"):
        load_yaml(f, DecodeConfig, sets=["buffer_size=0"])


def test_train_cli_sets_reach_the_config():
    cfg = load_yaml(REPO_ROOT / "configs/train/tiny_cpu.yaml", TrainConfig, sets=["steps=7", "deepspeed.zero_stage=3"])
    assert (cfg.steps, cfg.deepspeed.zero_stage) == (7, 3)


@pytest.mark.parametrize("name, dtype", [("float32", torch.float32), ("fp32", torch.float32), ("bf16", torch.bfloat16),
                                         ("bfloat16", torch.bfloat16), ("fp16", torch.float16)])
def test_one_dtype_parser(name, dtype):
    assert parse_dtype(name) is dtype


def test_unknown_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match="float8"):
        parse_dtype("float8")


def test_paths_resolve_from_the_working_directory_then_the_repository(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_path("configs/quickstart.yaml") == REPO_ROOT / "configs/quickstart.yaml"
    (tmp_path / "configs").mkdir()
    assert resolve_path("configs") == Path("configs")  # the working directory wins
    assert resolve_path("/abs/x") == Path("/abs/x")


def test_eval_cli_flags_are_sets():
    from pipelines.eval_sweep import load_with_flags, parser

    args = parser().parse_args(["--sweep", "configs/eval/tiny_sweep.yaml", "--workers", "3", "--limit", "5",
                                "--set", "output_dir=/tmp/x"])
    cfg = load_with_flags(args)
    assert cfg.workers == 3 and cfg.output_dir == "/tmp/x" and all(b.limit == 5 for b in cfg.benchmarks)


def test_a_config_path_relative_to_the_repository_loads_from_any_directory(tmp_path, monkeypatch):
    """`--config configs/...` from a directory that is not the repository (a job driver's): found under the
    repository root; a path that exists in the working directory wins; a missing one is named as given."""
    import pytest

    from mbd.config import ConfigError, read_yaml

    monkeypatch.chdir(tmp_path)
    assert read_yaml("configs/train/tiny_cpu.yaml")["model_path"] == "mbd/assets/tiny"
    (tmp_path / "configs" / "train").mkdir(parents=True)
    (tmp_path / "configs" / "train" / "tiny_cpu.yaml").write_text("model_path: here\n")
    assert read_yaml("configs/train/tiny_cpu.yaml")["model_path"] == "here"
    with pytest.raises(ConfigError, match="config file not found: configs/nope.yaml"):
        read_yaml("configs/nope.yaml")
