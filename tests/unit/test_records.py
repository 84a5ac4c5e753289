"""Corpus records -> token sequences (`mbd.multitf.records`): the exact ids of a good record, and one
`BadRecord` reason per kind of record that must never reach the training targets."""

import json
import math

import pytest

from mbd.multitf.records import BadRecord, load_tokenizer, seq_id_of, tokenize_record

TINY = "mbd/assets/tiny"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TINY)[0]


def test_good_record_is_prompt_answer_eos_and_pads(tok):
    record = {"prompt": "1+2", "response": "3"}
    seq_id, ids, p_len, r_len = tokenize_record(json.dumps(record), tok, block_size=4, max_length=64)
    prompt = tok.encode("<|im_start|>user\n1+2<|im_end|>\n<|im_start|>assistant\n")
    answer = tok.encode("3") + [tok.eos_token_id]
    padded = math.ceil((len(prompt) + len(answer)) / 4) * 4
    assert ids == prompt + answer + [tok.pad_token_id] * (padded - len(prompt) - len(answer))
    assert (p_len, r_len) == (len(prompt), len(answer))
    assert seq_id == seq_id_of(record) == seq_id_of({"response": "3", "prompt": "1+2"})  # key order is irrelevant


@pytest.mark.parametrize("line, reason", [
    ('{"prompt": "1+2"', "undecodable"),
    ('[1, 2]', "invalid_schema"),
    ('{"prompt": 1, "response": "2"}', "invalid_schema"),
    ('{"messages": [{"role": "user", "content": "1"}]}', "invalid_schema"),
    ('{"messages": [{"role": "tool", "content": "1"}, {"role": "assistant", "content": "2"}]}', "invalid_schema"),
    ('{"prompt": "1+2", "response": " "}', "empty_response"),
    ('{"prompt": "1+\\ud800", "response": "2"}', "invalid_unicode"),
    ('{"prompt": "1+2", "response": "\\udfff"}', "invalid_unicode"),
    ('{"prompt": "1+2", "response": "3<|MASK|>"}', "special_token_text"),
    ('{"prompt": "1<|im_end|>\\n<|im_start|>system\\nx", "response": "3"}', "special_token_text"),
    ('{"prompt": "1+2", "response": "3<|endoftext|>"}', "special_token_text"),
    (json.dumps({"prompt": "1+2", "response": "3" * 80}), "too_long"),
])
def test_bad_records_name_their_reason(tok, line, reason):
    with pytest.raises(BadRecord) as e:
        tokenize_record(line, tok, block_size=4, max_length=64)
    assert e.value.reason == reason
