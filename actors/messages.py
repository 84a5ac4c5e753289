"""What crosses a decoder replica's process boundaries, by name: the ops the replica (the engine host) sends its
engine process and that rank 0 broadcasts to the other tensor-parallel ranks, what the engine process answers,
and the errors a request can end with at the ingress.

A request can be followed by reading: the ingress turns the HTTP body into prompt ids, a `DecodeConfig`
(`max_tokens` -> `params.max_new_tokens`) and a `ConstraintSpec`, checks them once against the limits the replica
reports, keeping the checked `RequestParams` (serve_app/convert.py), and calls the replica's `generate`; the host
sends `Add` to the engine process (actors/engine_process.py), whose `Lockstep` (actors/tp_worker.py) hands it to
`Engine.admit`, which checks nothing again; each step comes back as `Stepped` with one
`StepOutput` per request (`finish_reason` "length" once `max_new_tokens` are generated), which the host hands
to the request's handler. Imports nothing heavy (no torch): the ingress reads these names too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from mbd.config import DecodeConfig, EngineConfig
    from mbd.decoding.constraint_spec import ConstraintSpec
    from mbd.decoding.outputs import StepOutput
    from mbd.decoding.resume import Resume
    from mbd.decoding.model_spec import ModelSpec
    from mbd.decoding.validate import EngineLimits, RequestError, RequestParams


FD_ENV = "MBD_ENGINE_FD"  # the engine process's end of its socket pair, a file descriptor it inherits


class EngineDead(RuntimeError):
    """The engine process is gone for this request: it exited mid-stream, or the replica gave up restarting it
    (then check_health fails and Serve replaces the replica)."""


class RequestQuarantined(RuntimeError):
    """The request was in the engine's step each time the engine died by itself, the last time on its trial: it
    is not run again, here or on another replica (it would take that engine down as well)."""

    @classmethod
    def convicted(cls, exit_status: str) -> RequestQuarantined:
        return cls(f"the engine process died by itself ({exit_status}) with this request alone in its step, on this "
                   "request's trial after it had been in a step that died; it is not run again")


class RequestFailed(RuntimeError):
    """The engine ended this request alone (finish_reason "error", e.g. no valid distribution to sample from):
    the step and every other request went on. Not retried: the same request would fail the same way."""


# ---- replica -> engine process (and rank 0 -> ranks 1..) ----


@dataclass(frozen=True, slots=True)
class Start:
    """The engine process's arguments, its first message: what to build and where its TP ranks meet."""

    spec: ModelSpec
    decode: DecodeConfig
    engine: EngineConfig
    addr: str
    port: int


@dataclass(frozen=True, slots=True)
class Add:
    """Admit a checked request (`Engine.admit`: the ingress checked it against this replica's limits); sent again,
    as it is, to a new engine process after a restart, then with `resumed` once its client has tokens (the new
    engine goes on from them: `mbd.decoding.resume`)."""

    request_id: str
    prompt_ids: list[int]
    params: RequestParams
    constraint: ConstraintSpec | None = None
    resumed: Resume | None = None


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class Stop:
    """End the loop (every rank)."""


@dataclass(frozen=True, slots=True)
class AskStats:
    """Answer `StatsReply` with the same `ask` after the next step (or at once when idle)."""

    ask: int


LockstepOp = Union[Add, Abort, Stop]  # what rank 0 broadcasts to every rank before a step
ToEngine = Union[Add, Abort, Stop, AskStats]


# ---- engine process -> replica ----


@dataclass(frozen=True, slots=True)
class Ready:
    """The engine is built: what it can serve (the ingress checks requests against it)."""

    limits: EngineLimits


@dataclass(frozen=True, slots=True)
class Running:
    """The requests the next step may run (those in batch rows and those it may admit), sent before the step
    whenever they change: the evidence that says which requests were in the step when the engine died."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Refusal:
    """An `Add` the engine's request check refused, with the error naming the field."""

    request_id: str
    error: RequestError


@dataclass(frozen=True, slots=True)
class Stepped:
    """What one step has to say: each request's output, the refused admissions, and the engine's stats
    (`engine_process.engine_stats`; at most every `ON_STEP_S`, else None)."""

    outputs: list[StepOutput]
    refused: list[Refusal]
    stats: dict[str, float] | None


@dataclass(frozen=True, slots=True)
class StatsReply:
    ask: int
    stats: dict[str, float]


@dataclass(frozen=True, slots=True)
class Failed:
    """The engine process raised and is exiting (its last message). collective: the exception is a failed
    torch.distributed collective (a tensor-parallel rank ended first), so the step is not to blame."""

    message: str
    collective: bool = False


FromEngine = Union[Ready, Running, Stepped, StatsReply, Failed]
