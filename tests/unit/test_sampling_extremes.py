"""Sampling cannot crash (issue #59 item 0): every setting the request schema admits gives a valid distribution,
and a position that has none fails its own request, never the engine step.

The schema admits temperature in (0, limits.max_temperature], top_p in (0, 1] and any top_k >= 0, with
floats down to denormals (5e-324 is the smallest, and rounds to 0 in float32)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mbd.config import DecodeConfig
from mbd.decoding import Engine, EngineConfig, Policy
from mbd.decoding.policy import Sampler
from mbd.model import build_model
from tests.conftest import tiny_cfg

V, MASK, B = 16, 15, 4
EXTREME_FLOATS = [5e-324, 1e-320, 1e-45, 1.4e-45, 1e-38, 1e-8, 0.5, 1.0 - 1e-16]
temperatures = st.sampled_from(EXTREME_FLOATS + [1.0, 2.0, 100.0, 1e38, 1e300])
top_ps = st.sampled_from(EXTREME_FLOATS + [1.0])
top_ks = st.sampled_from([0, 1, 2, V - 2, V - 1, V, 10**9])


def hostile_logits(kind: str, seed: int) -> torch.Tensor:
    """[Q=B, V] logits of one row; `kind` names the extreme (the mask column is set to -inf by `predict`)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, V, generator=g) * 30
    if kind == "ties":
        z[:] = 1.0
    elif kind == "huge":
        z = z * 1e37
    elif kind == "one_allowed":  # a grammar that allows a single token
        z[:, :] = float("-inf")
        z[:, 3] = 0.0
    elif kind == "banned_best":  # the best tokens excluded, the rest very unlikely
        z[:, :8] = float("-inf")
        z[:, 8:] = -1e30
    return z


@settings(max_examples=400, deadline=None)
@given(t=temperatures, p=top_ps, k=top_ks, kind=st.sampled_from(["normal", "ties", "huge", "one_allowed",
                                                                  "banned_best"]), seed=st.integers(0, 10**6))
def test_every_admitted_setting_samples_a_valid_token(t, p, k, kind, seed):
    logits = hostile_logits(kind, seed).unsqueeze(0)
    allowed = torch.isfinite(logits[0]) & (torch.arange(V) != MASK)
    s = Sampler(0, t, torch.Generator().manual_seed(seed), p, k)
    dist = s.probs(logits[0].masked_fill(torch.arange(V) == MASK, float("-inf")))
    assert torch.isfinite(dist).all() and (dist >= 0).all()
    assert torch.allclose(dist.sum(-1), torch.ones(B), atol=1e-5)
    assert (dist[~allowed] == 0).all()  # nothing outside what the logits allow, never the mask token
    conf, x0 = Policy(B, MASK).predict(logits.clone(), [s])
    assert allowed[torch.arange(B), x0[0]].all()
    assert ((conf > 0) & (conf <= 1)).all()


def test_a_denormal_temperature_is_greedy_and_a_denormal_top_p_keeps_the_best_token():
    z = hostile_logits("normal", 1)
    best = z.argmax(-1)
    for t, p in [(5e-324, 1.0), (2.0, 5e-324), (1e-45, 1e-45)]:
        dist = Sampler(0, t, torch.Generator().manual_seed(0), p).probs(z)
        assert torch.equal(dist.argmax(-1), best) and torch.equal(dist.max(-1).values, torch.ones(B))


def test_a_position_without_a_distribution_fails_its_row_only():
    """No finite logit (NaN from a broken forward, or every token banned) in one row's ACTIVE slot: that row is
    reported failed, the other row's decision is what it would be alone."""
    pol = Policy(B, MASK)
    good = torch.full((1, 2 * B, V), 0.0)
    good[0, :, 5] = 9.0
    bad = good.clone()
    bad[0, 1] = float("nan")
    bad[0, 2] = float("-inf")
    tokens = torch.full((2, 2 * B), MASK)
    state = torch.tensor([[1, 0], [1, 0]])  # slot 0 ACTIVE, slot 1 DUMMY
    args = (tokens, state, torch.full((2, 1, 1), 0.9), torch.tensor([[1], [1]]))
    both = pol.update(torch.cat([good, bad]), *args)
    alone = pol.update(torch.cat([good, good]), *args)
    assert both.failed[:, 0].tolist() == [False, True]
    assert torch.equal(both.tokens[0], alone.tokens[0]) and not alone.failed.any()
    # a sampling row whose sampler raises fails alone too
    broken = Sampler(1, 1.0, torch.Generator())
    broken.probs = lambda _: (_ for _ in ()).throw(RuntimeError("boom"))  # type: ignore[method-assign]
    assert pol.update(torch.cat([good, good]), *args, samplers=[broken]).failed[:, 0].tolist() == [False, True]


def test_engine_ends_only_the_request_whose_sampling_fails():
    """The engine step survives a request whose sampler raises: that request ends with finish_reason "error"
    and a reason, the one beside it produces exactly what it produces alone."""
    model = build_model(tiny_cfg("sdar"), seed=1).eval()
    dc = DecodeConfig(buffer_size=2, tau_add=0.25, tau_m2t=0.3, max_new_tokens=16, max_length=128)
    engine = Engine(model, None, dc, EngineConfig(max_batch_rows=2))
    prompt = list(range(3, 13))
    alone = engine.generate([prompt])[0].token_ids
    ok = engine.add_request(prompt)
    doomed = engine.add_request(list(range(20, 28)), {"temperature": 1.0, "seed": 3})
    real = Sampler.probs

    def probs(self, logits):
        if self.temperature == 1.0:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(self, logits)

    Sampler.probs = probs  # type: ignore[method-assign]
    try:
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
    finally:
        Sampler.probs = real  # type: ignore[method-assign]
    ends = {o.request_id: o for o in outs if o.finished}
    assert ends[doomed].finish_reason == "error" and "no valid distribution" in ends[doomed].error
    assert ends[ok].finish_reason in ("eos", "length") and ends[ok].error is None
    assert [t for o in outs if o.request_id == ok for t in o.new_token_ids] == alone


def test_served_extremes_decode_like_greedy_or_validly():
    """Through the engine: the fuzzer's request (temperature 2, top_p 5e-324) and a denormal temperature keep only
    the best token, with confidence 1 (the renormalised distribution), so they decode exactly as greedy decoding
    that accepts every prediction (tau_m2t 0); a huge temperature decodes valid tokens."""
    model = build_model(tiny_cfg("sdar"), seed=1).eval()
    dc = DecodeConfig(buffer_size=2, tau_add=0.25, tau_m2t=0.3, max_new_tokens=16, max_length=128)
    engine = Engine(model, None, dc, EngineConfig(max_batch_rows=3))
    prompt = list(range(3, 13))
    greedy = engine.generate([prompt], {"tau_m2t": 0.0})[0]
    for over in ({"temperature": 2.0, "top_p": 5e-324}, {"temperature": 5e-324}, {"temperature": 1e-45, "top_k": 1}):
        got = engine.generate([prompt], {**over, "seed": 1})[0]
        assert got.token_ids == greedy.token_ids and got.finish_reason == greedy.finish_reason, over
    hot = engine.generate([prompt], {"temperature": 1e300, "top_p": 1.0, "seed": 2})[0]
    assert hot.finish_reason in ("eos", "length") and all(0 <= t < model.cfg.vocab_size for t in hot.token_ids)
    assert not math.isnan(hot.tpf)
