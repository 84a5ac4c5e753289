"""Few-shot prompt mode of the eval sweeps: exemplar choice, exemplar turns in each benchmark's answer format, and the
token-identical shared prefix that makes a prefix cache pay off."""

import pytest
from pydantic import ValidationError
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from mbd.config import ConfigError
from mbd.eval.benchmarks import Problem, get_benchmark
from mbd.eval.code_extract import extract_code
from mbd.eval.math_scoring import score_gsm8k
from mbd.eval.prompts import chat_messages, exemplar_answer
from mbd.eval.sweep import BenchmarkEntry
from mbd.tokenizer import Tokenizer
from tests.conftest import DATA, needs_data


def _problem(benchmark, prompt_text="q", reference="", solution=""):
    return Problem(benchmark=benchmark, problem_id=f"{benchmark}/x", prompt_text=prompt_text, reference=reference,
                   solution=solution)


# ---------------------------------------------------------------------------------------------- exemplar turns


def test_exemplar_answers_follow_each_benchmark_answer_format():
    gsm = _problem("gsm8k", solution="Half of 48 is 48/2 = <<48/2=24>>24 clips.\n#### 24")
    assert exemplar_answer(gsm) == "Half of 48 is 48/2 = 24 clips.\n#### 24"
    he = _problem("humaneval_plus", "def f(x):\n    \"\"\"doc\"\"\"\n", reference="    return x + 1\n")
    assert exemplar_answer(he) == "```python\ndef f(x):\n    \"\"\"doc\"\"\"\n    return x + 1\n```"
    mbpp = _problem("mbpp_plus", '"""\nWrite f.\n"""\n', reference="def f(x):\n    return x\n")
    assert exemplar_answer(mbpp) == "```python\ndef f(x):\n    return x\n```"
    assert exemplar_answer(_problem("math500", solution="So $x=\\boxed{3}$.")) == "So $x=\\boxed{3}$."
    assert exemplar_answer(_problem("tinymath", solution="3*4=12;#### 12")) == "3*4=12;#### 12"
    with pytest.raises(ValueError, match="tinymath/x: no worked solution"):
        exemplar_answer(_problem("tinymath"))


def test_chat_messages_put_exemplar_turns_before_the_problem():
    exemplars = [_problem("tinymath", "1*2+3*4-5", solution="a;#### 9"), _problem("tinymath", "2*2+2*2-1",
                                                                                 solution="b;#### 7")]
    problem = _problem("tinymath", "9*9+9*9-9")
    assert chat_messages(problem) == [{"role": "user", "content": "9*9+9*9-9"}]  # zero-shot: today's prompt
    assert chat_messages(problem, exemplars) == [
        {"role": "user", "content": "1*2+3*4-5"}, {"role": "assistant", "content": "a;#### 9"},
        {"role": "user", "content": "2*2+2*2-1"}, {"role": "assistant", "content": "b;#### 7"},
        {"role": "user", "content": "9*9+9*9-9"}]


@needs_data
def test_every_gsm8k_exemplar_answer_scores_correct_against_its_own_reference():
    """Stripping the calculator annotations keeps every worked solution's `#### N` answer intact."""
    problems = get_benchmark("gsm8k").load(DATA)
    wrong = [p.problem_id for p in problems if not score_gsm8k(exemplar_answer(p), p.reference).correct]
    assert wrong == []
    assert not any("<<" in exemplar_answer(p) for p in problems)


@needs_data
@pytest.mark.parametrize("name", ["humaneval_plus", "mbpp_plus"])
def test_code_exemplar_answers_extract_to_the_canonical_program(name):
    for p in get_benchmark(name).load(DATA, limit=20):
        program = extract_code(exemplar_answer(p), p.prompt_text, p.tests.entry_point)
        ns: dict = {}
        exec(program, ns)  # the canonical solutions of the pinned data: trusted code
        assert callable(ns[p.tests.entry_point])


def test_tinymath_exemplar_answers_score_correct():
    bench = get_benchmark("tinymath")
    assert all(bench.score(p, exemplar_answer(p)).correct for p in bench.load(limit=50))


# ---------------------------------------------------------------------------------------------- exemplar choice


def test_fewshot_split_is_deterministic_disjoint_and_keeps_limit_scored_problems():
    pool = get_benchmark("tinymath").load()
    entry = BenchmarkEntry(name="tinymath", limit=10, fewshot=3)
    scored, exemplars = entry.load(None)
    assert len(exemplars) == 3 and len(scored) == 10
    ex_ids = [p.problem_id for p in exemplars]
    assert not set(ex_ids) & {p.problem_id for p in scored}  # never the scored problem itself
    assert [p.problem_id for p in scored] == [p.problem_id for p in pool if p.problem_id not in ex_ids][:10]
    assert entry.load(None) == (scored, exemplars)  # same seed, same exemplars in the same order
    assert [p.problem_id for p in BenchmarkEntry(name="tinymath", limit=20, fewshot=3).load(None).exemplars] == ex_ids
    other = BenchmarkEntry(name="tinymath", limit=10, fewshot=3, fewshot_seed=1).load(None).exemplars
    assert [p.problem_id for p in other] != ex_ids
    zero = BenchmarkEntry(name="tinymath", limit=10).load(None)
    assert zero.exemplars == [] and zero.scored == pool[:10]  # zero-shot: today's problems
    assert [BenchmarkEntry(name="tinymath", **kw).label for kw in ({}, {"fewshot": 3},
                                                                   {"fewshot": 3, "fewshot_seed": 1})] == \
        ["tinymath", "tinymath+3shot", "tinymath+3shot+seed1"]


def test_fewshot_config_errors_name_the_field():
    with pytest.raises(ValidationError, match="fewshot"):
        BenchmarkEntry(name="tinymath", fewshot=-1)
    with pytest.raises(ConfigError, match="tinymath has 10000 problems, too few for fewshot: 10000"):
        BenchmarkEntry(name="tinymath", fewshot=10000).load(None)


# ---------------------------------------------------------------------------------------------- shared prefix


def _bpe(texts: list[str], family: str) -> Tokenizer:
    """A byte-level BPE as Qwen/SDAR use, trained here on the prompts' own text so merges span words."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>", "<role>", "</role>", "<|role_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(texts, trainer)
    eos = hf.token_to_id("<|endoftext|>")
    return Tokenizer(hf, family, hf.token_to_id("<|MASK|>"), eos, eos)


def _char() -> Tokenizer:
    from mbd.model import load_checkpoint

    return Tokenizer.from_dir("mbd/assets/tiny", load_checkpoint("mbd/assets/tiny")[1])


@pytest.mark.parametrize("bench", ["tinymath", pytest.param("gsm8k", marks=needs_data),
                                   pytest.param("mbpp_plus", marks=needs_data)])
@pytest.mark.parametrize("tok_kind, family", [("char", "sdar"), ("bpe", "sdar"), ("bpe", "llada2_moe")])
def test_fewshot_prompts_share_a_token_identical_prefix(bench, tok_kind, family):
    """All prompts of a k-shot benchmark start with the same ids: the exemplar turns, then the problem turn's
    opening markup. What a prefix cache matches is token ids, not text."""
    scored, exemplars = BenchmarkEntry(name=bench, limit=3, fewshot=2).load(DATA)
    convs = [chat_messages(p, exemplars) for p in scored]
    tok = _char() if tok_kind == "char" else _bpe(
        [m["content"] for c in convs for m in c] * 3, family)
    ids = [tok.encode_chat(c) for c in convs]
    opening = tok.encode("<|im_start|>user\n" if family == "sdar" else "<role>HUMAN</role>")
    # the exemplar turns as the template renders them inside the conversation (SDAR's template renders a final
    # assistant turn differently from an earlier one): everything before the problem turn's opening
    cut = max(i for i in range(len(ids[0])) if ids[0][i: i + len(opening)] == opening)
    prefix = ids[0][:cut]
    assert len(prefix) > 20
    assert all(x[: len(prefix)] == prefix for x in ids)
    assert all(x[len(prefix): len(prefix) + len(opening)] == opening for x in ids)
    assert len({tuple(x) for x in ids}) == len(ids)  # the problems still differ
