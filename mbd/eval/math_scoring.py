"""Answer extraction and equivalence for GSM8K-style and MATH-style problems.

GSM8K: the number after the last `####`, else inside the last `\\boxed{}`, else the last number in
the text; commas, `$` and trailing zeros of decimals are normalised and values compared exactly
as fractions.

MATH500: the last `\\boxed{}` answer is checked against the gold answer with `math_verify`.
math_verify's own timeout uses SIGALRM, which only works in the main thread, so it is disabled
(`parsing_timeout=None`, `timeout_seconds=None`) and our timeout is enforced instead by running
math_verify in a separate worker process that is killed and replaced when a call overruns. That
works from any thread (Ray actors, thread pools) and also bounds sympy calls that hang in C code.
This file is stdlib-only at import time because the worker runs it as a script.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import threading
from fractions import Fraction
from typing import NamedTuple


class MathVerdict(NamedTuple):
    correct: bool
    extracted: str | None
    detail: str


# ------------------------------------------------------------------------------------------ GSM8K

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def normalize_number(text: str) -> str | None:
    """The first number in `text` as a canonical decimal string ('1,000.50' -> '1000.5'), or None."""
    m = _NUMBER.search(text.replace("$", ""))
    if m is None:
        return None
    digits = m.group().replace(",", "")
    if digits in ("-", "") or not any(c.isdigit() for c in digits):
        return None
    value = Fraction(digits)
    return str(value.numerator) if value.denominator == 1 else _decimal_str(digits)


def _decimal_str(digits: str) -> str:
    whole, _, frac = digits.partition(".")
    frac = frac.rstrip("0")
    return f"{whole or '0'}.{frac}" if frac else (whole or "0")


def extract_gsm8k_answer(completion: str) -> str | None:
    """The model's final numeric answer, normalised; None when there is no number at all."""
    if "####" in completion:
        got = normalize_number(completion.rsplit("####", 1)[1])
        if got is not None:
            return got
    boxed = last_boxed(completion)
    if boxed is not None:
        got = normalize_number(boxed)
        if got is not None:
            return got
    numbers = _NUMBER.findall(completion.replace("$", ""))
    for candidate in reversed(numbers):
        got = normalize_number(candidate)
        if got is not None:
            return got
    return None


def score_gsm8k(completion: str, gold: str) -> MathVerdict:
    """Exact numeric match of the extracted answer with `gold` (e.g. '18' or '1,600')."""
    gold_norm = normalize_number(gold)
    if gold_norm is None:
        raise ValueError(f"gold answer {gold!r} holds no number")
    got = extract_gsm8k_answer(completion)
    if got is None:
        return MathVerdict(False, None, "no number in the completion")
    correct = Fraction(got) == Fraction(gold_norm)
    return MathVerdict(correct, got, f"extracted {got}, gold {gold_norm}")


# ------------------------------------------------------------------------------------------- MATH

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (nested braces allowed) or `\\boxed x`; None if absent."""
    matches = list(_BOXED.finditer(text))
    for m in reversed(matches):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1: j].strip()
            continue  # unbalanced (truncated generation): try an earlier box
        bare = re.match(r"[^\s$]+", text[i:])
        if bare and m.group().endswith(" "):
            return bare.group()
    return None


def _verify_pair(gold: str, prediction: str) -> bool:
    """math_verify with its signal timeouts disabled (we run in a worker we can kill)."""
    from math_verify import parse, verify

    gold_parsed = parse(f"${gold}$", parsing_timeout=None)
    pred_parsed = parse(prediction, parsing_timeout=None)
    return bool(gold_parsed) and bool(pred_parsed) and verify(gold_parsed, pred_parsed, timeout_seconds=None)


def _serve() -> None:
    """Worker loop: JSON [gold, prediction] lines in, JSON verdict lines out (on a private fd)."""
    import logging

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns that its timeout is disabled
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything the libraries print goes to stderr, not into the protocol
    _verify_pair("1", "1")  # import and warm up before announcing readiness
    out.write('"ready"\n')
    out.flush()
    for line in sys.stdin:
        gold, prediction = json.loads(line)
        try:
            reply: bool | str = _verify_pair(gold, prediction)
        except Exception as e:  # noqa: BLE001 - a parser crash means "not verified", not a dead worker
            reply = f"error: {type(e).__name__}: {e}"
        out.write(json.dumps(reply) + "\n")
        out.flush()


class VerifyWorker:
    """A math_verify process reused across calls; killed and restarted when a call overruns.

    The worker is this file run as a script (no multiprocessing), so it starts the same way from
    any parent: a thread, a Ray actor, `python -c`, a notebook.
    """

    STARTUP_TIMEOUT_S = 120.0

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def verify(self, gold: str, prediction: str, timeout_s: float) -> bool | str | None:
        """True/False, an 'error: ...' string, or None when `timeout_s` passed (worker replaced)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            self._proc.stdin.write(json.dumps([gold, prediction]) + "\n")
            self._proc.stdin.flush()
            reply = self._read_line(timeout_s)
            if reply is None:
                self._stop()
            return reply

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _start(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-B", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if self._read_line(self.STARTUP_TIMEOUT_S) != "ready":
            self._stop()
            raise RuntimeError("the math_verify worker did not start; is math-verify installed?")

    def _read_line(self, timeout_s: float) -> bool | str | None:
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        line = self._proc.stdout.readline() if ready else ""
        return json.loads(line) if line else None

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc.stdin.close()
            self._proc.stdout.close()
        self._proc = None


_WORKER = VerifyWorker()


def score_math(completion: str, gold: str, timeout_s: float = 10.0, worker: VerifyWorker | None = None) -> MathVerdict:
    """MATH-style equivalence of the completion's last boxed answer with `gold` (LaTeX)."""
    boxed = last_boxed(completion)
    prediction = f"$\\boxed{{{boxed}}}$" if boxed is not None else completion
    result = (worker or _WORKER).verify(gold, prediction, timeout_s)
    if result is None:
        return MathVerdict(False, boxed, f"math_verify exceeded {timeout_s:g}s")
    if isinstance(result, str):
        return MathVerdict(False, boxed, result)
    return MathVerdict(result, boxed, "verified equal" if result else "not equivalent")


if __name__ == "__main__":
    _serve()
