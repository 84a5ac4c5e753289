"""MultiBD decoding: the Block Buffer engine (static shapes, continuous batching, CUDA Graphs) and the
SingleBD / naive dynamic MultiBD references that share its decision policy."""

from mbd.config import EngineConfig
from mbd.decoding.engine import Engine
from mbd.decoding.naive import NaiveMultiBD, ReferenceResult
from mbd.decoding.outputs import EngineStats, GenerationResult, StepOutput
from mbd.decoding.policy import Policy
from mbd.decoding.single import SingleBD
from mbd.decoding.spec import build_engine
from mbd.decoding.state import SlotState
from mbd.decoding.validate import RequestError, validate_request

__all__ = ["Engine", "EngineConfig", "EngineStats", "GenerationResult", "NaiveMultiBD", "Policy", "ReferenceResult",
           "RequestError", "SingleBD", "SlotState", "StepOutput", "build_engine", "validate_request"]
