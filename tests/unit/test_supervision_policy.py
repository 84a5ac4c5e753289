"""The supervision policy of a decoder replica (actors/supervision_policy.py): which engine exits are evidence against
the requests of the step, how trials find the request that crashes the engine (and never convict one that was not
alone in its step), what counts toward giving up, and the restart back-off."""

import asyncio
import pickle
import queue
import signal
import threading

import pytest
import torch.distributed as dist

from actors.engine_host import EngineHost
from actors.replica_supervisor import ReplicaSupervisor, State
from actors.engine_process import collective_failure
from actors.messages import Abort, Add, EngineDead, Failed, Refusal, Running, Stepped
from actors.streams import Counts, Stream, TrialOver
from actors.supervision_policy import EngineRestarts, ExitLog, Trials, died_by_itself, exit_status, rank_lost
from actors.tp_worker import Lockstep
from mbd.config import DecodeConfig, EngineConfig
from mbd.decoding import Engine
from mbd.decoding.outputs import StepOutput
from mbd.decoding.validate import RequestError, RequestParams
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


def test_an_engine_that_reported_its_own_exception_died_by_itself_however_it_ended():
    """It raised (its `Failed` says so) and was then killed by the host for exiting too slowly: still its doing."""
    assert died_by_itself(-signal.SIGKILL, killed_by_host=True, rank_lost=False, raised=True)
    assert not died_by_itself(1, killed_by_host=False, rank_lost=True, raised=True)


def try_until_done(step: list[str], crashes: callable) -> tuple[list[str], int]:
    """Drive `Trials` as the host does: the engine died with `step` in it; each trial group runs alone, and
    `crashes(group)` says whether its step kills the engine. Returns (convicted, crashes during trials)."""
    t, convicted, n = Trials(), [], 0
    t.suspect(step)
    while (group := t.start()) is not None:
        if crashes(group):
            n += 1
            if (who := t.crashed(sorted(group))) is not None:
                convicted.append(who)
        else:
            for rid in sorted(group):
                t.cleared(rid)
        assert n <= 4 * len(step), "the trials must end"
    return convicted, n


def test_trials_find_one_culprit_among_innocents_in_log_time():
    step = [f"i{k}" for k in range(4)] + ["p"] + [f"i{k}" for k in range(4, 8)]
    convicted, n = try_until_done(step, lambda g: "p" in g)
    assert convicted == ["p"] and n <= 4  # 9 suspects: halves 4/5, then 2/3, 1/2, 1: at most 4 trial crashes


def test_two_culprits_are_both_convicted_and_nobody_else():
    convicted, _ = try_until_done(["a", "p", "b", "c", "q", "d"], lambda g: bool({"p", "q"} & g))
    assert sorted(convicted) == ["p", "q"]


def test_a_request_that_crashes_only_beside_another_is_never_convicted():
    convicted, n = try_until_done(["a", "p", "b", "c"], lambda g: "p" in g and len(g) > 1)
    assert convicted == [] and n >= 1


def test_a_single_suspect_is_tried_alone_before_its_conviction():
    t = Trials()
    t.suspect(["p"])
    assert t.start() == {"p"} and t.crashed(["p"]) == "p" and t.start() is None


def test_trial_members_not_in_the_dying_step_are_tried_after_its_halves():
    t = Trials()
    t.queue.append(["a", "b", "c", "d"])
    t.start()
    assert t.crashed(["b", "c"]) is None  # a, d waited for a row: not in the step
    assert list(t.queue) == [["b"], ["c"], ["a", "d"]]


def test_exits_count_until_a_conviction_explains_them_once_the_engine_has_served():
    log = ExitLog(EngineRestarts(limit=1, window_s=60))
    assert log.add(100.0, {"p", "a"}) == 1 and not log.gives_up(100.0)
    log.explain("p", 101.0)  # nothing served yet: the engine may be what cannot run
    assert log.count(101.0) == 1
    log.served_at = 102.0
    log.explain("p", 103.0)
    assert log.count(103.0) == 0
    log.add(104.0), log.add(105.0)  # two failed starts
    assert log.gives_up(105.0) and not log.gives_up(170.0)  # older than the window: no longer counted


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
    add = Add("r1", req.prompt, convert.check_request(req.prompt, convert.params(req, 3), "prompt", req))
    crossed = pickle.loads(pickle.dumps(add))
    assert crossed == add and crossed.params.gen_end == 3 + 7
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


def _bare_host(waiting: list[str]) -> tuple[EngineHost, asyncio.AbstractEventLoop]:
    """A host whose supervisor has no engine process or threads (what its transitions decide)."""
    host, sup = EngineHost.__new__(EngineHost), ReplicaSupervisor.__new__(ReplicaSupervisor)
    loop = asyncio.new_event_loop()
    sup._lock, sup._inbox, sup.state, sup.error = threading.Lock(), queue.SimpleQueue(), State.SERVING, None
    sup.counts, sup.workers, sup.stopping = Counts(), [], threading.Event()
    params = RequestParams.resolve(DecodeConfig(), 1, 64)
    sup.streams = {rid: Stream(loop, asyncio.Queue(), Add(rid, [1], params), per_block=False) for rid in waiting}
    host.supervisor = sup
    return host, loop


def test_a_supervisor_that_fails_gives_up_and_the_health_check_says_so():
    """An unexpected exception in the supervisor thread fails the host (its requests get EngineDead) instead of
    leaving it "restarting" for ever; a supervisor thread that is gone fails the health check even so."""
    host, loop = _bare_host(["a"])
    sup = host.supervisor
    sup.thread = threading.Thread(target=lambda: None)
    sup.thread.start()
    sup.thread.join()
    try:
        with pytest.raises(EngineDead, match="supervisor thread has stopped"):
            host.check()

        def broken(item):
            raise KeyError("a bug")

        sup._handle = broken
        sup.post(TrialOver())
        sup._supervise()  # returns: it gave up
        assert sup.state == "failed" and sup.streams == {}
        with pytest.raises(EngineDead, match="the engine supervisor failed: KeyError"):
            host.check()
    finally:
        loop.close()


@pytest.mark.parametrize("emitted, reason", [(7, "length"), (4, "eos")])
def test_a_request_whose_output_ended_before_the_crash_finishes_on_the_host(emitted, reason):
    """No checkpoint after its last tokens (they ended its output: the length limit, or a stop token before it):
    re-admitted, it is not sent to the new engine but finished with the reason the engine would give."""
    decode = DecodeConfig(buffer_size=2, max_length=200, max_new_tokens=7, max_nfe=400, tau_add=0.25)
    add = Add("r1", [5, 6, 7], RequestParams.resolve(decode, 3, 200))
    s = Stream(asyncio.new_event_loop(), asyncio.Queue(), add)
    s.note(StepOutput("r1", list(range(emitted)), False, None, 3, emitted))
    end = s.readmission()
    assert isinstance(end, StepOutput) and end.finished and end.finish_reason == reason
    assert end.new_token_ids == [] and end.num_generated == emitted and end.nfe == 3
    assert isinstance(Stream(s.loop, s.queue, s.add).readmission(), Add)  # nothing emitted: the Add itself
    s.loop.close()
