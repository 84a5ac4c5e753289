"""A request resumed on a fresh engine from any emission's checkpoint goes on exactly as if it had never moved
(greedy): the tokens that follow, the finish reason, the NFE and the logprobs (issue #59: streams survive a
restart)."""

from __future__ import annotations

import pytest
import torch

from mbd.config import DecodeConfig
from mbd.decoding import Engine, EngineConfig
from mbd.decoding.resume import Resume
from mbd.model import build_model
from tests.conftest import tiny_cfg

PROMPTS = [list(range(3, 13)), list(range(20, 28))]  # a prompt tail of 2 tokens, and a block-aligned one


def engine(family: str, **kw) -> Engine:
    model = build_model(tiny_cfg(family), seed=3).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4)  # confident enough that several tokens commit per step
    dc = DecodeConfig(buffer_size=3, tau_add=0.25, tau_semi=0.5, tau_m2t=0.3, max_new_tokens=40, max_length=128,
                      **kw)
    return Engine(model, None, dc, EngineConfig(max_batch_rows=2))


def run(e: Engine, prompt: list[int], params: dict, resumed: Resume | None = None) -> list:
    rid = e.add_request(prompt, params, resumed=resumed)
    outs = []
    while e.has_unfinished():
        outs += [o for o in e.step() if o.request_id == rid]
    return outs


@pytest.mark.parametrize("family", ["sdar", "llada2_moe"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_resume_from_every_checkpoint_equals_the_uninterrupted_run(family, prompt):
    a = engine(family)
    params = {"logprobs": True}
    whole = run(a, prompt, params)
    tokens = [t for o in whole for t in o.new_token_ids]
    logprobs = [x for o in whole for x in o.new_logprobs]
    points = [i for i, o in enumerate(whole) if o.checkpoint is not None]
    assert len(points) >= 2 and all(whole[i].new_token_ids for i in points)
    for i in points:
        sent = [t for o in whole[: i + 1] for t in o.new_token_ids]
        b = engine(family)
        rest = run(b, prompt, params, Resume(sent, whole[i].checkpoint))
        assert sent + [t for o in rest for t in o.new_token_ids] == tokens
        assert [x for o in whole[: i + 1] for x in o.new_logprobs] + [x for o in rest for x in o.new_logprobs] \
            == pytest.approx(logprobs)
        assert rest[-1].finish_reason == whole[-1].finish_reason and rest[-1].nfe == whole[-1].nfe
        assert rest[-1].num_generated == len(tokens)


def test_a_checkpoint_that_does_not_fit_the_output_is_refused():
    a = engine("sdar")
    whole = run(a, PROMPTS[0], {})
    i = next(i for i, o in enumerate(whole) if o.checkpoint is not None)
    sent = [t for o in whole[: i + 1] for t in o.new_token_ids]
    with pytest.raises(ValueError, match="resume"):
        engine("sdar").add_request(PROMPTS[0], {}, resumed=Resume(sent[:-1], whole[i].checkpoint))
