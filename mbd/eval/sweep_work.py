"""A sweep's work: the units of problems still to decode (what the results store lacks), the queue that hands
them to decoders with as few engine rebuilds as possible, and decoding one unit on an engine.

Pure PyTorch/pydantic (no Ray), like `mbd.eval.sweep` whose configuration, cells and records it works from;
`pipelines/eval_sweep.py` fans the units out over decoder actors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mbd.config import ConfigError, DecodeConfig, EngineConfig
from mbd.eval.benchmarks import Problem, get_benchmark
from mbd.eval.prompts import Message, chat_messages
from mbd.eval.sweep import Cell, Decoded, DecodedUnit, ModelEntry, ResultStore, SweepConfig, cells
from mbd.hub import resolve_model

if TYPE_CHECKING:  # torch is imported only where decoding happens: scoring processes stay light
    from mbd.decoding.engine import Engine

# A unit of work holds this many batches: continuous batching refills a finished request's slot within a unit,
# while units stay small enough to balance across workers and to lose little on an interruption.
BATCHES_PER_UNIT = 4


# ------------------------------------------------------------------------------------------------ decoding


def decode_prompts(engine: Engine, prompts: Sequence[Sequence[Message]], params: DecodeConfig,
                   keep_trace: Sequence[bool] | None = None) -> DecodedUnit:
    """Decode chat conversations with continuous batching. A prompt that leaves no room to generate is reported
    with finish_reason 'prompt_too_long' (and scores as wrong) instead of failing the sweep. The engine's
    prefix-cache counters are read before and after, so the unit's lookups exclude earlier work."""
    if engine.tokenizer is None:
        raise ValueError("sweep prompts are chat text: the engine needs a tokenizer")
    ids = [engine.tokenizer.encode_chat(list(p)) for p in prompts]
    stats = engine.stats
    query0, hit0 = stats.prefix_query_tokens, stats.prefix_hit_tokens
    limit = min(params.max_length, engine.max_length)
    fits = [i for i, x in enumerate(ids) if len(x) < limit]
    results = iter(engine.generate([ids[i] for i in fits], params)) if fits else iter(())
    keep, fit = keep_trace or [False] * len(prompts), set(fits)
    out = []
    for i in range(len(prompts)):
        if i not in fit:
            out.append(Decoded(completion="", nfe=0, num_generated=0, tpf=0.0, wall_time_s=0.0, step_latency_ms=0.0,
                               finish_reason="prompt_too_long"))
            continue
        r = next(results)
        out.append(Decoded(completion=r.text, nfe=r.nfe, num_generated=r.num_generated, tpf=r.tpf,
                           wall_time_s=r.wall_time_s, step_latency_ms=r.step_latency_ms,
                           finish_reason=r.finish_reason, trace=r.trace if keep[i] else None))
    return DecodedUnit(decoded=out, prefix_query_tokens=stats.prefix_query_tokens - query0,
                       prefix_hit_tokens=stats.prefix_hit_tokens - hit0)


class EngineCache:
    """One model's weights and the engine of the last decoding configuration: a worker that goes through a
    (model, config) group's units loads the weights once per model and builds one engine per configuration."""

    def __init__(self, engine: EngineConfig):
        self.engine = engine
        self._model: tuple[tuple[str, str], Any] | None = None
        self._engine: tuple[tuple[str, str, str], Engine] | None = None

    def get(self, model: ModelEntry, params: DecodeConfig) -> Engine:
        from mbd.decoding.spec import build_engine, load_engine_model, model_dir

        engine = self.engine if model.dtype == "auto" else self.engine.model_copy(update={"dtype": model.dtype})
        path = model_dir(model.path)
        mkey = (str(path), engine.dtype)
        ekey = (*mkey, params.model_dump_json())
        if self._engine is not None and self._engine[0] == ekey:
            return self._engine[1]
        self._engine = None
        if self._model is None or self._model[0] != mkey:
            self._model = None  # free the previous weights before loading the next
            self._model = (mkey, load_engine_model(path, engine))
        engine = build_engine(path, params, engine, loaded=self._model[1])
        tok = self._model[1][1]
        # One short request before anything is timed: first-call costs (allocator, kernel selection, CUDA
        # Graph capture) would otherwise land in the first cell's TPS.
        engine.generate([tok.encode("1+1")], params.model_copy(update={"max_new_tokens": 8}))
        self._engine = (ekey, engine)
        return engine



@dataclass
class Unit:
    """Problems of one cell that one decoder call handles."""

    cell: Cell
    params: DecodeConfig
    problems: list[Problem]
    keep_trace: list[bool]
    exemplars: list[Problem]

    @property
    def key(self) -> tuple[str, str, str]:
        """Units with the same key run on the same engine."""
        return self.cell.model.name, self.cell.decode.name, self.params.model_dump_json()

    def prompts(self) -> list[list[Message]]:
        return [chat_messages(p, self.exemplars) for p in self.problems]


def check_models(models: Iterable[ModelEntry]) -> None:
    """Fail before any actor starts when a checkpoint directory is incomplete."""
    for m in models:
        d = resolve_model(m.path)
        missing = [f for f in ("config.json", "tokenizer.json") if not (d / f).is_file()]
        if missing:
            raise ConfigError(f"model '{m.name}': {d} lacks {', '.join(missing)}; point `path` at a HuggingFace-format "
                              "checkpoint (for the embedded tiny model run `mbd pretrain-tiny` first)")


def plan_units(cfg: SweepConfig, problems: Mapping[str, list[Problem]], store: ResultStore,
               exemplars: Mapping[str, list[Problem]]) -> tuple[list[Unit], int]:
    """The units still to decode (stored problem ids are skipped) and the number of problems skipped."""
    units, skipped, size = [], 0, cfg.engine.max_batch_rows * BATCHES_PER_UNIT
    for cell in cells(cfg):
        done = store.load(cell.model.name, cell.decode.name, cell.benchmark)
        todo = [(i, p) for i, p in enumerate(problems[cell.benchmark]) if p.problem_id not in done]
        skipped += len(problems[cell.benchmark]) - len(todo)
        params = cell.decode.params(get_benchmark(cell.bench.name).kind)
        for s in range(0, len(todo), size):
            chunk = todo[s: s + size]
            units.append(Unit(cell, params, [p for _, p in chunk], [i < cfg.trace_problems for i, _ in chunk],
                              exemplars[cell.benchmark]))
    return units, skipped


class WorkQueue:
    """Hands a free worker the next unit of the engine it already holds, else of the group with most problems left,
    so engines are rebuilt as rarely as possible while every worker stays busy."""

    def __init__(self, units: Iterable[Unit]):
        self._groups: dict[tuple[str, str, str], deque[Unit]] = {}
        for u in units:
            self._groups.setdefault(u.key, deque()).append(u)

    def __len__(self) -> int:
        return sum(map(len, self._groups.values()))

    def requeue(self, unit: Unit) -> None:
        """Put back a unit whose decoding was lost (its worker died): it is handed out next."""
        self._groups.setdefault(unit.key, deque()).appendleft(unit)

    def pop(self, prefer: tuple[str, str, str] | None = None) -> Unit | None:
        if not self._groups:
            return None
        key = prefer if prefer in self._groups else max(
            self._groups, key=lambda k: sum(len(u.problems) for u in self._groups[k]))
        group = self._groups[key]
        unit = group.popleft()
        if not group:
            del self._groups[key]
        return unit
