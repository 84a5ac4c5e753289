"""Evaluation sweeps: models x decoding configurations x benchmarks, as resumable per-problem records.

Pure pydantic (no Ray, no torch): the configuration, its cells and the records store. `mbd.eval.sweep_work`
plans the units of work from them and decodes them; `pipelines/eval_sweep.py` fans the units out over decoder
actors and scores in a CPU pool. Every problem's record is appended to a JSONL file as soon as it is scored, so an
interrupted sweep resumes by skipping the problem ids already stored (a torn last line is dropped, not trusted).
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, Field, field_validator, model_validator

from mbd.config import ConfigError, DecodeConfig, EngineConfig, StrictModel, load_decode, resolve_path, validate
from mbd.eval.benchmarks import Kind, Problem, ScoreResult, get_benchmark, list_benchmarks

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.=+-]*$"  # names become directory names in the results store


# ------------------------------------------------------------------------------------------------ config


class ModelEntry(StrictModel):
    name: str = Field(pattern=NAME_PATTERN)
    path: str = Field(description="checkpoint directory: config.json, *.safetensors, tokenizer.json")
    section: str | None = Field(None, description="table section (paper: the base model an MBD-* model belongs "
                                                  "to); default: the model's name")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bfloat16 on CUDA, float32 on CPU")

    @property
    def table_section(self) -> str:
        return self.section or self.name


SweepKnob = Literal["tau_m2t", "tau_add", "tau_t2t", "tau_stable", "tau_semi"]


class DecodeEntry(StrictModel):
    """One decoding configuration: a DecodeConfig YAML (one, or one per benchmark kind) plus overrides.

    `sweep`: the threshold grid of the row's AUP curve (the paper gives each row its own AUP, which needs points
    that move TPF); every combination is decoded as an extra, hidden point `<name>+tau_m2t=0.9+...` of it."""

    name: str = Field(pattern=NAME_PATTERN)
    config: str | dict[Kind, str] = Field(description="configs/decode/*.yaml, or {math: ..., code: ...}")
    overrides: dict[str, Any] = {}
    sweep: dict[SweepKnob, list[float]] = Field(default={}, description="threshold grid of this row's AUP curve")
    curve: str | None = Field(None, description="AUP curve this configuration is a point of; default: its own "
                                                "curve per (model, configuration)")
    models: list[str] | None = Field(None, description="run only with these models (default: every model)")
    point_of: str | None = Field(None, description="set on sweep points: the row whose curve they extend")

    @field_validator("sweep")
    @classmethod
    def _grid(cls, v: dict[str, list[float]]) -> dict[str, list[float]]:
        for knob, values in v.items():
            if not values or any(not 0.0 <= x <= 1.0 for x in values):
                raise ValueError(f"sweep.{knob}: a non-empty list of thresholds in [0, 1], got {values}")
        return v

    def points(self) -> list["DecodeEntry"]:
        """This configuration, then one entry per combination of the sweep grid (same curve, hidden)."""
        out = [self]
        knobs = list(self.sweep)
        for combo in (itertools.product(*(self.sweep[k] for k in knobs)) if knobs else ()):
            extra = dict(zip(knobs, combo))
            name = self.name + "".join(f"+{k}={v:g}" for k, v in extra.items())
            out.append(self.model_copy(update={"name": name, "overrides": {**self.overrides, **extra}, "sweep": {},
                                               "point_of": self.name}))
        return out

    def params(self, kind: Kind) -> DecodeConfig:
        path = self.config if isinstance(self.config, str) else self.config.get(kind)
        if path is None:
            raise ConfigError(f"decoding '{self.name}': config has no '{kind}' entry but a {kind} benchmark is "
                              f"swept; add `{kind}: configs/decode/<file>.yaml`")
        base = load_decode(resolve_path(path))[0]  # the sweep's own `engine:` section runs it
        return validate(DecodeConfig, {**base.model_dump(), **self.overrides}, f"decoding '{self.name}' overrides")


class ProblemSplit(NamedTuple):
    """A benchmark entry's problems: those scored, and the few-shot exemplars shown before each (disjoint)."""

    scored: list[Problem]
    exemplars: list[Problem]


class BenchmarkEntry(StrictModel):
    """A benchmark of the sweep, zero-shot (the paper's rows) or k-shot.

    k-shot (`fewshot: k`): k exemplars drawn once with `fewshot_seed` from the benchmark's own problems (the
    data has no training split) go before every problem as prior chat turns, the same ones in the same order,
    and are left out of scoring; `limit` counts scored problems. The entry's `label` names its results and
    its report column, so a k-shot run never resumes from zero-shot records."""

    name: str
    limit: int | None = Field(None, ge=1, description="first `limit` scored problems (default: all)")
    fewshot: int = Field(0, ge=0, description="exemplars before every problem (lm-eval's num_fewshot); 0: zero-shot")
    fewshot_seed: int = Field(0, description="draws the exemplars")

    @property
    def label(self) -> str:
        if not self.fewshot:
            return self.name
        return f"{self.name}+{self.fewshot}shot" + (f"+seed{self.fewshot_seed}" if self.fewshot_seed else "")

    def load(self, data_dir: str | None) -> ProblemSplit:
        """The scored problems and the exemplars (none when zero-shot); never a scored problem as an exemplar."""
        bench = get_benchmark(self.name)
        if not self.fewshot:
            return ProblemSplit(bench.load(data_dir, self.limit), [])
        pool = bench.load(data_dir)
        if self.fewshot >= len(pool):
            raise ConfigError(f"benchmarks: {self.name} has {len(pool)} problems, too few for fewshot: {self.fewshot}")
        picked = random.Random(self.fewshot_seed).sample(range(len(pool)), self.fewshot)
        taken = set(picked)
        return ProblemSplit([p for i, p in enumerate(pool) if i not in taken][: self.limit], [pool[i] for i in picked])


class SweepConfig(StrictModel):
    """models x decoding configurations x benchmarks (`configs/eval/*.yaml`)."""

    name: str = "sweep"
    output_dir: str = Field(description="results/, traces/, records.parquet, report.md and plots/ go here")
    data_dir: str | None = Field(None, description="benchmark data (default: $MBD_DATA_DIR, then ../shared/data)")
    models: list[ModelEntry] = Field(min_length=1)
    decoding: list[DecodeEntry] = Field(min_length=1)
    benchmarks: list[BenchmarkEntry] = Field(min_length=1)
    engine: EngineConfig = Field(default_factory=EngineConfig, description=(
        "how every decoder actor's engine runs: max_batch_rows = requests decoded together (1 gives the paper's "
        "single-sample TPS); device auto = cuda when the cluster has GPUs; a model's dtype overrides its dtype"))
    trace_problems: int = Field(8, ge=0, description="problems per (model, config, benchmark) whose engine "
                                                     "traces are kept for the noise/activity panels; 0: none")
    workers: int | None = Field(None, ge=1, description="decoder actors (default: one per GPU, else 1)")
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs per decoder actor (its torch threads on CPU)")
    cpus_per_scorer: float = Field(1.0, gt=0, description="CPUs per scoring task (code runs in a sandbox)")
    scorers: int | None = Field(None, ge=1, description="scoring slots reserved beside the decoders (default: the "
                                                        "CPUs left free, at least one)")
    reserve_timeout_s: float = Field(120.0, gt=0, description="how long to wait for busy resources to free up for "
                                                              "the reservation (a cluster that can never hold it "
                                                              "fails at once)")

    @field_validator("benchmarks", mode="before")
    @classmethod
    def _bare_names(cls, v: Any) -> Any:
        return [{"name": b} if isinstance(b, str) else b for b in v] if isinstance(v, list) else v

    @model_validator(mode="after")
    def _check(self) -> "SweepConfig":
        for field, names in (("models", [m.name for m in self.models]), ("decoding", [d.name for d in self.decoding]),
                             ("benchmarks", [b.label for b in self.benchmarks])):
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"{field}: duplicate names {dup}; every entry needs its own name")
        known = {m.name for m in self.models}
        for d in self.decoding:
            unknown = sorted(set(d.models or []) - known)
            if unknown:
                raise ValueError(f"decoding '{d.name}': models {unknown} are not in `models` ({sorted(known)})")
        for b in self.benchmarks:
            if b.name not in list_benchmarks():
                raise ValueError(f"benchmarks: unknown benchmark '{b.name}'; registered: {list_benchmarks()}")
        unused = [m.name for m in self.models if not any(m.name in (d.models or [m.name]) for d in self.decoding)]
        if unused:
            raise ValueError(f"models {unused} have no decoding configuration (check `decoding[].models`)")
        points = [p.name for d in self.decoding for p in d.points()]
        dup = sorted({n for n in points if points.count(n) > 1})
        if dup:
            raise ValueError(f"decoding: sweep points {dup} collide with other configurations; rename them")
        for d in self.decoding:  # load every DecodeConfig now: a bad file fails before any decoding
            for kind in sorted({get_benchmark(b.name).kind for b in self.benchmarks}):
                for p in d.points():
                    p.params(kind)
        return self

    def pairs(self) -> list[tuple[ModelEntry, DecodeEntry]]:
        """The (model, configuration) cells of the sweep in table order, each row followed by its sweep points."""
        return [(m, p) for m in self.models for d in self.decoding if d.models is None or m.name in d.models
                for p in d.points()]


# ----------------------------------------------------------------------------------------------- records


class Decoded(BaseModel):
    """What the decoder returns for one prompt."""

    completion: str
    nfe: int
    num_generated: int
    tpf: float
    wall_time_s: float = Field(description="request latency: admission to finish, prefill included")
    step_latency_ms: float = Field(description="mean wall time of the decode steps the request took part in")
    finish_reason: str
    trace: list[dict] | None = None


TPF_COUNTING = 2  # ItemRecord.counting: 2 = the authors' (the last store forward counted, the stop token not)


class ItemRecord(BaseModel):
    """One problem of one (model, config, benchmark) cell: the completion, its verdict and its decoding cost."""

    model: str
    config: str
    benchmark: str
    problem_id: str
    completion: str
    correct: bool
    nfe: int
    num_generated: int
    tpf: float
    wall_time_s: float
    step_latency_ms: float
    finish_reason: str
    detail: str = ""
    counting: int = TPF_COUNTING  # 1: stored before the field existed; a resumed sweep decodes such records again


class DecodedUnit(BaseModel):
    """What the decoder returns for one unit: each prompt's result, and the engine's prefix-cache lookups over the
    unit (prompt tokens looked up, and those whose K/V came from cached pages)."""

    decoded: list[Decoded]
    prefix_query_tokens: int
    prefix_hit_tokens: int
    node: str | None = Field(None, description="the cluster node that decoded the unit")


class PrefixCacheRecord(BaseModel):
    """The prefix-cache lookups of one decoded unit of a cell, and the node that decoded it, stored beside the
    cell's records."""

    problem_ids: list[str]
    query_tokens: int
    hit_tokens: int
    node: str | None = None


def make_record(model: str, config: str, benchmark: str, problem: Problem, decoded: Decoded,
                score: ScoreResult) -> ItemRecord:
    """`benchmark`: the sweep entry's label (its results file), not necessarily `problem.benchmark`."""
    return ItemRecord(model=model, config=config, benchmark=benchmark, problem_id=problem.problem_id,
                      completion=decoded.completion, correct=score.correct, nfe=decoded.nfe,
                      num_generated=decoded.num_generated, tpf=decoded.tpf, wall_time_s=decoded.wall_time_s,
                      step_latency_ms=decoded.step_latency_ms, finish_reason=decoded.finish_reason,
                      detail=score.detail)


def score_completion(benchmark: str, problem: Problem, completion: str) -> ScoreResult:
    """Score in any process: importing this module registers every built-in benchmark, tinymath included."""
    return get_benchmark(benchmark).score(problem, completion)


class ResultStore:
    """results/<model>/<config>/<benchmark>.jsonl (one ItemRecord per line, appended per problem),
    traces/<model>/<config>/<benchmark>.jsonl ({problem_id, trace} per line) and
    prefix_cache/<model>/<config>/<benchmark>.jsonl (one PrefixCacheRecord per decoded unit) under `root`."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, model: str, config: str, benchmark: str, kind: str = "results") -> Path:
        return self.root / kind / model / config / f"{benchmark}.jsonl"

    def load(self, model: str, config: str, benchmark: str) -> dict[str, ItemRecord]:
        """Stored records by problem id (the last one wins), of the current TPF counting only."""
        rows = ({"counting": 1, **row} for row in self._read(self.path(model, config, benchmark)))
        return {r.problem_id: r for r in map(ItemRecord.model_validate, rows) if r.counting == TPF_COUNTING}

    def append(self, record: ItemRecord) -> None:
        self._append(self.path(record.model, record.config, record.benchmark), record.model_dump())

    def append_trace(self, model: str, config: str, benchmark: str, problem_id: str, trace: list[dict]) -> None:
        self._append(self.path(model, config, benchmark, "traces"), {"problem_id": problem_id, "trace": trace})

    def load_traces(self, model: str, config: str, benchmark: str) -> dict[str, list[dict]]:
        return {row["problem_id"]: row["trace"] for row in self._read(self.path(model, config, benchmark, "traces"))}

    def append_prefix_cache(self, model: str, config: str, benchmark: str, record: PrefixCacheRecord) -> None:
        self._append(self.path(model, config, benchmark, "prefix_cache"), record.model_dump())

    def load_prefix_cache(self, model: str, config: str, benchmark: str) -> list[PrefixCacheRecord]:
        return [PrefixCacheRecord.model_validate(row)
                for row in self._read(self.path(model, config, benchmark, "prefix_cache"))]

    @staticmethod
    def _append(path: Path, row: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    @staticmethod
    def _read(path: Path) -> list[dict]:
        if not path.is_file():
            return []
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):  # torn write of an interrupted run: drop it so appends stay valid
            data = data[: data.rfind(b"\n") + 1]
            path.write_bytes(data)
        rows = []
        for i, line in enumerate(data.decode("utf-8").splitlines(), 1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{i}: corrupt record ({e}); delete the line to redo that problem") from e
        return rows


def write_parquet(records: Sequence[ItemRecord], path: str | Path) -> Path:
    """All records of a sweep in one Parquet file (for pandas / DuckDB analysis)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([(k, {bool: pa.bool_(), int: pa.int64(), float: pa.float64()}.get(f.annotation, pa.string()))
                        for k, f in ItemRecord.model_fields.items()])
    pq.write_table(pa.Table.from_pylist([r.model_dump() for r in records], schema=schema), path)
    return path


# ----------------------------------------------------------------------------------------------- cells


@dataclass(frozen=True)
class Cell:
    model: ModelEntry
    decode: DecodeEntry
    bench: BenchmarkEntry

    @property
    def benchmark(self) -> str:
        """The benchmark entry's label: the cell's results file and report column."""
        return self.bench.label


def cells(cfg: SweepConfig) -> list[Cell]:
    return [Cell(m, d, b) for m, d in cfg.pairs() for b in cfg.benchmarks]


def load_splits(cfg: SweepConfig) -> dict[str, ProblemSplit]:
    """Scored problems and exemplars per benchmark entry, by label."""
    return {b.label: b.load(cfg.data_dir) for b in cfg.benchmarks}


def load_problems(cfg: SweepConfig) -> dict[str, list[Problem]]:
    """The scored problems per benchmark entry, by label."""
    return {label: split.scored for label, split in load_splits(cfg).items()}
