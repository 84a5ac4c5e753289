"""MultiBD decoding: the Block Buffer engine (static shapes, continuous batching, CUDA Graphs) and the
SingleBD / naive dynamic MultiBD references that share its decision policy."""

from mbd.decoding.engine import Engine, EngineStats, GenerationResult, StepOutput
from mbd.decoding.naive import NaiveMultiBD, ReferenceResult
from mbd.decoding.policy import Policy
from mbd.decoding.single import SingleBD
from mbd.decoding.spec import EngineSpec, build_engine
from mbd.decoding.state import SlotState

__all__ = ["Engine", "EngineSpec", "EngineStats", "GenerationResult", "NaiveMultiBD", "Policy", "ReferenceResult",
           "SingleBD", "SlotState", "StepOutput", "build_engine"]
