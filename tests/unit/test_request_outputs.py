"""What a request gets back beyond its tokens, and what leaving early does: an aborted request (a client gone)
frees its row and KV pages at the next step without disturbing the others; provisional blocks; top_logprobs."""


from mbd.config import DecodeConfig, EngineConfig
from mbd.decoding import Engine
from mbd.model import build_model
from tests.conftest import tiny_cfg

DC = DecodeConfig(buffer_size=2, max_length=200, max_new_tokens=120, max_nfe=400, tau_add=0.25, tau_semi=0.5,
                  tau_m2t=0.3, ignore_eos=True)


def test_abort_frees_row_and_pages_within_one_step():
    model = build_model(tiny_cfg(max_position_embeddings=256), seed=1).eval()
    others = [[5, 6, 7, 8, 9, 10], list(range(20, 33))]
    alone = Engine(model, None, DC, EngineConfig(max_batch_rows=4, page_size=4)).generate(others)
    eng = Engine(model, None, DC, EngineConfig(max_batch_rows=4, page_size=4, prefix_caching=False))
    ids = [eng.add_request(p) for p in others]
    gone = eng.add_request(list(range(40, 57)))
    out: dict[str, list[int]] = {i: [] for i in ids}
    for _ in range(6):  # all three decoding, some blocks committed
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    row = eng.scheduler.by_id[gone].row
    held = len(eng.kv.tables[row])
    assert row >= 0 and held > 0 and eng.num_free_rows() == 1
    used = eng.kv.used()
    assert eng.abort(gone)
    step = eng.step()  # the very next step frees it
    assert [(o.request_id, o.finish_reason) for o in step if o.finished] == [(gone, "abort")]
    assert eng.num_free_rows() == 2 and row not in eng.scheduler.running
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


def test_provisional_tokens_are_reported_and_change_nothing():
    """With `provisional`, every step also reports the Block Buffer's not-yet-final tokens (masks included)
    after the final ones; the final tokens are those of a run without it, and each final block was reported
    provisionally before (the same positions) unless it became final in the step that first filled it."""
    model = build_model(tiny_cfg(max_position_embeddings=256), seed=1).eval()
    prompt = [5, 6, 7, 8, 9, 10]
    want = Engine(model, None, DC, EngineConfig(max_batch_rows=2)).generate([prompt])[0].token_ids
    eng = Engine(model, None, DC, EngineConfig(max_batch_rows=2))
    eng.add_request(prompt, {"provisional": True})
    final, seen = [], []
    while eng.has_unfinished():
        for o in eng.step():
            final += o.new_token_ids
            if o.provisional is not None:
                assert all(len(b) <= 4 for b in o.provisional)  # per block
                seen.append((len(final), [t for b in o.provisional for t in b]))
                assert len(final) + len(seen[-1][1]) <= 120
    assert final == want and len(seen) > 3
    mask = model.cfg.mask_token_id
    assert any(mask in p for _, p in seen) and any(t != mask for _, p in seen for t in p)
    # a provisional token agrees with the final one when the step that reported it left it unchanged
    assert sum(final[at + i] == t for at, p in seen for i, t in enumerate(p) if t != mask and at + i < len(final)) > 0
    plain = Engine(model, None, DC, EngineConfig(max_batch_rows=2))
    plain.add_request(prompt)
    assert all(o.provisional is None for _ in range(3) for o in plain.step())


def test_top_logprobs_are_the_distribution_each_token_was_accepted_from():
    """Greedy: the returned token is the top-1 of its distribution, its logprob equals the top-1's, the top-k
    are sorted and are log-probabilities of distinct tokens (the mask token never among them)."""
    model = build_model(tiny_cfg(max_position_embeddings=256), seed=1).eval()
    eng = Engine(model, None, DC, EngineConfig(max_batch_rows=2))
    rid = eng.add_request([5, 6, 7, 8, 9, 10], {"logprobs": True, "top_logprobs": 3, "max_new_tokens": 24})
    toks, lps, tops = [], [], []
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid:
                toks += o.new_token_ids
                lps += o.new_logprobs
                tops += o.new_top_logprobs
    assert len(toks) == len(lps) == len(tops) == 24
    for t, lp, top in zip(toks, lps, tops):
        assert len(top) == 3 and top[0][0] == t and abs(top[0][1] - lp) < 1e-5
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True) and len({i for i, _ in top}) == 3
        assert model.cfg.mask_token_id not in {i for i, _ in top} and sum(2.718281828 ** v for _, v in top) <= 1 + 1e-5
