"""Storage by URI (mbd/storage.py): the same files through a local path, a file:// URI and s3:// on a real
S3-compatible server process (moto's `moto_server`, started here; credentials from the environment only); `mbd
expand` writes its rows, and `mbd train` its checkpoints, metrics and export, to s3://, and `mbd export` reads a run
from s3:// and writes the model back there; an evaluation sweep stores its results and report on s3:// and a re-run
resumes from what the bucket holds."""

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


def test_staged_output_pushes_only_changed_files(tmp_path):
    from mbd.eval.result_sync import staged_output

    dest = f"file://{tmp_path}/remote"
    storage.write_text(f"{dest}/results/a.jsonl", "old\n")
    with staged_output(dest) as stage:
        assert (stage.local / "results" / "a.jsonl").read_text() == "old\n"  # what the URI held, pulled first
        assert stage.push() == 0
        (stage.local / "results" / "a.jsonl").write_text("old\nnew\n")
        (stage.local / "report.md").write_text("# r\n")
        assert stage.push(every_s=3600) == 0  # throttled: the last push was just now
        assert stage.push() == 2 and stage.push() == 0
        (stage.local / "late.txt").write_text("x")
    assert storage.read_text(f"{dest}/results/a.jsonl") == "old\nnew\n"
    assert storage.list_names(dest) == ["late.txt", "report.md", "results"]  # the last push: when the block ends
    assert not stage.local.exists()


def test_eval_sweep_results_on_s3_and_resume_from_the_bucket(s3, ray_cluster, tmp_path):
    """Decoders never touch the bucket (the driver stages the results), so the session's cluster serves here."""
    from mbd.eval.sweep import SweepConfig
    from mbd.model import build_model, save_checkpoint
    from mbd.tiny.vocab import save_tokenizer, special_token_ids
    from pipelines.eval_sweep import run_sweep
    from tests.conftest import tiny_cfg

    ids = special_token_ids()
    mcfg = tiny_cfg("sdar", vocab_size=56, mask_token_id=ids["mask_token_id"], eos_token_id=ids["eos_token_id"],
                    pad_token_id=ids["pad_token_id"], max_position_embeddings=512)
    save_checkpoint(build_model(mcfg, seed=0), mcfg, tmp_path / "m")
    save_tokenizer(tmp_path / "m")
    out = f"{s3}/sweeps/tiny"
    cfg = SweepConfig(
        name="s3", output_dir=out, models=[{"name": "rand", "path": str(tmp_path / "m")}],
        decoding=[{"name": "single", "config": "configs/decode/tiny_singlebd.yaml",
                   "overrides": {"max_length": 512, "max_new_tokens": 8, "max_nfe": 16}}],
        benchmarks=[{"name": "tinymath", "limit": 4}], engine={"device": "cpu", "max_batch_rows": 2},
        trace_problems=1, workers=1, cpus_per_worker=0.5, cpus_per_scorer=0.25)
    first = run_sweep(cfg, progress=False)
    assert (first.decoded, first.skipped) == (4, 0)
    assert first.report_path == f"{out}/report.md" and first.plots[0] == f"{out}/plots/accuracy_vs_tpf.png"
    results = f"{out}/results/rand/single/tinymath.jsonl"
    rows = [json.loads(line) for line in storage.read_text(results).splitlines()]
    assert len(rows) == len({r["problem_id"] for r in rows}) == 4
    assert len(storage.read_text(f"{out}/traces/rand/single/tinymath.jsonl").splitlines()) == 1
    assert storage.read_bytes(first.plots[0])[:4] == b"\x89PNG"
    assert json.loads(storage.read_text(f"{out}/summary.json"))["report_path"] == first.report_path
    assert pq.read_table(first.parquet_path.removeprefix("s3://"), filesystem=storage.filesystem(s3)[0]).num_rows == 4

    second = run_sweep(cfg, progress=False)  # everything is stored in the bucket: nothing decoded
    assert (second.decoded, second.skipped) == (0, 4)
    storage.write_text(results, "".join(json.dumps(r) + "\n" for r in rows[:3]))  # one record lost
    again = run_sweep(cfg, progress=False)
    assert (again.decoded, again.skipped) == (1, 3)
    assert sorted(json.loads(line)["problem_id"] for line in storage.read_text(results).splitlines()) == \
        sorted(r["problem_id"] for r in rows)
