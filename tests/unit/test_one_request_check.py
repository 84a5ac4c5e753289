"""A request is checked once, where it enters: the ingress (serve_app/convert.py) runs the HTTP rules and the engine's
rules (`mbd.decoding.validate`, once per prompt); the replica's engine admits the checked `RequestParams` without
checking again, and a restarted engine re-admits the same ones."""

import asyncio
import re
from pathlib import Path

import pytest

import mbd.decoding.engine as engine_module
import mbd.decoding.validate as validate_module
from actors.messages import Add
from actors.streams import Stream
from mbd.config import DecodeConfig, EngineConfig
from mbd.decoding import Engine
from mbd.decoding.outputs import StepOutput
from mbd.decoding.resume import Checkpoint
from mbd.model import build_model
from serve_app.config import ServeConfig
from serve_app.convert import RequestConverter
from serve_app.protocol import CompletionRequest
from tests.conftest import tiny_cfg

ROOT = Path(__file__).resolve().parents[2]
CHECKS = re.compile(r"\b(validate_request|validate_prompt|resolve_params|check_request|add_request|"
                    r"RequestParams\.resolve|DecodeConfig\.model_validate)\(")  # a call
DECODE = DecodeConfig(buffer_size=2, max_length=200, max_new_tokens=64, max_nfe=400, tau_add=0.25, tau_semi=0.5,
                      tau_m2t=0.3)


def test_the_service_checks_a_request_in_one_module():
    """In the service's layers (actors/, serve_app/) only the ingress's converter calls a request check."""
    users = {p.relative_to(ROOT).as_posix() for d in ("actors", "serve_app") for p in (ROOT / d).rglob("*.py")
             if CHECKS.search(p.read_text())}
    assert users == {"serve_app/convert.py"}


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(build_model(tiny_cfg(), seed=0).eval(), None, DECODE, EngineConfig(max_batch_rows=2))


def test_the_ingress_checks_each_prompt_once(engine, monkeypatch):
    calls = []
    real = validate_module.validate_prompt

    def counted(ids, *args, **kwargs):
        calls.append(list(ids))
        return real(ids, *args, **kwargs)

    monkeypatch.setattr(validate_module, "validate_prompt", counted)
    convert = RequestConverter(ServeConfig.model_validate({"model": {"path": "tiny", "name": "m"},
                                                           "decode": DECODE.model_dump()}), tok=None)
    convert.limits = engine.limits
    req = CompletionRequest.model_validate({"model": "m", "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 7})
    convert.check_fields(req)
    prompts, fields = convert.encode_prompts(req.prompt)
    params, _ = convert.engine_request(req, prompts, fields)
    assert calls == [[5, 6, 7], [8, 9]]
    assert [p.gen_end for p in params] == [3 + 7, 2 + 7]


def test_the_engine_admits_a_checked_request_without_checking_it_again(engine, monkeypatch):
    _, p = engine.check_request([5, 6, 7], {"max_new_tokens": 4})

    def refuse(*args, **kwargs):
        raise AssertionError("a checked request was checked again")

    monkeypatch.setattr(engine_module, "validate_request", refuse)
    req = engine.admit([5, 6, 7], p, "r1")
    while engine.has_unfinished():
        engine.step()
    assert req.finished and len(req.output) == 4


def test_a_restarted_engine_readmits_the_same_checked_request():
    _, p = validate_module.validate_request([5, 6, 7], {"max_new_tokens": 8}, DECODE,
                                            validate_module.EngineLimits(64, 63, 4, 2, "block_buffer", 200, 4, 100))
    s = Stream(asyncio.new_event_loop(), asyncio.Queue(), Add("r", [5, 6, 7], p))
    assert s.readmission() is s.add
    s.note(StepOutput("r", [9, 10], False, None, 3, 2, checkpoint=Checkpoint(8, [1, 2], 1, 0, 3, 0)))
    again = s.readmission()
    assert again.params is p and again.resumed is not None
    s.loop.close()
