"""GSM8K and MATH scoring on hand-checked completions."""

import threading

import pytest

from mbd.eval.math_scoring import (
    VerifyWorker,
    extract_gsm8k_answer,
    last_boxed,
    normalize_number,
    score_gsm8k,
    score_math,
)


@pytest.mark.parametrize("completion, expected", [
    ("She earns 9 * 2 = 18 dollars.\n#### 18", "18"),
    ("#### $1,600.00", "1600"),
    ("#### 2.50 dollars", "2.5"),
    ("so the answer is \\boxed{42}.", "42"),
    ("First 3 apples, then 5 more, so 8 in total.", "8"),
    ("The change is -7 degrees", "-7"),
    ("#### the end, 12 boxes", "12"),
    ("no digits here", None),
])
def test_gsm8k_extraction(completion, expected):
    assert extract_gsm8k_answer(completion) == expected


def test_gsm8k_scoring_compares_numbers_not_strings():
    assert score_gsm8k("The total is $1,600.", "1,600").correct
    assert score_gsm8k("#### 18.0", "18").correct
    assert not score_gsm8k("#### 17", "18").correct
    assert not score_gsm8k("I do not know", "18").correct
    assert score_gsm8k("#### 18\nWait, 19? No. #### 18", "18").extracted == "18"  # the last #### wins


def test_normalize_number_rejects_text_without_digits():
    assert normalize_number("1,000,000") == "1000000" and normalize_number("n/a") is None
    with pytest.raises(ValueError, match="holds no number"):
        score_gsm8k("#### 1", "none")


@pytest.mark.parametrize("text, expected", [
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("first \\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("answer \\boxed 5$", "5"),
    ("good \\boxed{3} then cut \\boxed{4", "3"),  # an unbalanced (truncated) box is skipped
    ("\\fbox{x+1}", "x+1"),
    ("no box", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.fixture(scope="module")
def worker():
    w = VerifyWorker()
    yield w
    w.close()


@pytest.mark.parametrize("completion, gold, correct", [
    ("so $x = \\boxed{0.5}$", "\\frac{1}{2}", True),
    ("\\boxed{\\frac{2}{4}}", "\\frac12", True),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", True),
    ("\\boxed{(1, 2]}", "(1,2]", True),
    ("\\boxed{[1, 2]}", "(1,2]", False),
    ("\\boxed{3}", "\\frac{1}{2}", False),
    ("The answer is 7.", "7", True),  # no box: math_verify searches the whole text
])
def test_math_equivalence(worker, completion, gold, correct):
    assert score_math(completion, gold, worker=worker).correct is correct


def test_math_scoring_works_from_a_non_main_thread(worker):
    results = []
    t = threading.Thread(target=lambda: results.append(score_math("\\boxed{0.25}", "\\frac{1}{4}", worker=worker)))
    t.start()
    t.join()
    assert results and results[0].correct


def test_math_verify_hang_is_cut_by_our_timeout_and_the_worker_recovers(worker):
    hung = score_math("\\boxed{9^{9^{9^{9}}}}", "1", timeout_s=2.0, worker=worker)
    assert not hung.correct and "exceeded" in hung.detail
    assert score_math("\\boxed{1}", "1", worker=worker).correct
