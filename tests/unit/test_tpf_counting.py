"""Stored sweep records of the earlier TPF counting are not mixed into reports: a resumed sweep decodes them again."""

import json

from mbd.eval.sweep import TPF_COUNTING, ItemRecord, ResultStore


def test_records_of_the_earlier_counting_are_not_loaded(tmp_path):
    store = ResultStore(tmp_path)
    new = ItemRecord(model="m", config="c", benchmark="b", problem_id="p1", completion="", correct=True, nfe=5,
                     num_generated=10, tpf=2.0, wall_time_s=0.1, step_latency_ms=1.0, finish_reason="eos")
    store.append(new)
    old = {**new.model_dump(), "problem_id": "p2", "nfe": 4, "num_generated": 11}
    del old["counting"]  # written before the field existed: the EOS counted, the last store forward not
    with open(store.path("m", "c", "b"), "a") as f:
        f.write(json.dumps(old) + "\n")
    loaded = store.load("m", "c", "b")
    assert list(loaded) == ["p1"] and loaded["p1"].counting == TPF_COUNTING == 2


def test_a_step_with_nothing_active_pops_its_stored_blocks_in_place():
    """A store-only step (no ACTIVE slot in the batch: the final forward that stores a request's last block) hands
    the buffer's own tokens back to `store_tokens`; popping must shift them as if they were a copy."""
    import torch

    from mbd.decoding.state import BatchBuffers

    buf = BatchBuffers(rows=2, n_buf=4, block=2, mask_id=9, device=torch.device("cpu"))
    buf.tokens[:] = torch.arange(16).view(2, 8)
    buf.store_tokens(buf.tokens[:2, :8], [1, 0])  # row 0 pops one block, row 1 none
    assert buf.tokens.tolist() == [[2, 3, 4, 5, 6, 7, 9, 9], list(range(8, 16))]
