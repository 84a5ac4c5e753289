"""The `tinymath` benchmark (the tiny task's held-out split, the registered test) and `tinymath-dev` (its dev
split, where every choice is tuned) behind the evaluation interface.

Problems are generated, not read: the held-out split is fixed by construction (mbd.tiny.task), so
`data_dir` is ignored and the benchmark needs no file. The user prompt is the bare question, exactly the
text the tiny model is trained on (mbd.eval.prompts passes unknown benchmarks' `prompt_text` verbatim), and a
few-shot exemplar's answer is its worked solution `...;#### N`, the response the model is trained to write.
Importing this module registers the benchmark.
"""

from __future__ import annotations

from pathlib import Path

from mbd.eval.benchmarks import Kind, Problem, ScoreResult, register_benchmark
from mbd.eval.math_scoring import normalize_number
from mbd.tiny.task import Split, generate, split_size


class TinyMath:
    kind: Kind = "math"

    def __init__(self, size: int = 10000, seed: int = 0, split: Split = "heldout", name: str = "tinymath"):
        """`size` problems of `split` drawn with `seed`; `load(limit=k)` returns their first k."""
        self.size, self.seed, self.split, self.name = min(size, split_size(split)), seed, split, name

    def load(self, data_dir: str | Path | None = None, limit: int | None = None) -> list[Problem]:
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        n = self.size if limit is None else min(limit, self.size)
        return [Problem(benchmark=self.name, problem_id=f"{self.name}/{r['question']}", prompt_text=r["question"],
                        reference=str(r["answer"]), solution=r["solution"], metadata=r["fields"])
                for r in generate(self.split, n, self.seed)]

    def score(self, problem: Problem, completion_text: str) -> ScoreResult:
        """Exact match of the number after the last `####` (GSM8K's normaliser). Unlike GSM8K there is no
        fallback to the last number in the text: the tiny model is trained to end with `#### N`, and a
        truncated solution must not score by accident."""
        if "####" not in completion_text:
            return ScoreResult(correct=False, extracted=None, detail="no '#### N' answer line")
        got = normalize_number(completion_text.rsplit("####", 1)[1])
        if got is None:
            return ScoreResult(correct=False, extracted=None, detail="no number after '####'")
        gold = normalize_number(problem.reference)
        return ScoreResult(correct=got == gold, extracted=got, detail=f"extracted {got}, gold {gold}")

register_benchmark(TinyMath(), replace=True)
register_benchmark(TinyMath(size=5000, split="dev", name="tinymath-dev"), replace=True)
