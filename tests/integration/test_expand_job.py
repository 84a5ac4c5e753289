"""The Ray Data layout-expansion job on a small corpus (JSONL + Parquet, good and bad records)."""

import json
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

from mbd.multitf.corrupt import ROW_SCHEMA
from mbd.multitf.layouts import num_layouts
from pipelines.expand_layouts import ROWS_ARROW_SCHEMA, ExpandConfig, config_from_args, run_expand

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|pad|>", "<|mask|>", "[UNK]"]
WORDS = ("user assistant system what is two plus three answer five write a loop for i in range print the sum "
         "of numbers hello world explain recursion it calls itself").split()
B, GMAX, N_RAND = 4, 3, 2


def make_model_dir(path):
    vocab = {w: i for i, w in enumerate(SPECIALS + sorted(set(WORDS)))}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    config = dict(architectures=["SDARForCausalLM"], vocab_size=len(vocab), hidden_size=16, intermediate_size=32,
                  num_hidden_layers=1, num_attention_heads=2, eos_token_id=vocab["<|endoftext|>"],
                  pad_token_id=vocab["<|pad|>"], mask_token_id=vocab["<|mask|>"], block_size=B)
    (path / "config.json").write_text(json.dumps(config))
    return vocab


GOOD_JSONL = [
    {"prompt": "what is two plus three", "response": "the answer is five"},
    {"prompt": "write a loop", "response": "for i in range print i"},
    {"prompt": "hello", "response": "hello world"},
    {"messages": [{"role": "system", "content": "explain"}, {"role": "user", "content": "explain recursion"},
                  {"role": "assistant", "content": "it calls itself"}]},
    {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello world"},
                  {"role": "user", "content": "print the sum"},
                  {"role": "assistant", "content": "print the sum of numbers"}]},
]
GOOD_PARQUET = [{"prompt": "what is the sum", "response": "five"}, {"prompt": "print", "response": "hello"}]
# (reason, line): every kind of record that cannot become training rows; none may fail the job.
BAD_LINES = [
    ("empty_response", json.dumps({"prompt": "hello", "response": "   "}).encode()),
    ("invalid_schema", json.dumps({"question": "no response field"}).encode()),
    ("invalid_schema", json.dumps({"prompt": 5, "response": "five"}).encode()),
    ("invalid_schema", json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                                {"role": "assistant", "content": "hello"}]}).encode()),
    ("invalid_schema", b"[1, 2, 3]"),
    ("invalid_schema", b"null"),
    ("undecodable", b'{"prompt": "x", "response": "\xff\xfe broken utf8"}'),
    ("undecodable", b"{not json"),
    ("invalid_unicode", b'{"prompt": "1+\\ud800", "response": "hello"}'),  # a lone surrogate (JSON escape)
    ("invalid_unicode", b'{"messages": [{"role": "user", "content": "hi"}, '
                        b'{"role": "assistant", "content": "hello \\udfff"}]}'),
    ("special_token_text", json.dumps({"prompt": "hello", "response": "five <|mask|> five"}).encode()),
    ("special_token_text", json.dumps({"prompt": "hello <|im_end|> <|im_start|>system", "response": "five"}).encode()),
    ("special_token_text", json.dumps({"messages": [{"role": "system", "content": "the <|endoftext|> end"},
                                                    {"role": "user", "content": "hello"},
                                                    {"role": "assistant", "content": "world"}]}).encode()),
    ("too_long", json.dumps({"prompt": "hello " * 30, "response": "world " * 30}).encode()),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("expand")
    vocab = make_model_dir(root / "model")
    data = root / "data"
    data.mkdir()
    bad = [line for _, line in BAD_LINES]
    good = [json.dumps(r).encode() for r in GOOD_JSONL]
    lines = [x for pair in zip(good, bad) for x in pair] + good[len(bad):] + bad[len(good):]  # interleaved
    (data / "corpus.jsonl").write_bytes(b"\n".join(lines) + b"\n\n")
    pq.write_table(pa.Table.from_pylist(GOOD_PARQUET), data / "extra.parquet")
    return root, vocab


def config(root, out, **kw):
    return ExpandConfig(inputs=[str(root / "data")], output_dir=str(root / out), model_dir=str(root / "model"),
                        max_length=64, gmax=GMAX, n_rand=N_RAND, seed=3, **kw)


def read_rows(rows_dir):
    table = pa.concat_tables([pq.read_table(f) for f in sorted(rows_dir.glob("*.parquet"))])
    return table, sorted(table.to_pylist(), key=lambda r: (r["seq_id"], r["layout_index"]))


@pytest.fixture(scope="module")
def first_run(ray_cluster, corpus):
    root, _ = corpus
    return run_expand(config(root, "out_a"))


def test_counts_and_quarantine(first_run, corpus):
    root, _ = corpus
    s = first_run
    n_bad = len(BAD_LINES)
    n_good = len(GOOD_JSONL) + len(GOOD_PARQUET)
    assert s.layouts_per_sequence == num_layouts(GMAX, N_RAND) == (GMAX + 2) * (GMAX - 1) // 2 + N_RAND
    assert (s.sequences_in, s.quarantined, s.sequences_ok) == (n_good + n_bad, n_bad, n_good)
    assert s.rows_out == s.sequences_in * s.layouts_per_sequence - s.quarantined * s.layouts_per_sequence
    assert s.quarantine_reasons == Counter(reason for reason, _ in BAD_LINES)
    quarantined = [json.loads(line) for f in (root / "out_a" / "quarantine").glob("*.json")
                   for line in f.read_text().splitlines()]
    assert sorted(q["reason"] for q in quarantined) == sorted(reason for reason, _ in BAD_LINES)
    assert all(q["source"].startswith(str(root / "data")) for q in quarantined)


def test_every_good_record_is_expanded(first_run, corpus):
    """Interleaved with every bad kind, each good record's response is the answer of exactly one sequence."""
    root, vocab = corpus
    _, rows = read_rows(root / "out_a" / "rows")
    answers = {}
    for r in rows:
        answers[r["seq_id"]] = tuple(r["clean_ids"][r["prompt_len"]: r["prompt_len"] + r["response_len"] - 1])
    responses = [r["response"] for r in GOOD_PARQUET] + [
        r["response"] if "response" in r else r["messages"][-1]["content"] for r in GOOD_JSONL]
    expected = sorted(tuple(vocab[w] for w in text.split()) for text in responses)
    assert sorted(answers.values()) == expected


def test_schema_and_row_contents(first_run, corpus):
    root, vocab = corpus
    table, rows = read_rows(root / "out_a" / "rows")
    assert table.schema.names == list(ROW_SCHEMA)
    assert table.schema.equals(ROWS_ARROW_SCHEMA)
    per_seq = {}
    for r in rows:
        per_seq.setdefault(r["seq_id"], []).append(r["layout_index"])
        clean, noisy = np.array(r["clean_ids"]), np.array(r["noisy_ids"])
        length = clean.size
        assert length % B == 0 and length <= 64 and len(r["block_group"]) == len(r["block_ratio"]) == length // B
        end = r["prompt_len"] + r["response_len"]  # the block-alignment pads after it are targets too (as the authors')
        assert r["total_len"] == length and length - end < B
        assert clean[end - 1] == vocab["<|endoftext|>"]
        assert (clean[end:] == vocab["<|pad|>"]).all()
        assert clean[0] == vocab["<|im_start|>"]
        masked = noisy != clean
        assert (noisy[masked] == vocab["<|mask|>"]).all() and not masked[: r["prompt_len"]].any()
        assert (r["layout_kind"] == "random") == (r["g"] == -1 == r["h"])
    assert len(per_seq) == len(GOOD_JSONL) + len(GOOD_PARQUET)
    assert all(sorted(v) == list(range(num_layouts(GMAX, N_RAND))) for v in per_seq.values())


def test_rerun_is_identical_and_new_epoch_changes_noise(first_run, corpus):
    root, _ = corpus
    run_expand(config(root, "out_b"))
    run_expand(config(root, "out_c", epoch=1))
    _, a = read_rows(root / "out_a" / "rows")
    _, b = read_rows(root / "out_b" / "rows")
    _, c = read_rows(root / "out_c" / "rows")
    assert a == b
    assert [r["clean_ids"] for r in a] == [r["clean_ids"] for r in c]
    assert sum(x["noisy_ids"] != z["noisy_ids"] for x, z in zip(a, c)) > len(a) // 2


def test_the_pipelines_read_parquet_through_ray_datas_v1_reader(first_run, corpus):
    """pipelines.parquet: the rows come back whole through `ReadParquet` (V2 plans `ListFiles` and a pool of
    footer-reading actors at every execution), and the session's DataContext keeps its own choice."""
    import ray

    from pipelines.parquet import read_parquet

    root, _ = corpus
    ctx = ray.data.DataContext.get_current()
    before = ctx.use_datasource_v2
    ds = read_parquet(str(root / "out_a" / "rows")).materialize()
    assert ctx.use_datasource_v2 == before
    stats = ds.stats()
    assert "ReadParquet" in stats and "ListFiles" not in stats
    assert ds.count() == read_rows(root / "out_a" / "rows")[0].num_rows == first_run.rows_out


def test_cli_flags_override_yaml(tmp_path):
    cfg_file = tmp_path / "x.yaml"
    cfg_file.write_text("inputs: [a.jsonl]\noutput_dir: out\nmodel_dir: m\ngmax: 4\n"
                        "scheduler: {name: d2f, t_low: 0.2}\n")
    cfg = config_from_args(["--config", str(cfg_file), "--epoch", "2", "--rho", "0.3", "--n-rand", "3",
                            "--set", "seed=9", "--set", "scheduler.t_high=0.9"])
    assert (cfg.gmax, cfg.epoch, cfg.n_rand, cfg.seed, cfg.scheduler.t_high) == (4, 2, 3, 9, 0.9)
    assert (cfg.scheduler.name, cfg.scheduler.t_low, cfg.scheduler.rho) == ("d2f", 0.2, 0.3)
    with pytest.raises(ValueError, match="gmax"):
        config_from_args(["--config", str(cfg_file), "--gmax", "1"])


def test_a_model_dir_relative_to_the_repository_works_from_any_directory(ray_cluster, tmp_path, monkeypatch):
    """`--model-dir mbd/assets/tiny` as the docs write it, from a directory that is not the repository (where a job
    driver and Ray's workers start): the driver and every task find the model."""
    from mbd.tiny.task import generate, write_jsonl

    write_jsonl(str(tmp_path / "in.jsonl"), generate("posttrain", 40, seed=1))
    monkeypatch.chdir(tmp_path)
    s = run_expand(ExpandConfig(inputs=[str(tmp_path / "in.jsonl")], output_dir=str(tmp_path / "out"),
                                model_dir="mbd/assets/tiny", max_length=128, gmax=2, n_rand=0))
    assert (s.sequences_in, s.quarantined, s.rows_out) == (40, 0, 40 * s.layouts_per_sequence)
