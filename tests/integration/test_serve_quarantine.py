"""Quarantine by evidence, with the engine host driven in-process against the real engine: a poisonous request
(one whose prompt holds `POISON`: tests/integration/poison.py makes the engine process raise when a step runs
it) is failed only after its trial (beside none but cleared requests) kills the engine again; the
innocent requests of its step,
and those queued beside it, complete with the tokens the engine gives them alone; an outside SIGKILL quarantines
nobody; a replica that gives up fails a suspect with RequestQuarantined, never EngineDead (which the ingress
would answer with a 503 to retry)."""

import asyncio
import os
import signal

import pytest

from actors.engine_host import EngineHost
from actors.messages import EngineDead, RequestQuarantined
from actors.supervisor import EngineRestarts
from mbd.config import DecodeConfig
from mbd.decoding import Engine, EngineConfig
from mbd.decoding.model_spec import ModelSpec
from mbd.model import load_checkpoint
from tests.integration.poison import POISON_ENV, SITE
from tests.integration.test_serve_units import DECODE, _collect, _Log, ckpt, tok  # noqa: F401 - fixtures

POISON = "7777"
SHORT = DECODE.model_copy(update={"max_new_tokens": 24})
LONG = DECODE.model_copy(update={"max_new_tokens": 200, "tau_m2t": 1.0, "ignore_eos": True})  # runs many steps


@pytest.fixture
def poisoned(monkeypatch, tok) -> None:
    """Engine processes started from now on crash on a step that runs a prompt holding POISON."""
    monkeypatch.setenv(POISON_ENV, ",".join(map(str, tok.encode(POISON))))
    monkeypatch.syspath_prepend(SITE)  # engine processes inherit this process's path


def _host(ckpt, rows: int, restarts: EngineRestarts) -> EngineHost:
    return EngineHost(ModelSpec(path=str(ckpt)), DECODE, EngineConfig(max_batch_rows=rows), restarts)


def _alone(ckpt, tok, prompts: list[tuple[str, DecodeConfig]]) -> list[list[int]]:
    """The tokens the engine gives each prompt on its own."""
    model, _ = load_checkpoint(ckpt)
    ref = Engine(model, tok, DECODE, EngineConfig(max_batch_rows=2))
    return [ref.generate([tok.encode(p)], params)[0].token_ids for p, params in prompts]


def test_innocent_requests_beside_a_poisonous_one_complete_and_it_fails_after_its_trial(ckpt, tok, poisoned):
    """Two rows: the innocent B (a long run) and the poisonous P share the step that kills the engine (both
    suspects), C waits for a row (not in the step). B is tried first and cleared by its first step; P's trial
    beside it kills the engine again: P is failed with RequestQuarantined, B stays innocent (kept, tried and
    cleared again) and completes; C, held meanwhile, completes beside it; the host stays healthy."""
    want_b, want_c = _alone(ckpt, tok, [("12+7=", LONG), ("3*4=", SHORT)])
    host = _host(ckpt, 2, EngineRestarts(limit=3, backoff_s=0.1))

    async def scenario() -> tuple:
        b = asyncio.create_task(_collect(host, tok.encode("12+7="), LONG, per_block=False))
        p = asyncio.create_task(_collect(host, tok.encode(f"1+{POISON}="), SHORT, per_block=False))
        c = asyncio.create_task(_collect(host, tok.encode("3*4="), SHORT))
        return await asyncio.gather(b, p, c, return_exceptions=True)

    try:
        with _Log() as logged:
            got_b, got_p, got_c = asyncio.run(scenario())
        assert isinstance(got_p, RequestQuarantined) and "on this request's trial" in str(got_p)
        assert [t for o in got_b for t in o.new_token_ids] == want_b
        assert [t for o in got_c for t in o.new_token_ids] == want_c
        s = host.stats()
        # readmitted: B's trial, P's, B's again, then C
        assert (s["engine_restarts"], s["quarantined"], s["lost_mid_stream"], s["kept"], s["readmitted"]) == \
            (2, 1, 0, 5, 4)
        exits = [line for line in logged.lines if "exited (" in line]
        assert len(exits) == 2 and all("exit code 1; RuntimeError" in e and "by itself in a step" in e for e in exits)
        assert "0 request(s) quarantined, 2 suspect(s) to try, 3 request(s) kept" in exits[0]
        assert "1 request(s) quarantined, 0 suspect(s) to try, 2 request(s) kept" in exits[1]
        host.check()
        assert host.engine_state() == "ok"
    finally:
        host.shutdown()


def test_an_outside_kill_quarantines_nobody(ckpt, tok):
    """A request that sent nothing is in the engine's step at two SIGKILLs from outside: kept both times, it
    completes with the engine's own tokens; nobody is quarantined."""
    model, _ = load_checkpoint(ckpt)
    want = Engine(model, tok, DECODE, EngineConfig(max_batch_rows=2)).generate([tok.encode("1+1=")], LONG)[0]
    host = _host(ckpt, 2, EngineRestarts(limit=3, backoff_s=0.1))

    async def in_a_new_engine(pid: int | None) -> int:
        while host.engine_state() != "ok" or host._proc.pid == pid or \
                (await asyncio.to_thread(host.stats)).get("in_engine") != 1:
            await asyncio.sleep(0.01)
        return host._proc.pid

    async def scenario() -> list:
        req = asyncio.create_task(_collect(host, tok.encode("1+1="), LONG, per_block=False))
        pid = None
        for _ in range(2):
            pid = await in_a_new_engine(pid)
            os.kill(pid, signal.SIGKILL)
        return await req

    try:
        with _Log() as logged:
            got = asyncio.run(scenario())
        assert [t for o in got for t in o.new_token_ids] == want.token_ids
        s = host.stats()
        assert (s["engine_restarts"], s["kept"], s["quarantined"], s["lost_mid_stream"]) == (2, 2, 0, 0)
        exits = [line for line in logged.lines if "exited (" in line]
        assert len(exits) == 2 and all("killed by SIGKILL" in e and "not by itself" in e for e in exits)
    finally:
        host.shutdown()


def test_a_replica_that_gives_up_fails_its_suspect_as_quarantined(ckpt, tok, poisoned):
    """limit 0: the first exit is fatal. The poisonous request was in the step: RequestQuarantined (the ingress
    answers 500 and tries it nowhere else); the request that arrives afterwards gets EngineDead."""
    host = _host(ckpt, 2, EngineRestarts(limit=0))
    try:
        with pytest.raises(RequestQuarantined, match="gave up"):
            asyncio.run(_collect(host, tok.encode(f"{POISON}="), SHORT))
        assert host.engine_state() == "failed" and host.stats()["quarantined"] == 1
        with pytest.raises(EngineDead, match="gave up"):
            asyncio.run(_collect(host, tok.encode("1+1="), SHORT))
    finally:
        host.shutdown()
