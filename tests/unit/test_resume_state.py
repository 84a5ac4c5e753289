"""Resume state stays in the replica: the engine process sends each emission's checkpoint to the replica's host,
which keeps it on the request's `Stream` (what a new engine process resumes it from) and hands its handler, and so
the ingress over Ray, the output without it."""

from __future__ import annotations

import asyncio

from actors.messages import Add
from actors.streams import Stream
from mbd.config import DecodeConfig
from mbd.decoding.outputs import StepOutput
from mbd.decoding.resume import Checkpoint
from mbd.decoding.validate import RequestParams

CKPT = Checkpoint(committed=8, tokens=[1, 2], n_res=1, n_tc=0, nfe=3, cached_tokens=0)


def stream(per_block: bool) -> Stream:
    add = Add("r", [5, 6, 7], RequestParams.resolve(DecodeConfig(), 3, 200))
    return Stream(asyncio.new_event_loop(), asyncio.Queue(), add, per_block)


def test_the_handed_over_output_carries_no_checkpoint_and_the_stream_keeps_it():
    for per_block in (True, False):
        s = stream(per_block)
        first = s.note(StepOutput("r", [9, 10], False, None, 3, 2, checkpoint=CKPT))
        assert s.checkpoint == CKPT and s.emitted == [9, 10] and s.last.checkpoint is None
        last = s.note(StepOutput("r", [11], True, "eos", 4, 3))
        handed = [o for o in (first, last) if o is not None]
        assert handed and all(o.checkpoint is None for o in handed)
        assert handed[-1].new_token_ids == ([11] if per_block else [9, 10, 11])
        s.loop.close()


def test_a_new_engine_process_resumes_from_the_kept_checkpoint():
    s = stream(True)
    s.note(StepOutput("r", [9, 10], False, None, 3, 2, checkpoint=CKPT))
    add = s.readmission()
    assert isinstance(add, Add) and add.resumed is not None
    assert add.resumed.checkpoint == CKPT and add.resumed.output == [9, 10]
    s.loop.close()
