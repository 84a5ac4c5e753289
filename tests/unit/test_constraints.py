"""Grammar constraints on their own (mbd/decoding/constraints.py): compile errors name the feature, what a
vocabulary cannot express is refused, and `settle` accepts exactly the longest grammatical run left to right."""

import json

import jsonschema
import pytest
import torch

from mbd.decoding.constraints import ConstraintError, ConstraintSpec, GrammarVocab, mask_logits, new_bitmask, settle
from mbd.tiny.vocab import build_tokenizer
from tests.unit.structured_helpers import SCHEMAS, build_bpe

MASK, EOS, END = 3, 0, 2


@pytest.fixture(scope="module")
def bpe():
    tok = build_bpe()
    return tok, GrammarVocab(tok, 416, [EOS, END])  # a head padded past the tokenizer: ids 400-415 never allowed


def ids(tok, text):
    return tok.encode(text).ids


def test_settle_accepts_longest_run_masks_first_rejection_keeps_the_rest(bpe):
    tok, gv = bpe
    m = gv.matcher(ConstraintSpec("regex", "(yes|no)-[0-9]+"))
    row = ids(tok, "no") + [MASK] + ids(tok, "x") + ids(tok, "7")
    s = settle(m, row, 0, len(row), MASK)
    # "no" accepted; at the mask "-" is the only continuation: written without a forward; "x" is rejected
    # and masked again; "7" after it stays provisional
    n = len(ids(tok, "no"))
    assert s.tokens == ids(tok, "no") + ids(tok, "-") + [MASK] + ids(tok, "7")
    assert (s.frontier, s.remasked, s.forced) == (n + 1, 1, 1)
    assert m.accepted == ids(tok, "no-")
    row2 = ids(tok, "no-") + ids(tok, "12") + [END, 99]
    s2 = settle(m, row2, n + 1, len(row2), MASK)
    assert m.stopped and m.accepted == ids(tok, "no-12") + [END, 99]  # after the stop token anything goes
    assert s2.remasked == 0


def test_stop_token_is_refused_until_the_grammar_is_complete(bpe):
    tok, gv = bpe
    m = gv.matcher(ConstraintSpec("regex", "ab+"))
    s = settle(m, ids(tok, "a") + [EOS] + ids(tok, "b"), 0, 3, MASK, jump=False)
    assert s.tokens == ids(tok, "a") + [MASK] + ids(tok, "b") and s.frontier == 1 and not m.stopped


def test_masked_logits_pick_only_allowed_tokens(bpe):
    tok, gv = bpe
    m = gv.matcher(ConstraintSpec.choice(["red", "green", "blue"]))
    bm = new_bitmask(1, 416)
    m.fill_mask(bm, 0)
    logits = torch.zeros(1, 416)
    mask_logits(logits, bm)
    allowed = {tok.decode([i]) for i in torch.nonzero(logits[0] > float("-inf")).flatten().tolist()}
    assert allowed and all(any(c.startswith(a) for c in ("red", "green", "blue")) for a in allowed)
    assert not (logits[0, 400:] > float("-inf")).any()


def test_restore_rebuilds_the_state_from_accepted_tokens(bpe):
    tok, gv = bpe
    spec = ConstraintSpec.json_schema(SCHEMAS["enum"])
    a = gv.matcher(spec)
    text = ids(tok, '{"status":"open","color":"re')
    assert a.advance(text, MASK) == len(text)
    b = gv.matcher(spec)
    b.restore(a.accepted)
    assert b.forced() == a.forced() and tok.decode(a.forced()).startswith('d"') and b.accepted == a.accepted


@pytest.mark.parametrize("schema,feature", [
    ({"type": "object", "if": {"type": "object"}}, "if"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
    ({"$ref": "https://example.com/s.json"}, "$ref"),
])
def test_unsupported_schema_features_are_named(bpe, schema, feature):
    with pytest.raises(ConstraintError) as e:
        bpe[1].matcher(ConstraintSpec.json_schema(schema))
    assert e.value.feature == feature and feature in str(e.value)
    assert e.value.field == "response_format.json_schema.schema"


def test_invalid_regex_and_grammar_name_their_field(bpe):
    with pytest.raises(ConstraintError, match="^regex: cannot be compiled"):
        bpe[1].matcher(ConstraintSpec("regex", "[0-9", field="regex"))
    with pytest.raises(ConstraintError, match="^grammar: cannot be compiled"):
        bpe[1].matcher(ConstraintSpec("grammar", "start: x\nx: /[0-9/", field="grammar"))


def test_tiny_vocabulary_cannot_express_json():
    tiny = build_tokenizer()
    gv = GrammarVocab(tiny, 64, [0, 2])
    with pytest.raises(ConstraintError, match="vocabulary cannot express this json_object"):
        gv.matcher(ConstraintSpec("json_object"))
    with pytest.raises(ConstraintError, match="cannot express the choice 'Yes'"):
        gv.matcher(ConstraintSpec.choice(["yes", "Yes"]))
    m = gv.matcher(ConstraintSpec("regex", r"[0-9a-z+*/=;()-]*#### -?[0-9]+"))
    assert m.advance(tiny.encode("3*4=12#### 12").ids, 3) == 13


def test_random_logits_always_give_schema_valid_json(bpe):
    """The matcher alone, driven by random logits with random lookahead proposals: 40 outputs per schema."""
    tok, gv = bpe
    gen = torch.Generator().manual_seed(0)
    for name, schema in SCHEMAS.items():
        spec = ConstraintSpec.json_schema(schema)
        for _ in range(40):
            m, row, front = gv.matcher(spec), [], 0
            bm = new_bitmask(1, 416)
            while not m.stopped and len(row) < 400:
                m.fill_mask(bm, 0)
                first = int(mask_logits(torch.randn(1, 416, generator=gen), bm).argmax())
                guesses = torch.randint(0, 400, (3,), generator=gen).tolist()  # mostly ungrammatical
                row = row[:front] + [first] + guesses
                front = settle(m, row, front, len(row), MASK).frontier
                row = m.accepted[:]
            out = m.accepted[: next(i for i, t in enumerate(m.accepted) if t in (EOS, END))]
            text = tok.decode(out)
            jsonschema.validate(json.loads(text), schema)
