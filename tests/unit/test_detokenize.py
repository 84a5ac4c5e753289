"""Incremental detokenization (`mbd.detokenize.TextStream`): streamed pieces concatenate to the non-streaming text
(full decode, cut before the first stop string) for a char tokenizer and a byte-level BPE whose tokens split UTF-8
characters, in any block size; stop strings straddling blocks; and one full decode per request, not one per block."""

import random

import pytest
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

from mbd.detokenize import TextStream
from mbd.tokenizer import Tokenizer

TEXTS = ["price: 12€ or 3£, naïve café ☕ 1+2=3;", "日本語のテキスト and ascii", "emoji 🙂🙃 end", "abc12+34=46;xyz"]


def reference(tok: Tokenizer, ids: list[int], stop: list[str]) -> str:
    full = tok.decode(ids)
    cuts = [i for i in (full.find(s) for s in stop if s) if i >= 0]
    return full[: min(cuts)] if cuts else full


def stream(tok: Tokenizer, ids: list[int], stop: list[str], block: int) -> tuple[list[str], TextStream]:
    ts = TextStream(tok, stop)
    pieces = [ts.push(ids[i:i + block]) for i in range(0, len(ids), block)]
    return pieces + [ts.finish()], ts


@pytest.fixture(scope="module")
def char_tok() -> Tokenizer:
    from mbd.model import load_checkpoint

    return Tokenizer.from_dir("mbd/assets/tiny", load_checkpoint("mbd/assets/tiny")[1])


@pytest.fixture(scope="module")
def bpe_tok() -> Tokenizer:
    """A small byte-level BPE (as Qwen/SDAR use): rare characters stay split into their UTF-8 bytes."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(["the price and the café and ascii text " * 20], trainer)
    eos = hf.token_to_id("<|endoftext|>")
    return Tokenizer(hf, "sdar", hf.token_to_id("<|MASK|>"), eos, eos)


@pytest.mark.parametrize("block", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("stop", [[], ["="], ["€ or", "zz"], ["🙃"], ["46;x"]])
def test_stream_equals_full_decode_cut_at_stop(bpe_tok, block, stop):
    for text in TEXTS:
        ids = bpe_tok.encode(text)
        pieces, ts = stream(bpe_tok, ids, stop, block)
        assert "".join(pieces) == reference(bpe_tok, ids, stop) == ts.text
        assert ts.stopped == any(s in bpe_tok.decode(ids) for s in stop)


def test_split_utf8_characters_are_never_released_half_done(bpe_tok):
    ids = bpe_tok.encode("☕")
    assert len(ids) == 3  # one byte per token: the character needs all three
    ts = TextStream(bpe_tok)
    assert [ts.push([i]) for i in ids] == ["", "", "☕"]


def test_bytes_that_never_form_a_character_come_out_as_the_full_decode_shows_them(bpe_tok):
    ids = bpe_tok.encode("ok☕")[:-1]  # the character's last byte never arrives
    pieces, _ = stream(bpe_tok, ids, [], 1)
    assert "".join(pieces) == bpe_tok.decode(ids) and pieces[-1].endswith("\ufffd")


@pytest.mark.parametrize("block", [1, 2, 3, 4])
def test_stop_string_across_blocks_char_tokenizer(char_tok, block):
    ids = char_tok.encode("abc12+34=46;xyz")
    pieces, ts = stream(char_tok, ids, ["=46;", "zz"], block)
    assert "".join(pieces) == "abc12+34" and ts.stopped and ts.text == "abc12+34"


def test_holds_back_only_possible_stop_prefixes(char_tok):
    ts = TextStream(char_tok, ["+3="])
    assert ts.push(char_tok.encode("12+")) == "12"  # "+" may start the stop string
    assert ts.push(char_tok.encode("4")) == "+4"  # it did not
    assert ts.push(char_tok.encode("+3")) == ""
    assert ts.push(char_tok.encode("=9")) == "" and ts.stopped
    assert ts.finish() == ""


def test_special_tokens_are_skipped_as_in_the_full_decode(bpe_tok):
    ids = bpe_tok.encode("the café") + [bpe_tok.eos_token_id] + bpe_tok.encode(" text")
    pieces, _ = stream(bpe_tok, ids, [], 2)
    assert "".join(pieces) == bpe_tok.decode(ids)


def test_one_full_decode_per_request_not_per_block(bpe_tok, monkeypatch):
    calls = []
    real = Tokenizer.decode
    monkeypatch.setattr(Tokenizer, "decode", lambda self, ids, **kw: calls.append(len(ids)) or real(self, ids, **kw))
    rng = random.Random(0)
    ids = [rng.choice(bpe_tok.encode("the price and the café ascii")) for _ in range(400)]
    ts = TextStream(bpe_tok)
    for i in range(0, len(ids), 4):
        ts.push(ids[i:i + 4])
    ts.finish()
    assert calls == [len(ids)]  # only finish's reconciliation decodes the whole output


def test_returned_tokens_count_only_what_precedes_the_stop_string(char_tok):
    ids = char_tok.encode("4*5=20;stop")
    pieces, ts = stream(char_tok, ids, ["*"], 4)
    assert "".join(pieces) == "4" and ts.returned_tokens == 1  # usage: 1 token, not the 4 of the block
    _, ts = stream(char_tok, ids, [], 4)
    assert ts.returned_tokens == len(ids)


def test_released_tokens_follow_the_released_text(char_tok):
    ts = TextStream(char_tok, ["+3="])
    ts.push(char_tok.encode("12+"))  # "12" released, "+" held back
    assert ts.released_tokens == 2
