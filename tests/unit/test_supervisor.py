"""The supervision policy of a decoder replica (actors/supervisor.py), as pure functions: which engine exits are
evidence against the requests of the step, when a suspect is failed, and the restart back-off."""

import pickle
import signal

import pytest

from actors.messages import Abort, Add, Refusal, Running, Stepped
from actors.supervisor import EngineRestarts, convicted, died_by_itself, exit_status
from mbd.config import DecodeConfig
from mbd.decoding.outputs import StepOutput
from mbd.decoding.validate import RequestError


@pytest.mark.parametrize("code, by_host, rank_lost, want", [
    (70, False, False, True),  # an exception or os._exit: its own
    (-signal.SIGSEGV, False, False, True),  # a fault in a kernel or an extension
    (-signal.SIGABRT, False, False, True),
    (-signal.SIGKILL, False, False, False),  # an outside kill (or the OOM killer): no evidence
    (-signal.SIGTERM, False, False, False),
    (1, True, False, False),  # the host killed it (a broken connection, a lost rank seen by the health check)
    (1, False, True, False),  # a rank ended first: rank 0's collective failed
])
def test_died_by_itself(code, by_host, rank_lost, want):
    assert died_by_itself(code, by_host, rank_lost) is want


def test_a_suspect_is_convicted_only_alone_and_within_the_window():
    assert convicted(alone=True, suspected_at=100.0, now=130.0, window_s=60.0)
    assert not convicted(alone=False, suspected_at=100.0, now=130.0, window_s=60.0)  # not alone: bisect further
    assert not convicted(alone=True, suspected_at=None, now=130.0, window_s=60.0)  # first crash: re-run it alone
    assert not convicted(alone=True, suspected_at=100.0, now=160.5, window_s=60.0)  # suspicion expired


def test_restart_backoff_and_exit_status():
    r = EngineRestarts(backoff_s=0.5)
    assert [r.delay(k) for k in (1, 2, 3, 4)] == [0.0, 0.5, 1.0, 2.0]
    assert (exit_status(-9), exit_status(70), exit_status(None)) == ("killed by SIGKILL", "exit code 70",
                                                                      "still running")


def test_messages_cross_a_process_by_name():
    """`max_tokens` becomes `Add.params.max_new_tokens` and comes back as a finish_reason "length" output;
    every message survives pickling (the engine process's connection) with its fields."""
    add = Add("r1", [1, 2, 3], DecodeConfig(max_new_tokens=7))
    out = StepOutput("r1", [5] * 7, True, "length", 3, 7)
    msgs = [add, Abort("r1"), Running(("r1",)), Stepped([out], [Refusal("r2", RequestError("max_tokens", "x"))], None)]
    back = pickle.loads(pickle.dumps(msgs))
    assert back[0].params.max_new_tokens == 7 and back[0] == add and back[1:3] == msgs[1:3]
    assert back[3].outputs == [out] and back[3].refused[0].error.field == "max_tokens"
