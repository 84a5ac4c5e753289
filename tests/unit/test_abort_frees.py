"""A client that goes away: aborting a request mid-decode frees its batch row and its KV pages at the next step,
and the requests decoding beside it produce exactly the tokens they produce without it."""

import torch

from mbd.config import DecodeConfig
from mbd.decoding import Engine
from mbd.model import build_model
from tests.conftest import tiny_cfg

DC = DecodeConfig(buffer_size=2, max_length=200, max_new_tokens=120, max_nfe=400, tau_add=0.25, tau_semi=0.5,
                  tau_m2t=0.3, ignore_eos=True)


def test_abort_frees_row_and_pages_within_one_step():
    model = build_model(tiny_cfg(max_position_embeddings=256), seed=1).eval()
    others = [[5, 6, 7, 8, 9, 10], list(range(20, 33))]
    alone = Engine(model, None, DC, max_batch_slots=4, page_size=4).generate(others)
    eng = Engine(model, None, DC, max_batch_slots=4, page_size=4, prefix_caching=False)
    ids = [eng.add_request(p) for p in others]
    gone = eng.add_request(list(range(40, 57)))
    out: dict[str, list[int]] = {i: [] for i in ids}
    for _ in range(6):  # all three decoding, some blocks committed
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    row = eng.sched.by_id[gone].row
    held = len(eng.kv.tables[row])
    assert row >= 0 and held > 0 and eng.num_free_slots() == 1
    used = eng.kv.used()
    assert eng.abort(gone)
    step = eng.step()  # the very next step frees it
    assert [(o.request_id, o.finish_reason) for o in step if o.finished] == [(gone, "abort")]
    assert eng.num_free_slots() == 2 and row not in eng.sched.running
    assert eng.kv.used() <= used - held + 2  # its pages are back (the others may map one more page each)
    assert not eng.kv.tables[row]
    for o in step:
        if o.request_id != gone:
            out[o.request_id].extend(o.new_token_ids)
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
    assert [out[i] for i in ids] == [r.token_ids for r in alone]
    assert eng.kv.used() == 0
