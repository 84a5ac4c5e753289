"""A request whose decoder replica is gone is started again in one place (`OpenAIIngress._run`): at most
decoder.replica_retries + 1 starts per choice, whether the replica died before the first block or mid-way through
a whole (non-streaming) response. A fake decoder handle counts the starts; no Ray cluster is needed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError

from actors.trace import Trace
from mbd.config import DecodeConfig
from mbd.decoding.validate import RequestParams
from mbd.decoding.outputs import StepOutput
from serve_app.ingress import OpenAIIngress
from serve_app.protocol import APIError, CompletionRequest

RETRIES = 2


class DeadReplicaStream:
    """A decoder stream whose replica dies after `alive` outputs (each a non-final block of no tokens)."""

    def __init__(self, rid: str, alive: int):
        self.rid, self.alive, self.cancelled = rid, alive, False

    def __aiter__(self) -> DeadReplicaStream:
        return self

    async def __anext__(self) -> StepOutput:
        if self.alive <= 0:
            raise RayActorError()
        self.alive -= 1
        return StepOutput(self.rid, [], False, None, 1, 0)

    def cancel(self) -> None:
        self.cancelled = True


class CountingDecoder:
    """Stands for the decoder handle: `generate.remote` starts a stream whose replica dies."""

    def __init__(self, alive: int):
        self.starts: list[str] = []
        self.alive = alive
        self.generate = SimpleNamespace(remote=self._remote)

    def _remote(self, *, rid: str, **_: object) -> DeadReplicaStream:
        self.starts.append(rid)
        return DeadReplicaStream(rid, self.alive)


def ingress(decoder: CountingDecoder) -> OpenAIIngress:
    """An ingress with only what `_run` uses (no tokenizer: the fake streams carry no tokens)."""
    # the class as written, without Serve's ASGI wrapper (whose __del__ is a coroutine)
    cls = next(c for c in OpenAIIngress.func_or_class.__mro__ if c.__name__ == "OpenAIIngress")
    ing = object.__new__(cls)
    ing.decoder = decoder
    ing.cfg = SimpleNamespace(decoder=SimpleNamespace(replica_retries=RETRIES, retry_after_s=0.0))
    ing.tok = SimpleNamespace(decode=lambda ids: "")
    ing.trace = Trace("ingress")

    async def sync(cost: int, fn, *args):
        return fn(*args)

    ing.sync = sync
    return ing


@pytest.mark.parametrize("stream,alive", [(True, 0), (False, 0), (False, 1)],
                         ids=["stream-before-first", "whole-before-first", "whole-mid-way"])
def test_a_request_is_started_at_most_retries_plus_one_times(stream, alive, monkeypatch):
    monkeypatch.setattr("serve_app.ingress.TextStream", lambda tok, stops: SimpleNamespace(
        push=lambda ids: "", released_tokens=0, finish=lambda: "", returned_tokens=0, stopped=False, token_ids=[]))
    decoder = CountingDecoder(alive)
    req = CompletionRequest(model="m", prompt=[1, 2], stream=stream)
    with pytest.raises(APIError):
        checked = [RequestParams.resolve(DecodeConfig(), 2, 64)]
        asyncio.run(ingress(decoder)._run("r", req, [[1, 2]], checked, None, None))
    assert decoder.starts == ["r.0", "r~1.0", "r~2.0"]  # R + 1 starts, each under a fresh id
