"""Conviction by evidence, with the engine host driven in-process against real engine processes: a poisonous
request (its prompt holds `POISON`: tests/integration/poison.py makes the engine process raise when a step runs
it, on its N-th forward) is found by trials and convicted only when it crashes the engine alone; every
innocent of its steps completes with exactly the tokens the engine gives it alone (streams resumed across the
restarts, not failed); trial crashes never make the replica give up; a replica that gives up answers a
retryable EngineDead, never a quarantine."""

import asyncio

import pytest

from actors.engine_host import EngineHost
from actors.messages import EngineDead, RequestQuarantined
from actors.supervision_policy import EngineRestarts
from mbd.config import DecodeConfig
from mbd.decoding import Engine, EngineConfig
from mbd.decoding.model_spec import ModelSpec
from mbd.model import load_checkpoint
from tests.integration.poison import INNOCENT, PAIR_ENV, POISON, POISON_ENV, SITE, STEP_ENV
from tests.integration.test_serve_units import DECODE, _collect, _Log, ckpt, tok  # noqa: F401 - fixtures

SHORT = DECODE.model_copy(update={"max_new_tokens": 16})  # about 10 steps: a crash on the 6th is mid-stream


@pytest.fixture
def poison(monkeypatch, tok):
    """Engine processes started from now on crash on the `nth` step a prompt holding POISON is in (`pair`: only
    beside another request)."""
    def arm(nth: int = 1, pair: bool = False) -> None:
        monkeypatch.setenv(POISON_ENV, ",".join(map(str, tok.encode(POISON))))
        monkeypatch.setenv(STEP_ENV, str(nth))
        monkeypatch.setenv(PAIR_ENV, "1" if pair else "0")
        monkeypatch.syspath_prepend(SITE)  # engine processes inherit this process's path
    return arm


def _host(ckpt, rows: int, restarts: EngineRestarts = EngineRestarts(backoff_s=0.1)) -> EngineHost:
    return EngineHost(ModelSpec(path=str(ckpt)), DECODE, EngineConfig(max_batch_rows=rows), restarts)


def _alone(ckpt, tok, prompts: list[str], params: DecodeConfig = SHORT) -> list[list[int]]:
    """The tokens the engine gives each prompt on its own."""
    model, _ = load_checkpoint(ckpt)
    ref = Engine(model, tok, DECODE, EngineConfig(max_batch_rows=1))
    return [ref.generate([tok.encode(p)], params)[0].token_ids for p in prompts]


def _run_together(host: EngineHost, tok, prompts: list[str]) -> list:
    """Every prompt at once (even ones stream, odd ones wait for the whole): each one's tokens, or its error."""
    async def one(i: int, p: str):
        try:
            return [t for o in await _collect(host, tok.encode(p), SHORT, per_block=i % 2 == 0)
                    for t in o.new_token_ids]
        except Exception as e:  # noqa: BLE001 - the test asserts who got what
            return e

    async def all_() -> list:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    return asyncio.run(all_())


@pytest.mark.parametrize("nth", [1, 6], ids=["crash-on-1st-step", "crash-on-6th-step"])
def test_one_culprit_among_eight_innocents(ckpt, tok, poison, nth):
    """1 poisonous + 8 innocent requests in one step (9 rows), the poison crashing on its 1st or its 6th step
    (after the innocents streamed tokens): the innocents complete with their own tokens, streams resumed
    across every restart; the poison alone is convicted, naming its trial; the replica never gives up (its
    default limit of 3 counted exits, while the trials crash more often than that) and stays healthy."""
    poison(nth)
    want = _alone(ckpt, tok, INNOCENT)
    host = _host(ckpt, rows=9)
    try:
        with _Log() as logged:
            got = _run_together(host, tok, INNOCENT[:4] + [f"1+{POISON}="] + INNOCENT[4:])
        culprit = got.pop(4)
        assert isinstance(culprit, RequestQuarantined) and "alone in its step" in str(culprit) \
            and "trial" in str(culprit)
        assert got == want
        s = host.stats()
        assert s["quarantined"] == 1 and 2 <= s["engine_restarts"] <= 6 and s["streams"] == 0
        if nth > 1:
            assert s["resumed"] >= 8  # every innocent had tokens when the first crash came
        assert host.engine_state() == "ok" and not any("giving up" in line for line in logged.lines)
        host.check()
    finally:
        host.shutdown()


@pytest.mark.slow  # the policy's unit test covers it in milliseconds (tests/unit/test_supervisor.py)
def test_two_culprits_are_both_convicted(ckpt, tok, poison):
    poison(1)
    want = _alone(ckpt, tok, INNOCENT[:4])
    host = _host(ckpt, rows=6)
    try:
        got = _run_together(host, tok, [f"{POISON}+1=", *INNOCENT[:2], f"2*{POISON}=", *INNOCENT[2:4]])
        assert isinstance(got[0], RequestQuarantined) and isinstance(got[3], RequestQuarantined)
        assert [got[i] for i in (1, 2, 4, 5)] == want
        assert host.stats()["quarantined"] == 2 and host.engine_state() == "ok"
    finally:
        host.shutdown()


@pytest.mark.slow  # the policy's unit test covers it in milliseconds (tests/unit/test_supervisor.py)
def test_a_request_that_crashes_only_beside_another_is_never_convicted(ckpt, tok, poison):
    """The poison crashes the engine only when it shares a step: the trials split it from the others; alone it
    runs clean, so nobody is convicted and everyone completes (an innocent is never answered 500)."""
    poison(1, pair=True)
    prompts = [INNOCENT[0], f"1+{POISON}=", INNOCENT[1], INNOCENT[2]]
    want = _alone(ckpt, tok, prompts)
    host = _host(ckpt, rows=4)
    try:
        assert _run_together(host, tok, prompts) == want
        s = host.stats()
        assert s["quarantined"] == 0 and s["engine_restarts"] >= 2 and host.engine_state() == "ok"
    finally:
        host.shutdown()


def test_an_outside_kill_quarantines_nobody_and_resumes_the_stream(ckpt, tok):
    """A streaming request is in the engine's step at two SIGKILLs from outside: no evidence, so nobody is
    suspected; the stream resumes each time and equals the uninterrupted run."""
    import os
    import signal

    long = DECODE.model_copy(update={"max_new_tokens": 96, "tau_m2t": 1.0, "ignore_eos": True})
    want = _alone(ckpt, tok, ["1+1="], long)[0]
    host = _host(ckpt, 2)

    async def in_a_new_engine(pid: int | None) -> int:
        while host.engine_state() != "ok" or host._proc.pid == pid or \
                (await asyncio.to_thread(host.stats)).get("in_engine") != 1:
            await asyncio.sleep(0.01)
        return host._proc.pid

    async def scenario() -> list:
        req = asyncio.create_task(_collect(host, tok.encode("1+1="), long))
        pid = None
        for _ in range(2):
            pid = await in_a_new_engine(pid)
            os.kill(pid, signal.SIGKILL)
        return await req

    try:
        with _Log() as logged:
            got = asyncio.run(scenario())
        assert [t for o in got for t in o.new_token_ids] == want
        s = host.stats()
        assert (s["engine_restarts"], s["quarantined"], s["trials"]) == (2, 0, 0)
        exits = [line for line in logged.lines if "exited (" in line]
        assert len(exits) == 2 and all("killed by SIGKILL" in e and "not by itself" in e for e in exits)
    finally:
        host.shutdown()


def test_a_replica_that_gives_up_answers_retryable_engine_dead(ckpt, tok, poison):
    """limit 0: the first counted exit is fatal. The poisonous request and the one beside it get EngineDead (the
    ingress answers 503 with Retry-After), never RequestQuarantined: giving up is no verdict on a request."""
    poison(1)
    host = _host(ckpt, 2, EngineRestarts(limit=0))
    try:
        got = _run_together(host, tok, [f"{POISON}=", "1+1="])
        assert all(isinstance(g, EngineDead) and "gave up" in str(g) for g in got)
        assert host.engine_state() == "failed" and host.stats()["quarantined"] == 0
    finally:
        host.shutdown()
