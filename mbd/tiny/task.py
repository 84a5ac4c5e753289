"""tinymath: a synthetic GSM8K-style task sized for the embedded tiny BD-LM.

Every problem has one shape, a shopping bill `a*b+c*d-e` (the middle and last operators are `+` or
`-`), and a worked solution that evaluates it in four step lines before the GSM8K answer line:

    question  3*4+2*7-5
    solution  4*3=12;2*7=14;14+12=26;26-5=21;#### 21

Why this shape (measurements and the full argument are in docs/tiny-task.md):
- each step is a small, learnable fact (one-digit products, two-digit +/-), so a ~1M-parameter char-level
  model reaches high exact match; the issue measured that operands up to 99 are out of reach;
- the response (~38 chars, ~10 blocks of B=4) is long relative to B and mostly determined by the question
  (copied operands, operators, `=`, `;`, `#### `), and the two products are independent branches: later
  blocks can be filled while earlier ones still hold undecided tokens;
- a commutative step (`*`, `+`) writes its operands in a seeded random order. The first character of such a
  line is a genuine coin flip that no confidence threshold accepts, so SingleBD spends a fallback step on it
  in each block that holds one, while MultiBD can settle the flips of several blocks in one forward, which is
  the kind of uncertainty inside a block that gives the paper's models room for inter-block parallelism.
  The answer does not depend on the order.

The split is a property of the problem, not of the sampling: a hash of its question (its canonical identity)
puts every problem in exactly one of four parts, so they are disjoint for every seed and n: `pretrain` (the
base's corpus, `mbd pretrain-tiny`), `posttrain` (the MultiTF corpus of `mbd quickstart` / `mbd reproduce`),
`dev` (the `tinymath-dev` benchmark: every recipe, threshold and step count is chosen there) and `heldout` (the
`tinymath` benchmark, the registered test). A post-training corpus therefore never replays a pretraining record
of any seed, which a shared pool made happen (docs/reproduce.md), and no tuning ever sees a test problem.
"""

from __future__ import annotations

import hashlib
import json
import random
from functools import lru_cache
from itertools import product
from pathlib import Path
from typing import Literal, NamedTuple

Split = Literal["pretrain", "posttrain", "dev", "heldout"]
SPLITS: tuple[str, ...] = ("pretrain", "posttrain", "dev", "heldout")
FACTORS = range(2, 10)  # a, b, c, d
ADJUST = range(1, 10)  # e
HELDOUT_PER_MILLE = 100  # 10% of all problems are held out (buckets 0-99)
POSTTRAIN_PER_MILLE = 50  # 5% are the post-training part (buckets 100-149)
DEV_PER_MILLE = 50  # 5% the dev part (buckets 150-199); the other 80% pretraining (200-999)
ANSWER_PREFIX = "#### "
COMMUTATIVE = frozenset("*+")
Step = tuple[int, str, int, int]  # (left, operator, right, result)


class TinyProblem(NamedTuple):
    """The structured fields of one problem; the question string is its identity."""

    a: int
    b: int
    c: int
    d: int
    op_mid: str  # '+' or '-' between the two products
    op_last: str  # '+' or '-' before e
    e: int

    @property
    def question(self) -> str:
        return f"{self.a}*{self.b}{self.op_mid}{self.c}*{self.d}{self.op_last}{self.e}"

    def steps(self) -> list[Step]:
        """The four steps in solution order, operands in question order."""
        p, q = self.a * self.b, self.c * self.d
        r = _apply(p, self.op_mid, q)
        return [(self.a, "*", self.b, p), (self.c, "*", self.d, q), (p, self.op_mid, q, r),
                (r, self.op_last, self.e, _apply(r, self.op_last, self.e))]

    def solution(self, swaps: tuple[bool, ...] = (False,) * 4) -> str:
        """The worked solution; a commutative step i with swaps[i] writes its operands right to left."""
        return _render(self.steps(), swaps)

    def is_valid(self) -> bool:
        """Every intermediate and the answer stay non-negative, so no number needs a sign (products are)."""
        r = _apply(self.a * self.b, self.op_mid, self.c * self.d)
        return r >= 0 and _apply(r, self.op_last, self.e) >= 0

    def record(self, rng: random.Random) -> dict:
        """{question, answer, solution, fields}; `rng` draws the operand order of each step."""
        steps = self.steps()
        swaps = tuple(rng.random() < 0.5 for _ in steps)
        return {"question": self.question, "answer": steps[-1][3], "solution": _render(steps, swaps),
                "fields": self._asdict()}


def _render(steps: list[Step], swaps: tuple[bool, ...]) -> str:
    if len(swaps) != len(steps):
        raise ValueError(f"swaps must hold one flag per step ({len(steps)}), got {len(swaps)}")
    lines = "".join(f"{y}{op}{x}={z};" if swap and op in COMMUTATIVE else f"{x}{op}{y}={z};"
                    for (x, op, y, z), swap in zip(steps, swaps))
    return f"{lines}{ANSWER_PREFIX}{steps[-1][3]}"


def _apply(x: int, op: str, y: int) -> int:
    if op == "+":
        return x + y
    if op == "-":
        return x - y
    raise ValueError(f"operator must be '+' or '-', got {op!r}")


def split_of(question: str) -> Split:
    """The part whose range of 1000 buckets sha256(question) lands in: held-out first (the same buckets as when
    the rest was one training split, so the benchmark's problems never moved), then post-training and dev (the
    old post-training buckets, halved: pretraining never moved either)."""
    bucket = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") % 1000
    if bucket < HELDOUT_PER_MILLE:
        return "heldout"
    if bucket < HELDOUT_PER_MILLE + POSTTRAIN_PER_MILLE:
        return "posttrain"
    return "dev" if bucket < HELDOUT_PER_MILLE + POSTTRAIN_PER_MILLE + DEV_PER_MILLE else "pretrain"


@lru_cache(maxsize=None)
def _pools() -> dict[str, tuple[TinyProblem, ...]]:
    """Every valid problem, by split, in canonical order (sorted by question string)."""
    pools: dict[str, list[TinyProblem]] = {s: [] for s in SPLITS}
    # the loop nest follows the question's character order, so enumeration order is question order
    for a, b, om, c, d, ol, e in product(FACTORS, FACTORS, "+-", FACTORS, FACTORS, "+-", ADJUST):
        p = TinyProblem(a, b, c, d, om, ol, e)
        if p.is_valid():
            pools[split_of(p.question)].append(p)
    return {s: tuple(ps) for s, ps in pools.items()}


def _pool(split: Split) -> tuple[TinyProblem, ...]:
    return _pools()[split]


def split_size(split: Split) -> int:
    """How many distinct problems the split holds (the largest n `generate` accepts)."""
    _check_split(split)
    return len(_pool(split))


def generate(split: Split, n: int, seed: int) -> list[dict]:
    """n distinct problems of `split` as records {question, answer, solution, fields}.

    The split's pool is shuffled by `seed`, the first n are taken and the same generator then draws each
    one's operand orders in turn, so the output is a pure function of (split, n, seed) and a smaller n gives
    a prefix of a larger one (an eval `limit` is a prefix).
    """
    _check_split(split)
    pool = list(_pool(split))
    if not 0 <= n <= len(pool):
        raise ValueError(f"n={n} is out of range: the '{split}' split holds {len(pool)} distinct problems")
    rng = random.Random(seed)
    rng.shuffle(pool)
    return [p.record(rng) for p in pool[:n]]


def write_jsonl(path: str | Path, records: list[dict]) -> Path:
    """Write a prompt/response corpus (response = worked solution ending in `#### N`), one JSON per line."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w") as f:
        for r in records:
            f.write(json.dumps({"prompt": r["question"], "response": r["solution"], "answer": r["answer"]}) + "\n")
    return p


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
