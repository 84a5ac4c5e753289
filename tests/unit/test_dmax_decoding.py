"""DMax's native SingleBD decoding (`strategy: dmax`) against rules written out in the test, the
engine against the SingleBD reference under those rules, and the DMax / LLaDA2.1 rows' T2T settings."""

from pathlib import Path

import pytest
import torch

from mbd.config import DecodeConfig, load_decode
from mbd.decoding import Engine, EngineConfig, SingleBD
from mbd.decoding.policy import ACTIVE, DMaxPolicy, Kept
from tests.unit.test_decoding_policy import EOS, MASK, PROMPT, SCRIPT, ScriptedModel, cfg, logits_for, params

B = 4
DECODE = Path(__file__).resolve().parents[2] / "configs" / "decode"


def dmax_reference(tokens: list[int], preds: list[int], confs: list[float], tau: float, fixed: int = 0):
    """DMax's step on one block, written out: fill the masked positions in order while confidence >= tau
    (at least the first one), set every other filled non-prompt position to its prediction; all-confident
    when every masked position had confidence >= 0.9."""
    out, masked = list(tokens), [i for i, t in enumerate(tokens) if t == MASK]
    for n, i in enumerate(masked):
        if confs[i] < tau and n > 0:
            break
        out[i] = preds[i]
        if confs[i] < tau:
            break
    for i, t in enumerate(tokens):
        if t != MASK and i >= fixed:
            out[i] = preds[i]
    return out, all(confs[i] >= 0.9 for i in masked)


@pytest.mark.parametrize("tokens, confs, fixed", [
    ([MASK] * 4, [0.9, 0.8, 0.3, 0.95], 0),  # leading run stops at the first low one; the last is not taken
    ([MASK] * 4, [0.3, 0.99, 0.99, 0.99], 0),  # first masked position low: it alone is filled
    ([7, MASK, 7, MASK], [0.99, 0.5, 0.99, 0.92], 1),  # prompt token kept, filled token revised, >= tau accepts
    ([MASK] * 4, [0.95, 0.91, 0.99, 0.9], 0),  # all confident: final in this same step
])
def test_dmax_step_matches_the_written_rules(tokens, confs, fixed):
    pol = DMaxPolicy(B, MASK)
    preds = [1, 2, 3, 4]
    want, confident = dmax_reference(tokens, preds, confs, 0.5, fixed)
    fixed_t = torch.tensor([[i < fixed for i in range(B)]])
    d = pol.update(logits_for(preds, confs), torch.tensor([tokens]), torch.tensor([[ACTIVE]]),
                   torch.tensor([[[0.5]]]), torch.tensor([[-1]]), fixed_t, torch.tensor([[0.0]]))
    assert d.tokens.tolist() == [want]
    filled, kept = pol.counts(d.masked_in[0].tolist(), d.accepted[0].tolist(), d.revised[0].tolist(),
                              d.confident[0].tolist())
    changed = sum(a != b for a, b in zip(tokens, want) if a != MASK)
    prefilled = sum(t != MASK for t in tokens)
    assert filled == [sum(t != MASK for t in want)] and kept == [Kept(prefilled - changed, prefilled, confident)]
    p = params(buffer_size=1, tau_add=None, tau_t2t=0.0, strategy="dmax")
    assert pol.final_count(p, 0, 1, filled, kept) == int(MASK not in want and (confident or want == tokens))


def test_dmax_commits_confident_blocks_without_a_verification_forward():
    """A confident model: DMax commits each block in the step that fills it (decode + store = 2 forwards per
    block, 2K for K blocks); the Block Buffer rules with T2T need a forward that changes nothing first (3K)."""
    c_dmax = cfg(buffer_size=1, tau_add=None, tau_t2t=0.0, strategy="dmax")
    c_bb = cfg(buffer_size=1, tau_add=None, tau_t2t=0.0)
    res = Engine(ScriptedModel(SCRIPT), None, c_dmax, EngineConfig(max_batch_rows=1)).generate([PROMPT])[0]
    ref = SingleBD(ScriptedModel(SCRIPT), c_dmax, [EOS]).generate(PROMPT)
    bb = Engine(ScriptedModel(SCRIPT), None, c_bb, EngineConfig(max_batch_rows=1)).generate([PROMPT])[0]
    assert res.token_ids == ref.token_ids == bb.token_ids == SCRIPT[8:24]
    assert res.nfe == ref.nfe == 2 * 4 and bb.nfe == 3 * 4


def test_dmax_engine_equals_reference_with_low_confidences():
    confs = [0.99 if i % 5 else 0.3 for i in range(200)]
    c = cfg(buffer_size=1, tau_add=None, tau_t2t=0.0, tau_m2t=0.6, strategy="dmax", max_new_tokens=24)
    res = Engine(ScriptedModel(SCRIPT, confs), None, c, EngineConfig(max_batch_rows=2)).generate([PROMPT, PROMPT[:6]])
    for r, prompt in zip(res, [PROMPT, PROMPT[:6]]):
        ref = SingleBD(ScriptedModel(SCRIPT, confs), c, [EOS]).generate(prompt)
        assert (r.token_ids, r.nfe) == (ref.token_ids, ref.nfe)


def test_dmax_strategy_needs_single_block_and_t2t():
    with pytest.raises(ValueError, match="strategy dmax"):
        DecodeConfig(buffer_size=2, tau_add=0.1, tau_t2t=0.0, strategy="dmax")
    with pytest.raises(ValueError, match="strategy dmax"):
        DecodeConfig(strategy="dmax")
    eng = Engine(ScriptedModel(SCRIPT), None, cfg(buffer_size=1, tau_add=None), EngineConfig(max_batch_rows=1))
    with pytest.raises(ValueError, match="strategy"):
        eng.add_request(PROMPT, {"strategy": "dmax", "tau_t2t": 0.0})


@pytest.mark.parametrize("task", ["math", "code"])
def test_dmax_and_llada21_rows_decode_with_t2t_as_the_authors(task):
    """The authors run DMax MultiBD / MBD in edit mode (T2T, threshold 0) and DMax SingleBD with
    DMax's own decoder; LLaDA2.1 rows revise at tau_T2T 0.5."""
    load = lambda name: load_decode(DECODE / f"{name}_{task}.yaml")[0]
    native = load("llada2-mini-dmax_singlebd")
    assert (native.strategy, native.tau_t2t, native.buffer_size) == ("dmax", 0.0, 1)
    for row in ("llada2-mini-dmax_multibd-tf", "llada2-mini-dmax_mbd"):
        c = load(row)
        assert (c.strategy, c.tau_t2t, c.buffer_size, c.tau_stable) == ("block_buffer", 0.0, 2, 0.5)
    for row in ("llada2.1-mini_singlebd", "llada2.1-mini_multibd-tf"):
        assert load(row).tau_t2t == 0.5
