"""Storage by URI (mbd/storage.py): the same files through a local path, a file:// URI and s3:// on a real
S3-compatible server process (moto's `moto_server`, started here; credentials from the environment only); `mbd
expand` writes its rows, and `mbd train` its checkpoints, metrics and export, to s3://, and `mbd export` reads a run
from s3:// and writes the model back there."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch

from actors.tp_worker import free_port
from mbd import storage
from mbd.model import load_checkpoint

MOTO = Path(sys.executable).with_name("moto_server")  # this environment's (a moto_server on PATH may be another's)


@pytest.fixture
def s3(monkeypatch):
    """A bucket on a moto S3 server process of this test; AWS_* in the environment point at it."""
    if not MOTO.exists():
        pytest.skip("moto_server not installed (pip install 'moto[server]')")
    port = free_port()
    server = subprocess.Popen([str(MOTO), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    for key, value in {"AWS_ACCESS_KEY_ID": "mbd-test", "AWS_SECRET_ACCESS_KEY": "mbd-test-secret",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}.items():
        monkeypatch.setenv(key, value)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http",
                                  allow_bucket_creation=True).create_dir("mbd")
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "moto_server did not start"
                time.sleep(0.5)
        yield "s3://mbd"
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.parametrize("kind", ["local", "file", "s3"])
def test_files_round_trip_through_every_kind_of_location(kind, tmp_path, request):
    base = {"local": str(tmp_path / "d"), "file": f"file://{tmp_path}/d"}.get(kind) or \
        request.getfixturevalue("s3") + "/d"
    storage.write_text(storage.join(base, "a", "x.txt"), "one\n")
    storage.append_text(storage.join(base, "a", "x.txt"), "two\n")
    assert storage.read_text(storage.join(base, "a", "x.txt")) == "one\ntwo\n"
    assert storage.exists(storage.join(base, "a")) and not storage.exists(storage.join(base, "nope"))
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "w.bin").write_bytes(b"\0\1\2")
    with storage.local_dir_for(storage.join(base, "up")) as out:
        shutil.copytree(src, out, dirs_exist_ok=True)
    assert storage.read_bytes(storage.join(base, "up", "sub", "w.bin")) == b"\0\1\2"
    assert storage.list_names(base) == ["a", "up"] and storage.list_names(base, "u") == ["up"]
    with storage.local_copy_of(storage.join(base, "up")) as local:
        assert (local / "sub" / "w.bin").read_bytes() == b"\0\1\2"


def test_join_keeps_a_uris_query_at_the_end():
    assert storage.join("s3://b/runs?scheme=http", "x", "y") == "s3://b/runs/x/y?scheme=http"
    assert storage.join("runs", "x") == str(Path("runs", "x"))


@pytest.mark.slow  # a cluster and a DeepSpeed run of its own: about 1.5 min on an idle 2-core machine
def test_expand_train_and_export_on_s3(s3, multinode, tmp_path):
    """The cluster starts after the credentials are in the environment: every node's processes see them, as on
    a real cluster whose nodes carry them (never a file in the repository)."""
    from pipelines.export import main as export_main
    from pipelines.expand_layouts import ExpandConfig, run_expand
    from pipelines.train_multitf import run_train
    from tests.integration.train_helpers import make_model_and_corpus, train_config

    multinode(workers=(1,), head_cpus=1)
    model_dir, corpus = make_model_and_corpus(tmp_path, records=16)
    exp = run_expand(ExpandConfig(inputs=[str(corpus)], output_dir=f"{s3}/expanded", model_dir=str(model_dir),
                                  max_length=64, gmax=3, n_rand=1, seed=1))
    fs, _ = storage.filesystem(s3)
    files = storage.list_files(f"{s3}/expanded/rows", ".parquet")
    assert exp.rows_out == 16 * exp.layouts_per_sequence == sum(pq.ParquetFile(f, filesystem=fs).metadata.num_rows
                                                                for f in files)

    cfg = train_config("s3run", f"{s3}/runs", model_dir, corpus, steps=2, checkpoint_every=2)
    summary = run_train(cfg, show_progress=False)
    assert summary.export_dir == f"{s3}/runs/s3run/export" and summary.last_step == 2
    metrics = [json.loads(line) for line in storage.read_text(f"{s3}/runs/s3run/metrics.jsonl").splitlines()]
    assert [int(m["step"]) for m in metrics if "loss" in m] == [1, 2]

    assert export_main(["--run-dir", f"{s3}/runs/s3run", "--out", f"{s3}/models/tiny"]) == 0
    with storage.local_copy_of(f"{s3}/models/tiny") as a, storage.local_copy_of(summary.export_dir) as b:
        ma, _ = load_checkpoint(a)
        mb, _ = load_checkpoint(b)
        assert all(torch.equal(x, y) for x, y in zip(ma.state_dict().values(), mb.state_dict().values()))
    assert os.environ["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
