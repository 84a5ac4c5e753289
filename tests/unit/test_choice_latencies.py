"""TTFT and inter-token latency of a request with parallel choices (n > 1), on a fake clock: the first output's
time is each choice's own (not the time all first outputs were gathered), and each choice's gaps are its own (not
the request's span divided by every choice's tokens)."""

from types import SimpleNamespace

import pytest

from mbd.decoding.outputs import StepOutput
from serve_app.choices import latencies


def _choice(t_first: float, t_last: float, first_tokens: int, generated: int) -> SimpleNamespace:
    first = StepOutput("r", [1] * first_tokens, False, None, 1, first_tokens)
    last = StepOutput("r", [1], True, "length", 8, generated)
    return SimpleNamespace(t_first=t_first, t_last=t_last, first=first, last=last)


def test_each_choice_has_its_own_first_output_and_token_gaps():
    t0 = 100.0
    fast = _choice(t_first=100.2, t_last=101.2, first_tokens=4, generated=24)  # 20 more tokens over 1.0 s
    slow = _choice(t_first=100.9, t_last=104.9, first_tokens=4, generated=12)  # 8 more tokens over 4.0 s
    once = _choice(t_first=100.5, t_last=100.5, first_tokens=6, generated=6)  # everything at once: no gaps
    ttft, itl = latencies([slow, fast, once], t0)
    assert ttft == pytest.approx(0.2)
    assert itl == pytest.approx([4.0 / 8, 1.0 / 20])
