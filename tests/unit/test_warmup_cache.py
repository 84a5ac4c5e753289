"""`mbd warmup` and the keyed compile cache: a cache folder is keyed by torch, device and the compiled config, so a
replica never reads kernels built for another; the command refuses what it cannot warm up, naming the field."""

import json
import logging
import re

import pytest
import torch

from mbd.config import ConfigError, EngineConfig
from mbd.decoding.compiled import cache_key, decode_mode, keyed_cache
from benchmarks.step_floor import shape_config
from pipelines import warmup

FLEX = decode_mode(EngineConfig(attention="flex", compile="default"), torch.device("cpu"))
CPU = torch.device("cpu")


def test_each_torch_device_and_config_has_its_own_folder(tmp_path, monkeypatch):
    cfg = shape_config("tiny", 4)
    key = cache_key(cfg, torch.float32, FLEX, 1, CPU)
    assert key["torch"] == torch.__version__ and key["device"].startswith("cpu ")
    folder = keyed_cache(str(tmp_path), key)
    assert json.loads((tmp_path / folder.rsplit("/", 1)[1] / "key.json").read_text()) == key
    assert keyed_cache(str(tmp_path), key) == folder  # the same engine again: the same folder
    others = [cache_key(cfg.model_copy(update={"block_size": 8}), torch.float32, FLEX, 1, CPU),
              cache_key(cfg, torch.bfloat16, FLEX, 1, CPU), cache_key(cfg, torch.float32, FLEX, 2, CPU),
              cache_key(cfg.model_copy(update={"hidden_size": 256}), torch.float32, FLEX, 1, CPU),
              key | {"device": "NVIDIA H100 80GB HBM3 sm90"}, key | {"torch": "2.99.0"}]
    folders = {keyed_cache(str(tmp_path), k) for k in others}
    assert len(folders) == len(others) and folder not in folders
    # positions enter the layers as cos/sin: another max_position_embeddings compiles the same kernels
    longer = cfg.model_copy(update={"max_position_embeddings": 8 * cfg.max_position_embeddings})
    assert cache_key(longer, torch.float32, FLEX, 1, CPU) == key
    assert keyed_cache(None, key) is None  # no cache set: torch's default


def test_a_folder_holding_another_key_is_refused(tmp_path):
    cfg = shape_config("tiny", 4)
    key = cache_key(cfg, torch.float32, FLEX, 1, CPU)
    folder = keyed_cache(str(tmp_path), key)
    with open(f"{folder}/key.json", "w") as f:  # kernels of another torch copied under this key's name
        json.dump(key | {"torch": "2.99.0"}, f)
    with pytest.raises(ConfigError, match="refused"):
        keyed_cache(str(tmp_path), key)


@pytest.mark.parametrize("extra,field", [
    ([], "--cache"),  # configs/serve/tiny.yaml sets no engine.compile_cache
    (["--cache", "unused", "--set", "model.tensor_parallel_size=2"], "tensor_parallel_size"),
])
def test_warmup_refuses_by_name(extra, field, capsys):
    argv = ["--config", "configs/serve/tiny.yaml", *extra]
    assert warmup.main(argv) == 2
    assert field in capsys.readouterr().err


def test_warmup_refuses_an_eager_engine(tmp_path, capsys):
    assert warmup.main(["--config", "configs/serve/tiny.yaml", "--cache", str(tmp_path)]) == 2
    assert "nothing to compile" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(1800)  # inductor's C++ compile of the tiny layer on a loaded host
def test_warmup_fills_the_cache_a_replica_reads(tmp_path, capsys, caplog):
    """The tiny serve config at one bucket and N_buf 1 (2 shapes): the command compiles them, a line per shape and
    the total; an engine of the same config started with the cache compiles nothing."""
    from torch._dynamo.utils import counters

    sets = ["engine.attention=flex", "engine.compile=default", "engine.batch_buckets=[1]", "engine.max_batch_rows=1",
            "decode.buffer_size=1"]
    argv = ["--config", "configs/serve/tiny.yaml", "--cache", str(tmp_path)] + [x for s in sets for x in ("--set", s)]
    with caplog.at_level(logging.INFO, logger="mbd.engine"):
        assert warmup.main(argv) == 0
    assert "compile cache ready in" in capsys.readouterr().out
    lines = [r.getMessage() for r in caplog.records if r.name == "mbd.engine"]
    assert [x.split(" · ")[0] for x in lines if re.match(r"engine warm-up: \d+/\d+ \(", x)] == [
        "engine warm-up: 1/2 (50%)", "engine warm-up: 2/2 (100%)"]
    assert lines[-1].startswith("engine warm-up done: 2 compiled shapes in ")
    torch._dynamo.reset()
    counters.clear()
    warmup.warm("configs/serve/tiny.yaml", str(tmp_path), None, sets)
    assert counters["inductor"]["fxgraph_cache_miss"] == 0 and counters["inductor"]["fxgraph_cache_hit"] > 0
