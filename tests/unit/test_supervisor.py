"""The supervision policy of a decoder replica (actors/supervisor.py): which engine exits are evidence against the
requests of the step, when a suspect is failed, the restart back-off, and how the host tries suspects (one at a
time, until their first step)."""

import asyncio
import pickle
import queue
import signal
import threading

import pytest
import torch.distributed as dist

from actors.engine_host import EngineHost
from actors.engine_process import collective_failure
from actors.messages import Abort, Add, EngineDead, Failed, Refusal, Running, Stepped
from actors.streams import Counts, Next, Stream
from actors.supervisor import EngineRestarts, convicted, died_by_itself, exit_status, rank_lost
from actors.tp_worker import Lockstep
from mbd.config import DecodeConfig, EngineConfig
from mbd.decoding import Engine
from mbd.decoding.outputs import StepOutput
from mbd.decoding.validate import RequestError
from mbd.model import build_model
from serve_app.config import ServeConfig
from serve_app.convert import RequestConverter
from serve_app.protocol import CompletionRequest
from tests.conftest import tiny_cfg


@pytest.mark.parametrize("code, by_host, lost, want", [
    (70, False, False, True),  # an exception or os._exit: its own
    (-signal.SIGSEGV, False, False, True),  # a fault in a kernel or an extension
    (-signal.SIGABRT, False, False, True),
    (-signal.SIGKILL, False, False, False),  # an outside kill (or the OOM killer): no evidence
    (-signal.SIGTERM, False, False, False),
    (1, True, False, False),  # the host killed it (a broken connection, a lost rank seen by the health check)
    (1, False, True, False),  # a rank ended first: rank 0's collective failed
])
def test_died_by_itself(code, by_host, lost, want):
    assert died_by_itself(code, by_host, lost) is want


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
    """`max_tokens` followed by name from the HTTP body to the engine and back: the ingress's RequestConverter
    makes it `params.max_new_tokens` of an `Add`, which crosses the process boundary (pickled), and the engine
    process's Lockstep hands it to a real Engine; its outputs come back in a `Stepped` with 7 tokens and
    finish_reason "length"."""
    model = build_model(tiny_cfg(), seed=0).eval()
    decode = DecodeConfig(buffer_size=2, max_length=200, max_new_tokens=64, max_nfe=400, tau_add=0.25, tau_semi=0.5,
                          tau_m2t=0.3)
    engine = Engine(model, None, decode, EngineConfig(max_batch_rows=2))
    convert = RequestConverter(ServeConfig.model_validate({"model": {"path": "tiny", "name": "m"},
                                                           "decode": decode.model_dump()}), tok=None)
    convert.limits = engine.limits
    req = CompletionRequest.model_validate({"model": "m", "prompt": [5, 6, 7], "max_tokens": 7, "ignore_eos": True})
    add = Add("r1", req.prompt, convert.params(req, len(req.prompt)))
    crossed = pickle.loads(pickle.dumps(add))
    assert crossed == add and crossed.params.max_new_tokens == 7
    lock, outs = Lockstep(engine, 1, None), []
    assert lock.apply([crossed]) == []
    while engine.has_unfinished():
        outs += pickle.loads(pickle.dumps(Stepped(lock.step(), [], None))).outputs
    assert [o.finish_reason for o in outs if o.finished] == ["length"]
    assert sum(len(o.new_token_ids) for o in outs) == 7 and outs[-1].num_generated == 7
    assert lock.live == set()
    back = pickle.loads(pickle.dumps([Abort("r1"), Running(("r1",)), Refusal("r2", RequestError("max_tokens", "x"))]))
    assert back[:2] == [Abort("r1"), Running(("r1",))] and back[2].error.field == "max_tokens"


def test_a_lost_rank_is_read_from_rank_0s_own_report():
    """Rank 0's `Failed` decides: a failed collective (a rank ended first) is no evidence, any other exception is
    (however soon the followers' loops end after it); only without a `Failed` does an ended rank count."""
    never = lambda: pytest.fail("a Failed message decides alone")  # noqa: E731
    assert rank_lost(Failed("RuntimeError('[gloo] Connection closed by peer')", collective=True), never)
    assert not rank_lost(Failed("RuntimeError('poison')"), never)
    assert rank_lost(None, lambda: True) and not rank_lost(None, lambda: False)
    assert collective_failure(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed "
                                           "by peer [127.0.0.1]:29500"))
    assert collective_failure(dist.DistBackendError("NCCL communicator was aborted"))
    assert not collective_failure(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not collective_failure(MemoryError())


class _Conn:
    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg.request_id)


def _bare_host(suspected: list[str], waiting: list[str]) -> tuple[EngineHost, asyncio.AbstractEventLoop]:
    """A host past a restart, without engine process or threads: what `_send_waiting` and `_publish` decide."""
    host, loop = EngineHost.__new__(EngineHost), asyncio.new_event_loop()
    host._lock, host._outbox, host._conn, host._solo, host.state = threading.Lock(), queue.SimpleQueue(), _Conn(), \
        None, "restarting"
    host.counts = Counts()
    host._streams = {rid: Stream(loop, asyncio.Queue(), Add(rid, [1], DecodeConfig()), per_block=False,
                                 suspected=1.0 if rid in suspected else None) for rid in suspected + waiting}
    return host, loop


def _step(host: EngineHost, *rids: str) -> None:
    """One step's outputs (a token each) reach the host; it handles what they put in its outbox."""
    host._publish([StepOutput(rid, [5], False, None, 1, 1) for rid in rids])
    while not host._outbox.empty():
        assert isinstance(host._outbox.get(), Next)
        host._send_waiting()


def test_suspects_are_tried_one_at_a_time_until_their_first_step_then_the_queue_drains():
    host, loop = _bare_host(["b", "p"], ["c", "d"])
    try:
        assert host._send_waiting(restarted=True) == 1 and host._conn.sent == ["b"]
        assert host._send_waiting() == 0  # b is on trial: nothing else goes
        _step(host, "b")  # b survived its first step: cleared, p's trial begins beside it
        assert host._conn.sent == ["b", "p"] and host._streams["b"].suspected is None
        _step(host, "b")
        assert host._conn.sent == ["b", "p"]
        _step(host, "b", "p")  # p cleared: every waiting request goes, in order, and new ones go at once
        assert host._conn.sent == ["b", "p", "c", "d"] and host._solo is None and host.state == "ok"
        assert host.counts.readmitted == 4
    finally:
        loop.close()


def test_a_supervisor_that_fails_gives_up_and_the_health_check_says_so():
    """An unexpected exception in the supervisor thread fails the host (its requests get EngineDead) instead of
    leaving it "restarting" for ever; a supervisor thread that is gone fails the health check even so."""
    host, loop = _bare_host([], ["a"])
    host._workers, host._stopping, host.state = [], threading.Event(), "ok"
    host._reader = host._supervisor = threading.Thread(target=lambda: None)
    host._reader.start()
    host._reader.join()
    try:
        with pytest.raises(EngineDead, match="supervisor thread has stopped"):
            host.check()

        def broken(item):
            raise KeyError("a bug")

        host._handle = broken
        host._outbox.put(Next())
        host._supervise()  # returns: it gave up
        assert host.state == "failed" and host._streams == {}
        with pytest.raises(EngineDead, match="the engine supervisor failed: KeyError"):
            host.check()
    finally:
        loop.close()
