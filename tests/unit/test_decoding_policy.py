"""Decision rules on hand-made logits, and engine behaviour with a scripted model whose predictions and
confidences are known exactly: NFE counts from the decode-store overlap, EOS cut, stops, abort,
sampling reproducibility, streaming, and clear errors."""

import math

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers
from torch import nn

from mbd.config import DecodeConfig
from mbd.decoding import Engine, EngineConfig, NaiveMultiBD, Policy, SingleBD
from mbd.decoding.policy import ACTIVE, Kept
from mbd.decoding.state import RequestParams
from mbd.model import build_model
from mbd.tokenizer import Tokenizer
from tests.conftest import tiny_cfg

V, MASK, EOS, B = 64, 63, 62, 4


def conf_logit(p: float) -> float:
    """Logit margin giving the top token probability p against V - 2 zero logits (mask is -inf)."""
    return math.log(p * (V - 2) / (1 - p))


class ScriptedModel(nn.Module):
    """Predicts script[pos] at absolute position pos with probability conf[pos]; ignores the input."""

    def __init__(self, script: list[int], conf: list[float] | float = 0.99, mask_logit: float = 0.0):
        super().__init__()
        self.cfg = tiny_cfg("sdar")
        self.dummy = nn.Parameter(torch.zeros(1))
        conf = [conf] * len(script) if isinstance(conf, float) else conf
        self.register_buffer("tok", torch.tensor(script))
        self.register_buffer("margin", torch.tensor([conf_logit(c) for c in conf]))
        self.mask_logit = mask_logit
        self.calls = 0

    def forward(self, input_ids, position_ids, attn, logits_at=None, token_conf=None):
        self.calls += 1
        pos = position_ids.clamp(max=len(self.tok) - 1)
        if logits_at is not None:  # the engine asks only for the positions it reads
            pos = pos.gather(1, logits_at)
        logits = torch.zeros(*pos.shape, V)
        logits.scatter_(2, self.tok[pos][..., None], self.margin[pos][..., None])
        logits[..., MASK] = self.mask_logit
        return logits


def cfg(**kw):
    base = dict(buffer_size=2, max_length=200, max_new_tokens=16, max_nfe=100, tau_add=0.5, tau_semi=0.5, tau_m2t=0.9)
    base.update(kw)
    return DecodeConfig(**base)


PROMPT = list(range(10, 18))  # 8 tokens: block-aligned
SCRIPT = [5 + (i % 40) for i in range(200)]


# ----------------------------------------------------------------------------- policy on hand-made logits
def logits_for(preds, confs):
    out = torch.zeros(1, len(preds), V)
    for i, (t, c) in enumerate(zip(preds, confs)):
        out[0, i, t] = conf_logit(c)
    return out


def semi(pol, tau):
    return torch.tensor([[pol.semi_max_masked(tau)]])


def tau(v):
    return torch.tensor([[[v]]])


def test_m2t_threshold_fallback_and_semi_rule():
    pol = Policy(B, MASK)
    tokens = torch.tensor([[MASK] * 8])
    state = torch.tensor([[ACTIVE, ACTIVE]])
    lg = logits_for([1, 2, 3, 4, 5, 6, 7, 8], [0.95, 0.5, 0.6, 0.2, 0.3, 0.4, 0.35, 0.1])
    d = pol.update(lg.clone(), tokens, state, tau(0.9), semi(pol, 0.5))
    # slot 0: 0.95 > 0.9 accepted; slot 1: none > 0.9 and slot 0 had progress 0 < tau_semi: no fallback
    assert d.tokens.tolist() == [[1, MASK, MASK, MASK, MASK, MASK, MASK, MASK]]
    d = pol.update(lg.clone(), tokens, state, tau(0.9), torch.tensor([[B]]))  # any block semi-complete: slot 0 too
    assert d.tokens.tolist() == [[1, MASK, MASK, MASK, MASK, 6, MASK, MASK]]
    d = pol.update(lg.clone(), tokens, state, tau(0.99), semi(pol, 0.5))  # the first resident slot always falls back
    assert d.tokens.tolist() == [[1, MASK, MASK, MASK, MASK, MASK, MASK, MASK]]
    assert d.masked_in.tolist() == [[4, 4]] and d.accepted.tolist() == [[1, 0]] and d.revised is None
    assert pol.counts([4, 4], [1, 0], None) == ([1, 0], [Kept(0, 0), Kept(0, 0)])
    # semi-complete is progress > tau_semi (alg:optimized_multibd) on the tokens the model saw: 1 of 4 filled
    # passes 0.2 but not 0.25 exactly
    one_filled = torch.tensor([[9, MASK, MASK, MASK] + [MASK] * 4])
    d = pol.update(lg.clone(), one_filled, state, tau(0.99), semi(pol, 0.2))
    assert d.tokens.tolist()[0][4:] == [MASK, 6, MASK, MASK]
    d = pol.update(lg.clone(), one_filled, state, tau(0.99), semi(pol, 0.25))
    assert d.tokens.tolist()[0][4:] == [MASK] * 4
    assert pol.semi_max_masked(0.25) == 2 and pol.semi_max_masked(0.0) == 3
    assert Policy(10, MASK).semi_max_masked(0.3) == 6
    assert pol.semi_max_masked(1.0) == 0  # the stated rule: a complete block passes 1.0


def test_mask_token_never_predicted_and_to_cache_needs_prefix():
    pol = Policy(B, MASK)
    p = params()
    tokens = torch.tensor([[MASK, 2, 3, 4, 9, 9, 9, MASK]])
    state = torch.tensor([[ACTIVE, ACTIVE]])
    lg = logits_for([1] * 8, [0.99] * 8)
    lg[..., MASK] = 100.0  # the model prefers the mask token everywhere
    d = pol.update(lg, tokens, state, tau(0.5), semi(pol, 0.5))
    assert MASK not in d.tokens.tolist()[0]
    filled, unchanged = pol.counts(d.masked_in[0].tolist(), d.accepted[0].tolist(), None)
    assert pol.final_count(p, 0, 2, filled, unchanged) == 2  # both complete: slot 1 follows a final slot
    d = pol.update(logits_for([1] * 8, [0.99] * 8), torch.tensor([[MASK, MASK, 3, 4, 9, 9, 9, MASK]]), state,
                   tau(0.995), semi(pol, 0.0))
    assert d.tokens.tolist() == [[1, MASK, 3, 4, 9, 9, 9, 1]]
    assert pol.final_count(p, 0, 2, *pol.counts(d.masked_in[0].tolist(), d.accepted[0].tolist(), None)) == 0
    assert pol.final_count(p, 1, 2, [4, 4], [Kept(4, 4)] * 2) == 2
    assert pol.final_count(p, 1, 2, [4, 3], [Kept(4, 4), Kept(3, 3)]) == 1


def test_t2t_revision_and_stability():
    pol = Policy(B, MASK)
    p = params(tau_t2t=0.6)
    tokens = torch.tensor([[7, 7, 7, MASK]])
    fixed = torch.tensor([[True, False, False, False]])
    lg = logits_for([8, 8, 7, 3], [0.9, 0.9, 0.9, 0.99])
    d = pol.update(lg, tokens, torch.tensor([[ACTIVE]]), tau(0.5), semi(pol, 0.5), fixed, torch.tensor([[0.6]]))
    assert d.tokens.tolist() == [[7, 8, 7, 3]]  # the prompt token is never revised
    # 3 tokens filled before the step (one a prompt token), one of them revised: 2 kept out of 3
    assert pol.counts(d.masked_in[0].tolist(), d.accepted[0].tolist(), d.revised[0].tolist()) == ([4], [Kept(2, 3)])
    assert pol.final_count(p, 0, 1, [4], [Kept(2, 3)]) == 0  # complete but changed in this step: not final under T2T
    assert pol.final_count(params(), 0, 1, [4], [Kept(2, 3)]) == 1  # without T2T a complete block is final
    d = pol.update(logits_for([8, 8, 7, 3], [0.9] * 4), d.tokens, torch.tensor([[ACTIVE]]), tau(0.5), semi(pol, 0.5),
                   fixed, torch.tensor([[0.6]]))
    assert pol.counts(d.masked_in[0].tolist(), d.accepted[0].tolist(), d.revised[0].tolist()) == ([4], [Kept(4, 4)])
    assert pol.final_count(p, 0, 1, [4], [Kept(4, 4)]) == 1


def params(**kw):
    return RequestParams.resolve(cfg(**kw), 8, 200)


def test_activation_and_finish_plan():
    pol = Policy(B, MASK)
    p = params(tau_add=0.5, tau_stable=0.5, buffer_size=3)
    go = dict(n_res=1, pre_tc=0, post_tc=0, filled_last=2, unchanged_last=Kept(1, 2), eos_seen=False, nfe=1,
              committed=8)
    # progress > tau_add and stability > tau_stable, strictly (alg:optimized_multibd): 2 of 4 is not > 0.5
    assert not pol.plan(p, **go).activate
    assert pol.plan(p, **{**go, "filled_last": 3, "unchanged_last": Kept(2, 2)}).activate
    assert not pol.plan(p, **{**go, "filled_last": 3, "unchanged_last": Kept(1, 2)}).activate  # stability 0.5
    assert not pol.plan(p, **{**go, "filled_last": 1, "unchanged_last": Kept(1, 1)}).activate  # progress 0.25
    # the stated rule for 1.0: a complete, fully stable block passes tau_add = tau_stable = 1.0
    p1 = params(tau_add=1.0, tau_stable=1.0, buffer_size=3)
    assert pol.plan(p1, **{**go, "filled_last": 4, "unchanged_last": Kept(4, 4)}).activate
    assert not pol.plan(p1, **{**go, "filled_last": 3, "unchanged_last": Kept(3, 3)}).activate
    assert not pol.plan(p1, **{**go, "filled_last": 4, "unchanged_last": Kept(3, 4)}).activate
    # filled in this very step (nothing filled before): stable, as the authors' same_token_ratio
    assert pol.plan(p, **{**go, "filled_last": 4, "unchanged_last": Kept(0, 0)}).activate
    assert pol.plan(p, **{**go, "filled_last": 3, "unchanged_last": Kept(1, 1)}).activate  # 2 new, 1 old kept
    assert not pol.plan(p, **{**go, "eos_seen": True}).activate
    assert not pol.plan(p, **{**go, "n_res": 3}).activate  # no DUMMY slot left
    assert pol.plan(p, **{**go, "n_res": 1, "pre_tc": 1, "post_tc": 1, "filled_last": 0}).activate  # buffer emptied
    # the last block final (eos, or the next block would start at gen_end): done after its store forward
    for last in ({"eos_seen": True}, {"committed": 8 + 16 - 4}):
        final = pol.plan(p, **{**go, **last, "post_tc": 1})
        assert (final.finish, final.activate) == (None, False)
        stored = {**go, **last, "pre_tc": 1, "post_tc": 1}
        stored["committed"] += B  # the store forward committed the block
        assert pol.plan(p, **stored).finish == "done"
        assert pol.plan(p, **{**go, **last, "post_tc": 1, "nfe": 100}).finish == "done"  # no forward left to store
    assert pol.plan(p, **{**go, "committed": 8 + 16 - 4}).finish is None  # next block would start at gen_end
    assert pol.plan(p, **{**go, "nfe": 100}).finish == "max_nfe"


# ----------------------------------------------------------------------------- engine with a scripted model
def stability_reference(block: list[int], before: list[int], after: list[int]) -> float:
    """The authors' definition, written out: of the positions filled before the step, the share the step kept."""
    old = [i for i in range(len(block)) if before[i] != MASK]
    return sum(before[i] == after[i] for i in old) / len(old) if old else 1.0


@pytest.mark.parametrize("ref", ["engine", "naive"])
def test_tau_stable_counts_only_tokens_filled_before_the_step(ref):
    """A near-deterministic model fills each block in one forward. With stability measured over the
    tokens filled before the step, tau_stable 0.5 must not stop the buffer from growing: the same forwards as
    without tau_stable (before the fix each one-step block looked 0% stable and MultiBD fell back toward
    SingleBD: TPF 16/7 instead of 16/4)."""
    assert stability_reference([0] * 4, [MASK] * 4, [1, 2, 3, 4]) == 1.0
    runs = {}
    for ts in (None, 0.5):
        c = cfg(buffer_size=2, tau_add=0.1, tau_stable=ts)
        model = ScriptedModel(SCRIPT)
        res = (Engine(model, None, c, EngineConfig(max_batch_rows=1)).generate([PROMPT])[0] if ref == "engine"
               else NaiveMultiBD(model, c, [EOS]).generate(PROMPT))
        assert res.token_ids == SCRIPT[8:24]
        runs[ts] = res.nfe
    assert runs[0.5] == runs[None] == 4 + 1  # 4 blocks, one forward each, and the last block's store forward


@pytest.mark.parametrize("n_buf,expected_nfe", [(1, 2 * 4), (2, 4 + 1), (4, 4 + 1)])
def test_decode_store_overlap_nfe(n_buf, expected_nfe):
    """All tokens confident: a block completes in one forward. SingleBD then needs a separate store
    forward per block (2K for K blocks); the Block Buffer stores while decoding the next block (K, plus the
    store forward of the last block, which ends the request and is counted, as in the authors' engine)."""
    model = ScriptedModel(SCRIPT)
    res = Engine(model, None, cfg(buffer_size=n_buf, tau_add=0.5 if n_buf > 1 else None), EngineConfig(max_batch_rows=1)).generate([PROMPT])[0]
    assert res.token_ids == SCRIPT[8:24] and res.finish_reason == "length"
    assert res.nfe == expected_nfe and res.tpf == 16 / expected_nfe


def test_prompt_tail_starts_first_block():
    model = ScriptedModel(SCRIPT)
    prompt = PROMPT + [20, 21]  # 10 tokens: 8 prefilled, 2 fixed in the first block
    res = Engine(model, None, cfg(buffer_size=1, tau_add=None, max_new_tokens=6), EngineConfig(max_batch_rows=1)).generate([prompt])[0]
    assert res.token_ids == SCRIPT[10:16] and res.nfe == 4  # blocks [8,12) and [12,16): decode, store each


def test_eos_cut_and_no_activation_after_eos():
    script = list(SCRIPT)
    script[13] = EOS  # 6th generated token
    model = ScriptedModel(script)
    engine = Engine(model, None, cfg(buffer_size=4, tau_add=0.25, max_new_tokens=40), EngineConfig(max_batch_rows=1, trace=True))
    res = engine.generate([PROMPT])[0]
    # the EOS is not counted: 5 tokens, as the authors' engine counts its response cut before the stop token
    assert res.token_ids == script[8:13] and res.finish_reason == "eos" and res.num_generated == 5
    ref = NaiveMultiBD(model, engine.cfg, [EOS]).generate(PROMPT)
    assert (ref.token_ids, ref.nfe, ref.num_generated) == (res.token_ids, res.nfe, res.num_generated)
    # block [12,16) holds EOS: it and its predecessor are complete after 2 forwards, the 3rd stores them
    assert res.nfe == 3 and res.tpf == 5 / 3


def test_max_new_tokens_and_max_nfe():
    model = ScriptedModel(SCRIPT)
    res = Engine(model, None, cfg(max_new_tokens=6), EngineConfig(max_batch_rows=1)).generate([PROMPT])[0]
    assert res.token_ids == SCRIPT[8:14] and res.finish_reason == "length"
    # below tau_m2t: one fallback token per forward, left to right (equal confidences would tie, and a tie is
    # broken by float rounding in the softmax, which differs by position)
    slow = ScriptedModel(SCRIPT, conf=[0.5 - 0.01 * (i % B) for i in range(len(SCRIPT))])
    res = Engine(slow, None, cfg(buffer_size=1, tau_add=None, max_nfe=3), EngineConfig(max_batch_rows=1)).generate([PROMPT])[0]
    assert (res.token_ids, res.nfe, res.finish_reason) == (SCRIPT[8:11], 3, "max_nfe")
    assert SingleBD(slow, cfg(buffer_size=1, tau_add=None, max_nfe=3), [EOS]).generate(PROMPT).token_ids == SCRIPT[8:11]
    res = Engine(model, None, cfg(max_length=12), EngineConfig(max_batch_rows=1)).generate([PROMPT])[0]  # model/engine length
    assert res.token_ids == SCRIPT[8:12] and res.finish_reason == "length"


def test_mask_token_never_emitted_by_engine():
    model = ScriptedModel(SCRIPT, conf=0.3, mask_logit=50.0)
    res = Engine(model, None, cfg(), EngineConfig(max_batch_rows=1)).generate([PROMPT])[0]
    assert MASK not in res.token_ids and len(res.token_ids) == 16


def test_abort_frees_the_slot():
    model = ScriptedModel(SCRIPT, conf=0.5)
    engine = Engine(model, None, cfg(), EngineConfig(max_batch_rows=1))
    a = engine.add_request(PROMPT)
    b = engine.add_request(PROMPT, {"max_new_tokens": 4})
    engine.step()
    engine.step()
    assert engine.num_free_rows() == 0 and list(engine.scheduler.running.values())[0].id == a
    assert engine.abort(a) and not engine.abort("nope")
    outs = {o.request_id: o for o in engine.step()}
    assert outs[a].finished and outs[a].finish_reason == "abort"
    assert engine.scheduler.running[0].id == b  # the freed slot went to the waiting request in the same step
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                assert (o.request_id, o.finish_reason, o.num_generated) == (b, "length", 4)
    assert engine.num_free_rows() == 1
    c = engine.add_request(PROMPT)
    assert engine.abort(c)  # a waiting request can be aborted too
    assert [o.finish_reason for o in engine.step()] == ["abort"] and not engine.has_unfinished()


def test_temperature_sampling_reproducible_with_seed():
    model = build_model(tiny_cfg("sdar"), seed=1).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(5)
    dc = DecodeConfig(buffer_size=2, tau_add=0.25, tau_m2t=0.3, max_new_tokens=24, max_length=128,
                      temperature=1.0, seed=7)
    run = lambda engine, **kw: engine.generate([PROMPT], {"seed": kw.get("seed", 7)})[0].token_ids
    engine = Engine(model, None, dc, EngineConfig(max_batch_rows=3))
    first = run(engine)
    assert run(engine) == first
    assert run(engine, seed=8) != first
    # the same seed gives the same tokens whatever else is in the batch
    rid = engine.add_request(PROMPT, {"seed": 7})
    engine.add_request(list(range(30, 41)), {"seed": 3})
    got = []
    while engine.has_unfinished():
        got += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    assert got == first
    greedy = Engine(model, None, dc.model_copy(update={"temperature": 0.0}), EngineConfig(max_batch_rows=1))
    assert run(greedy) == run(greedy, seed=8)


def char_tokenizer() -> Tokenizer:
    vocab = {chr(ord("a") + i % 26) + str(i // 26): i for i in range(V)}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="a0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.Fuse()
    return Tokenizer(tok, "sdar", MASK, EOS, EOS)


def test_stream_yields_committed_text_and_generate_decodes_strings():
    model = ScriptedModel(SCRIPT, conf=[0.99 if i % 3 else 0.5 for i in range(200)])
    engine = Engine(model, char_tokenizer(), cfg(max_new_tokens=14), EngineConfig(max_batch_rows=2))
    deltas = list(engine.stream(PROMPT))
    assert len(deltas) > 2
    res = engine.generate([PROMPT])[0]
    assert "".join(deltas) == res.text == engine.tokenizer.decode(SCRIPT[8:22])
    text = engine.generate(["b0 c0 d0"], chat=False)[0]
    assert text.num_generated == 14 and len(text.text) > 0


def test_bad_requests_fail_clearly():
    model = ScriptedModel(SCRIPT)
    engine = Engine(model, None, cfg(), EngineConfig(max_batch_rows=1))
    with pytest.raises(ValueError, match="buffer_size=3 exceeds the engine's compiled buffer_size=2"):
        engine.add_request(PROMPT, {"buffer_size": 3, "tau_add": 0.1})
    with pytest.raises(ValueError, match="block_size"):
        engine.add_request(PROMPT, {"block_size": 8})
    with pytest.raises(ValueError, match="max_length"):
        engine.add_request(list(range(1, 40)) * 6)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="mask token"):
        engine.add_request([1, MASK])
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate(["text"])
    with pytest.raises(Exception, match="block_size"):
        Engine(model, None, cfg(block_size=8))
    rid = engine.add_request(PROMPT, request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(PROMPT, request_id=rid)
