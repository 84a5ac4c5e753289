"""tinymath task generator, splits and the char-level tokenizer."""

from __future__ import annotations

import json
import operator
import re
from itertools import product

import pytest
from tokenizers import Tokenizer as HFTokenizer

from mbd.tiny import task, vocab
from mbd.tiny.task import generate, split_of, split_size

OPS = {"+": operator.add, "-": operator.sub}
STEP = re.compile(r"(\d+)([*+-])(\d+)=(\d+)")


def _value(f: dict) -> int:
    """The problem's value from its structured fields, computed without the module's own step code."""
    return OPS[f["op_last"]](OPS[f["op_mid"]](f["a"] * f["b"], f["c"] * f["d"]), f["e"])


def test_generate_is_a_pure_function_of_split_n_seed():
    assert generate("pretrain", 300, seed=7) == generate("pretrain", 300, seed=7)
    assert generate("pretrain", 300, seed=7) != generate("pretrain", 300, seed=8)
    # a smaller n is a prefix of a larger one, so an eval `limit` never reshuffles the sample
    assert generate("heldout", 40, seed=3) == generate("heldout", 400, seed=3)[:40]


def test_problems_are_distinct_within_a_call():
    qs = [r["question"] for r in generate("pretrain", 5000, seed=0)]
    assert len(set(qs)) == len(qs)


def test_splits_are_disjoint_and_cover_every_valid_problem():
    pre, post, dev, held = ({r["question"] for r in generate(s, split_size(s), seed=i)}
                            for i, s in enumerate(("pretrain", "posttrain", "dev", "heldout")))
    parts = (pre, post, dev, held)
    assert all(not a & b for i, a in enumerate(parts) for b in parts[i + 1:])
    # brute-force count of valid problems, independent of the module's enumeration
    valid = sum(
        1
        for a, b, c, d, om, ol, e in product(range(2, 10), range(2, 10), range(2, 10), range(2, 10), "+-", "+-",
                                             range(1, 10))
        if OPS[om](a * b, c * d) >= 0 and _value(dict(a=a, b=b, c=c, d=d, op_mid=om, op_last=ol, e=e)) >= 0
    )
    assert len(pre) + len(post) + len(dev) + len(held) == valid
    assert 0.08 < len(held) / valid < 0.12  # the 10% held-out hash buckets
    assert 0.04 < len(post) / valid < 0.06 and 0.04 < len(dev) / valid < 0.06  # the two 5% halves of the rest


def test_split_membership_does_not_depend_on_seed_or_n():
    for seed in (0, 5, 123):
        for r in generate("heldout", 50, seed=seed):
            assert split_of(r["question"]) == "heldout"
        for split in ("pretrain", "posttrain", "dev"):
            assert {split_of(r["question"]) for r in generate(split, 50, seed=seed)} == {split}


@pytest.mark.parametrize("split", ["pretrain", "posttrain", "dev", "heldout"])
def test_solution_ends_with_the_independently_computed_answer(split):
    for r in generate(split, 2000, seed=11):
        f = r["fields"]
        want = _value(f)
        assert r["answer"] == want
        assert r["solution"].endswith(f"#### {want}")
        assert r["question"] == f"{f['a']}*{f['b']}{f['op_mid']}{f['c']}*{f['d']}{f['op_last']}{f['e']}"


def test_every_step_line_is_true_and_chains_the_previous_results():
    for r in generate("pretrain", 2000, seed=2):
        f = r["fields"]
        body, answer = r["solution"].split(";#### ")
        steps = [STEP.fullmatch(s).groups() for s in body.split(";")]
        assert len(steps) == 4
        for x, op, y, z in steps:
            assert int(z) == {"*": operator.mul, **OPS}[op](int(x), int(y))
            assert int(z) >= 0
        (x1, o1, y1, p), (x2, o2, y2, q), (x3, om, y3, s), (x4, ol, y4, res) = steps
        # operands restate the question and the earlier results; only `*` and `+` may swap them
        assert (o1, o2, om, ol) == ("*", "*", f["op_mid"], f["op_last"])
        assert sorted([x1, y1]) == sorted([str(f["a"]), str(f["b"])])
        assert sorted([x2, y2]) == sorted([str(f["c"]), str(f["d"])])
        assert [x3, y3] == [p, q] or (om == "+" and [x3, y3] == [q, p])
        assert [x4, y4] == [s, str(f["e"])] or (ol == "+" and [x4, y4] == [str(f["e"]), s])
        assert answer == res


def test_commutative_operand_order_is_a_live_coin_flip():
    swapped = total = 0
    for r in generate("pretrain", 2000, seed=9):
        f = r["fields"]
        if f["a"] != f["b"]:
            total += 1
            swapped += r["solution"].startswith(f"{f['b']}*{f['a']}=")
    assert 0.45 < swapped / total < 0.55
    p = task.TinyProblem(3, 4, 2, 7, "+", "-", 5)
    assert p.solution() == "3*4=12;2*7=14;12+14=26;26-5=21;#### 21"
    assert p.solution((True, True, True, True)) == "4*3=12;7*2=14;14+12=26;26-5=21;#### 21"


def test_bad_split_or_n_names_the_field():
    with pytest.raises(ValueError, match="split must be one of"):
        generate("test", 3, seed=0)
    with pytest.raises(ValueError, match=r"n=\d+ is out of range"):
        generate("heldout", split_size("heldout") + 1, seed=0)


def test_write_jsonl_has_prompt_and_response(tmp_path):
    recs = generate("pretrain", 20, seed=0)
    path = task.write_jsonl(tmp_path / "corpus" / "train.jsonl", recs)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [r["question"] for r in recs]
    assert all(row["response"].endswith(f"#### {row['answer']}") for row in rows)


# --- tokenizer ---------------------------------------------------------------------------------------


def _chat(q: str, a: str) -> str:
    return f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|><|endoftext|>"


def test_vocab_is_small_and_specials_are_single_tokens():
    tok = vocab.build_tokenizer()
    assert tok.get_vocab_size(with_added_tokens=True) == len(vocab.SPECIAL_TOKENS) + len(set(vocab.ALPHABET)) < 64
    for s in vocab.SPECIAL_TOKENS:
        assert tok.encode(s, add_special_tokens=False).ids == [vocab.vocab()[s]]


def test_task_strings_round_trip_one_token_per_char():
    tok = vocab.build_tokenizer()
    for r in generate("pretrain", 500, seed=4) + generate("heldout", 500, seed=4):
        for s in (r["question"], r["solution"]):
            enc = tok.encode(s, add_special_tokens=False)
            assert len(enc.ids) == len(s) and vocab.vocab()[vocab.UNK] not in enc.ids
            assert tok.decode(enc.ids) == s
        chat = _chat(r["question"], r["solution"])
        ids = tok.encode(chat, add_special_tokens=False).ids
        one_char_each = chat
        for special in vocab.SPECIAL_TOKENS:
            one_char_each = one_char_each.replace(special, "\x00")
        assert len(ids) == len(one_char_each)
        assert tok.decode(ids, skip_special_tokens=False) == chat


def test_whitespace_survives_decode():
    tok = vocab.build_tokenizer()
    for s in ("  a  b\n\n c ", "\n", "user\n3*4", "x = 1;\n#### 2 "):
        assert tok.decode(tok.encode(s, add_special_tokens=False).ids) == s


def test_unknown_characters_become_unk_not_an_error():
    tok = vocab.build_tokenizer()
    assert tok.encode("A!", add_special_tokens=False).tokens == [vocab.UNK, vocab.UNK]


def test_saved_tokenizer_loads_and_names_its_specials(tmp_path):
    vocab.save_tokenizer(tmp_path)
    tok = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    s = _chat("3*4+2*7-5", "3*4=12;2*7=14;12+14=26;26-5=21;#### 21")
    assert tok.encode(s, add_special_tokens=False).ids == vocab.build_tokenizer().encode(s, add_special_tokens=False).ids
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (cfg["eos_token"], cfg["mask_token"], cfg["chat_template_family"]) == ("<|endoftext|>", "<|MASK|>", "sdar")
    ids = vocab.special_token_ids()
    assert tok.token_to_id("<|MASK|>") == ids["mask_token_id"] and tok.token_to_id("<|endoftext|>") == ids["eos_token_id"]



def test_project_tokenizer_renders_the_sdar_chat_one_token_per_char(tmp_path):
    from mbd.config import ModelConfig
    from mbd.tokenizer import Tokenizer

    vocab.save_tokenizer(tmp_path)
    ids = vocab.special_token_ids()
    cfg = ModelConfig(family="sdar", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=16, mask_token_id=ids["mask_token_id"],
                      eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"], block_size=4)
    tok = Tokenizer.from_dir(tmp_path, cfg)
    prompt = tok.encode_chat([{"role": "user", "content": "3*4+2*7-5"}])
    # <|im_start|> user \n 9 question chars <|im_end|> \n <|im_start|> assistant \n
    assert len(prompt) == 1 + 4 + 1 + 9 + 1 + 1 + 1 + 9 + 1
    assert set(tok.stop_token_ids) == {ids["eos_token_id"], ids["im_end_id"]}
    assert tok.decode(tok.encode("3*4=12;#### 12")) == "3*4=12;#### 12"

# --- benchmark ---------------------------------------------------------------------------------------


def test_tinymath_benchmark_loads_heldout_and_scores_the_answer_line():
    from mbd.eval.benchmarks import get_benchmark
    from mbd.tiny.benchmark import TinyMath

    bench = get_benchmark("tinymath")
    assert isinstance(bench, TinyMath) and bench.kind == "math"
    problems = bench.load(limit=30)
    assert len(problems) == 30 and problems == bench.load()[:30]
    assert all(split_of(p.prompt_text) == "heldout" for p in problems)
    p = problems[0]
    gold = int(p.reference)
    assert gold == _value(p.metadata)
    solution = next(r["solution"] for r in generate("heldout", 30, seed=0) if r["question"] == p.prompt_text)
    assert bench.score(p, solution).correct
    assert not bench.score(p, solution.rsplit("####", 1)[0] + f"#### {gold + 1}").correct
    # a solution cut before its answer does not score through the last number of the steps
    truncated = solution.rsplit("####", 1)[0]
    assert truncated.rstrip(";").endswith(str(gold)) and not bench.score(p, truncated).correct
    assert not bench.score(p, truncated + "#### ").correct


def test_tinymath_dev_benchmark_is_the_dev_split_and_never_a_test_problem():
    from mbd.eval.benchmarks import get_benchmark

    dev = get_benchmark("tinymath-dev").load(limit=2000)
    assert len(dev) == 2000 and all(split_of(p.prompt_text) == "dev" for p in dev)
    assert not {p.prompt_text for p in dev} & {p.prompt_text for p in get_benchmark("tinymath").load()}
