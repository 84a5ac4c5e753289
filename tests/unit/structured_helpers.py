"""Shared by the structured-output tests: a byte-level BPE tokenizer trained here (no download) and five JSON
schemas whose outputs are bounded (lengths, item counts, ranges), so that any weights finish them."""

from __future__ import annotations

import json
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]  # ids 0-3: eos, -, end of turn, mask
WORDS = ["name", "age", "tags", "items", "status", "open", "closed", "alpha", "beta", "count", "value", "true",
         "false", "null", "id", "score", "owner", "color", "red", "green", "blue", "point", "x", "y"]


def build_bpe(vocab: int = 400) -> Tokenizer:
    """A GPT-2 style byte-level BPE over JSON-like text: merges such as `":"` and `name` exist, so proposals
    span several characters and differ from the grammar's own tokenization."""
    rng = random.Random(0)
    corpus = []
    for _ in range(300):
        v = rng.choice([rng.randint(-999, 9999), round(rng.random() * 100, 2), rng.choice(WORDS),
                        [rng.choice(WORDS) for _ in range(3)], {rng.choice(WORDS): rng.randint(0, 99)}])
        corpus += [json.dumps({rng.choice(WORDS): v}, separators=(",", ":")), " ".join(rng.sample(WORDS, 8))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                      "required": ["name", "age"], "additionalProperties": False},
            "active": {"type": "boolean"},
        },
        "required": ["owner", "active"], "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {"points": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50},
                                             "y": {"type": "integer", "minimum": -50, "maximum": 50}},
            "required": ["x", "y"], "additionalProperties": False}}},
        "required": ["points"], "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"status": {"enum": ["open", "closed", "pending"]},
                       "color": {"type": "string", "enum": ["red", "green", "blue"]},
                       "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}, "maxItems": 4}},
        "required": ["status", "color", "tags"], "additionalProperties": False,
    },
    "number": {
        "type": "object",
        # multipleOf bounds the fraction digits: a plain number lets weights loop on digits to the length limit
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.25},
                       "count": {"type": "integer", "minimum": 1, "maximum": 9999},
                       "ratio": {"type": ["number", "null"], "minimum": -10, "maximum": 10, "multipleOf": 0.5}},
        "required": ["score", "count", "ratio"], "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3,4}$"},
                       "code": {"type": "string", "pattern": "^[a-z]{1,5}(_[a-z0-9]{1,3})?$"}},
        "required": ["id", "code"], "additionalProperties": False,
    },
}
