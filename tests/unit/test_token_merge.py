"""DMax's token merge (soft embeddings for just-filled tokens) against the authors' formula written out here, and
the engine feeding exactly those weights, step by step, on a real tiny model."""

import torch
from torch import nn

from mbd.config import DecodeConfig
from mbd.decoding import Engine, EngineConfig, SingleBD
from mbd.model import build_model
from mbd.model.base import merge_embeddings
from tests.conftest import tiny_cfg

MASK, EOS = 63, 62


def authors_soft_embedding(e_tok: torch.Tensor, e_mask: torch.Tensor, c: float) -> torch.Tensor:
    """Diffulex `dmax_topk`, top-1, renormalised: c e_tok + (1 - c) e_mask scaled to c |e_tok| + (1 - c) |e_mask|."""
    soft = c * e_tok + (1 - c) * e_mask
    return soft * (c * e_tok.norm() + (1 - c) * e_mask.norm()) / soft.norm()


def test_merge_embeddings_is_the_authors_formula():
    torch.manual_seed(0)
    emb = nn.Embedding(64, 16)
    ids = torch.tensor([[5, 9, MASK, 17, 5]])
    conf = torch.tensor([[0.3, 1.0, 0.7, 0.95, 1.0]])
    got = merge_embeddings(emb(ids), conf, emb, MASK)
    for j, (t, c) in enumerate(zip(ids[0].tolist(), conf[0].tolist())):
        want = emb.weight[t] if c == 1.0 else authors_soft_embedding(emb.weight[t], emb.weight[MASK], c)
        assert torch.allclose(got[0, j], want, atol=1e-6), j
    assert torch.equal(got[0, [1, 4]], emb(ids)[0, [1, 4]])  # confidence 1: the token itself, bit for bit


class Recorder(nn.Module):
    """The tiny model, recording each decode forward's positions, tokens, merge weights and logits."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.inner, self.cfg, self.calls = model, model.cfg, []

    def forward(self, input_ids, position_ids, attn, logits_at=None, token_conf=None):
        out = self.inner(input_ids, position_ids, attn, logits_at=logits_at, token_conf=token_conf)
        if logits_at is not None and token_conf is not None:  # a decode forward (prefill has no logits)
            self.calls.append((position_ids[0].tolist(), input_ids[0].tolist(), token_conf[0].tolist(), out[0]))
        return out


def test_dmax_engine_feeds_each_just_filled_token_with_its_confidence():
    """Reference: the authors' rule, written out: at forward s + 1 a position enters with weight c when forward
    s filled it (mask before, token after) with top-1 probability c (mask token excluded), and with weight 1
    otherwise (older or revised tokens, masks, prompt tokens)."""
    cfg = DecodeConfig(buffer_size=1, max_length=128, max_new_tokens=24, max_nfe=60, tau_m2t=0.05, tau_t2t=0.0,
                       strategy="dmax")
    rec = Recorder(build_model(tiny_cfg(), seed=3).eval())
    prompt = list(range(10, 17))
    res = Engine(rec, None, cfg, EngineConfig(max_batch_rows=1)).generate([prompt])[0]
    soft = 0
    for (pos0, ids0, _, logits0), (pos1, ids1, conf1, _) in zip(rec.calls, rec.calls[1:]):
        p = logits0.float().clone()
        p[:, MASK] = float("-inf")
        top = p.softmax(-1).max(-1).values.tolist()
        before = dict(zip(pos0, ids0))
        for j, (q, t) in enumerate(zip(pos1, ids1)):
            just_filled = before.get(q) == MASK and t != MASK
            want = top[pos0.index(q)] if just_filled else 1.0
            assert abs(conf1[j] - want) < 1e-5, (q, conf1[j], want)
            soft += just_filled
    assert soft >= 5  # the soft path ran
    ref = SingleBD(build_model(tiny_cfg(), seed=3).eval(), cfg, [EOS]).generate(prompt)
    assert (res.token_ids, res.nfe) == (ref.token_ids, ref.nfe)
