"""A checkpoint says how it was trained (mbd/training_record.py), and the commands warn once when a model that is not
an MBD model is decoded with a Block Buffer of more than one slot (training-free MultiBD, claim (b)); the tiny
serve configs take their operating point from the one decode YAML that defines it."""

import hashlib
import json
from pathlib import Path

import pytest

from mbd.config import REPO_ROOT, ConfigError, load_decode
from mbd.training_record import RECORD_FILE, TrainingRecord, multibd_warning, published_mbd, read_record, write_record
from pipelines.generate import main as generate_main
from serve_app.config import load_serve_config

BASE = REPO_ROOT / "mbd" / "assets" / "tiny"
MBD = REPO_ROOT / "mbd" / "assets" / "mbd-tiny"


def _record(mode: str) -> TrainingRecord:
    return TrainingRecord(layouts=mode, objective="multitf_ce", block_size=4, steps=10, base_model="b", data="d")


@pytest.mark.parametrize("mode,warns", [("multitf", False), ("tf", True), ("d2f", True)])
def test_the_record_decides_whether_a_multibd_decode_warns(tmp_path: Path, mode: str, warns: bool):
    write_record(tmp_path, _record(mode))
    assert read_record(tmp_path) == _record(mode)
    assert (multibd_warning(tmp_path, "runs/x", 4) is not None) is warns
    assert multibd_warning(tmp_path, "runs/x", 1) is None  # SingleBD never warns


def test_a_checkpoint_without_a_record_is_judged_by_the_papers_names(tmp_path: Path):
    for name in ("SJTU-DENG-Lab/MBD-LLaDA2-Mini", "org/mbd-sdar-8b-chat-b4@main", "/models/MBD-SDAR-8B-Chat-b32/"):
        assert published_mbd(name) and multibd_warning(tmp_path, name, 2) is None
    warning = multibd_warning(tmp_path, "inclusionAI/LLaDA2.0-mini", 2)
    assert warning is not None and "buffer_size: 1" in warning and "claim (b)" in warning


def test_the_shipped_models_say_what_they_are():
    """The MBD model's record says MultiTF on the base's block size, its provenance names the weights it ships; the
    base has no record and warns under MultiBD."""
    record = read_record(MBD)
    assert record is not None and record.multitf and record.block_size == 4
    prov = json.loads((MBD / "provenance.json").read_text())
    assert prov["model_sha256"] == hashlib.sha256((MBD / "model.safetensors").read_bytes()).hexdigest()
    assert read_record(BASE) is None and multibd_warning(BASE, "mbd/assets/tiny", 4) is not None
    assert not (BASE / RECORD_FILE).exists()


def test_the_tiny_serve_configs_serve_the_mbd_model_at_the_one_operating_point():
    point, _ = load_decode(REPO_ROOT / "configs" / "decode" / "tiny_multibd.yaml")
    thresholds = ("buffer_size", "block_size", "tau_add", "tau_semi", "tau_stable", "tau_m2t", "tau_t2t")
    for name in ("tiny.yaml", "tiny_autoscale.yaml"):
        cfg = load_serve_config(REPO_ROOT / "configs" / "serve" / name)
        assert cfg.model.resolved_path() == MBD
        assert {k: getattr(cfg.decode, k) for k in thresholds} == {k: getattr(point, k) for k in thresholds}
        assert cfg.decode.max_new_tokens == 256  # the service's own limit, beside the base
    assert load_serve_config(REPO_ROOT / "configs" / "serve" / "tiny.yaml", ["decode.tau_add=0.25"]).decode.tau_add == 0.25


def test_a_missing_decode_base_is_refused_by_name(tmp_path: Path):
    cfg = tmp_path / "s.yaml"
    cfg.write_text("model: {path: mbd/assets/mbd-tiny}\ndecode: {base: configs/decode/nope.yaml}\n")
    with pytest.raises(ConfigError, match="decode.base"):
        load_serve_config(cfg)


def test_generate_defaults_to_the_mbd_model_and_warns_for_the_base(capsys):
    config = str(REPO_ROOT / "configs" / "decode" / "tiny_multibd.yaml")
    assert generate_main(["--config", config, "--set", "max_new_tokens=8", "3*4+2*7-5"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert generate_main(["--model", str(BASE), "--config", config, "--set", "max_new_tokens=8", "3*4"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "not an MBD model" in err and "buffer_size 4" in err
