"""MultiBD decoding: the Block Buffer engine (static shapes, continuous batching, CUDA Graphs) and the
SingleBD / naive dynamic MultiBD references that share its decision policy.

The names below load on first use (PEP 562): importing a request type of this package (`validate`,
`outputs`, `constraint_spec`, `model_spec`) must not load torch and the engine, because the HTTP ingress reads
them (tests/unit/test_fresh_imports.py)."""

import importlib

_HOME = {"EngineConfig": "mbd.config", "Engine": "mbd.decoding.engine", "NaiveMultiBD": "mbd.decoding.naive",
         "ReferenceResult": "mbd.decoding.naive", "EngineStats": "mbd.decoding.outputs",
         "GenerationResult": "mbd.decoding.outputs", "StepOutput": "mbd.decoding.outputs",
         "Policy": "mbd.decoding.policy", "SingleBD": "mbd.decoding.single", "build_engine": "mbd.decoding.spec",
         "SlotState": "mbd.decoding.state", "RequestError": "mbd.decoding.validate",
         "validate_request": "mbd.decoding.validate"}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> object:
    if name not in _HOME:
        raise AttributeError(f"module 'mbd.decoding' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)
