"""`mbd expand` across nodes: blocks run on >= 2 nodes, and a worker node removed mid-job still gives exactly the
rows and counts of the same seeded expansion computed in one process (nothing duplicated, nothing lost)."""

import json
import random
import threading
import time
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines import expand_layouts
from pipelines.expand_layouts import ExpandConfig, run_expand, select, split_jsonl, tokenize_batch
from tests.integration.multinode_jobs import expand_batch_marking_node, marked_nodes
from tests.integration.test_expand_job import WORDS, make_model_dir

RECORDS, PER_TASK = 240, 8  # 30 blocks


def write_corpus(path, n):
    rng = random.Random(7)
    lines = [json.dumps({"prompt": " ".join(rng.choices(WORDS, k=rng.randint(2, 8))),
                         "response": " ".join(rng.choices(WORDS, k=rng.randint(1, 10)))}) for _ in range(n)]
    lines[5] = json.dumps({"prompt": "hello", "response": "  "})  # one quarantined record
    path.write_text("\n".join(lines) + "\n")


def reference_rows(cfg: ExpandConfig, corpus) -> list[dict]:
    """The same stages, called in this process on the whole corpus: what any correct run must write."""
    records = split_jsonl(pa.table({"bytes": [corpus.read_bytes()], "path": [str(corpus)]}))
    _, mcfg = expand_layouts.load_tokenizer(cfg.model_dir)
    tokens = tokenize_batch(records, model_dir=cfg.model_dir, block_size=mcfg.block_size, max_length=cfg.max_length)
    rows = expand_layouts.expand_batch(select(tokens, bad=False), cfg_json=cfg.model_dump_json(),
                                       block_size=mcfg.block_size, mask_token_id=mcfg.mask_token_id)
    return sorted(rows.to_pylist(), key=lambda r: (r["seq_id"], r["layout_index"]))


def written_rows(rows_dir) -> list[dict]:
    table = pa.concat_tables([pq.read_table(f) for f in sorted(rows_dir.glob("*.parquet"))])
    return sorted(table.to_pylist(), key=lambda r: (r["seq_id"], r["layout_index"]))


def test_expand_on_three_nodes_survives_losing_one(multinode, tmp_path, monkeypatch):
    make_model_dir(tmp_path / "model")
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, RECORDS)
    cfg = ExpandConfig(inputs=[str(corpus)], output_dir=str(tmp_path / "out"), model_dir=str(tmp_path / "model"),
                       max_length=64, gmax=3, n_rand=2, seed=11, sequences_per_task=PER_TASK)
    expected = reference_rows(cfg, corpus)

    cluster = multinode(workers=(1, 1))
    head = cluster.cluster.head_node.node_id
    monkeypatch.setattr(expand_layouts, "expand_batch", expand_batch_marking_node)
    outcome = {}
    job = threading.Thread(target=lambda: outcome.update(summary=run_expand(cfg)), daemon=True)
    t0 = time.monotonic()
    job.start()
    deadline = time.monotonic() + 600
    while not {n for n in marked_nodes(cfg.output_dir) if n != head}:  # a worker node has expanded a block
        assert job.is_alive() and time.monotonic() < deadline, "no block ran on a worker node"
        time.sleep(0.2)
    before = Counter(marked_nodes(cfg.output_dir))
    victim = next(n for n in cluster.worker_nodes if n.node_id in before)
    cluster.remove_node(victim)
    removed_at = time.monotonic() - t0
    job.join(timeout=600)
    assert not job.is_alive() and "summary" in outcome, "expansion did not finish after the node loss"
    after = Counter(marked_nodes(cfg.output_dir))
    print(f"\nnode removed after {removed_at:.1f}s with {sum(before.values())} blocks expanded "
          f"({dict(before)}); job done in {time.monotonic() - t0:.1f}s; blocks per node {dict(after)}; "
          f"blocks expanded in all {sum(after.values())} for {-(-(RECORDS - 1) // PER_TASK)} needed")

    s = outcome["summary"]
    assert len(set(after)) >= 2  # blocks ran on >= 2 nodes
    assert victim.node_id in before
    assert (s.sequences_in, s.quarantined, s.sequences_ok) == (RECORDS, 1, RECORDS - 1)
    assert s.rows_out == len(expected) == (RECORDS - 1) * s.layouts_per_sequence
    assert written_rows(tmp_path / "out" / "rows") == expected  # the same rows, each exactly once
