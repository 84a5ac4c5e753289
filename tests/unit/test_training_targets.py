"""Records too long for max_length are left out with a reason and counted, never truncated."""

import json

from pipelines.train_multitf import tokenize_corpus


def test_over_long_records_are_counted_per_reason(tmp_path):
    corpus = tmp_path / "c.jsonl"
    rows = [{"prompt": "3+4", "response": "7"}, {"prompt": "1+1", "response": "2" * 400}, {"prompt": "2+2"}]
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    seqs, skipped = tokenize_corpus(str(corpus), "mbd/assets/tiny", 4, 64)
    assert len(seqs) == 1 and len(seqs[0].clean_ids) <= 64
    assert skipped == {"too_long": 1, "invalid_schema": 1}
