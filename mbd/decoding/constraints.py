"""Structured output for a diffusion decoder: grammars compiled against the model's vocabulary, and a per-request
matcher that decides, left to right, which proposed tokens may be committed.

A Block Buffer step proposes tokens anywhere in its ACTIVE blocks; a grammar can only judge them in order. So
a request keeps a frontier: every token before it has been accepted by its matcher, in order. Each step the
logits at the frontier are masked to what the grammar allows there (so the model decides that position
within the grammar), then `settle` walks the proposals from the frontier and accepts the longest run the
matcher accepts; the first one it rejects is masked again (the model predicts it anew, under the mask, once
the frontier reaches it) and the ones after it stay provisional. Where the grammar allows a single
continuation, `settle` writes it without a forward (jump-forward). Only accepted tokens can become final.

The engine is llguidance (benchmarks/grammar_engines.py: the cheapest mask of the three maintained engines
on a byte-level BPE vocabulary, a run check that leaves the matcher untouched, and compile in milliseconds).
Its matcher lives on the host; a preempted request keeps it, and `Matcher.restore` rebuilds one from the
accepted tokens alone. No ray, no HTTP: the request layers turn `ConstraintError` into a 400.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import torch
from tokenizers import Tokenizer as HFTokenizer

from mbd.decoding.constraint_spec import ConstraintError, ConstraintSpec

# compact JSON: one spelling per value, so a grammar-bound output cannot pad itself with whitespace forever
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":", "lenient": False}
SPECIAL = b"\xff"  # llguidance's marker of a special token: never produced by a grammar's text


def token_bytes(tok: HFTokenizer, vocab_size: int) -> tuple[list[bytes], list[int]]:
    """Each id's bytes as the model emits them, and the special ids (marked for llguidance, never grammar text).
    Byte-level BPE tokens undo GPT-2's byte-to-unicode map; SentencePiece-style ones map `▁` to a space and
    `<0xNN>` to its byte; ids past the tokenizer (a padded head) are empty, hence never allowed."""
    spec = json.loads(tok.to_str())
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
    specials = sorted(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    unmap = {c: b for b, c in _byte_to_unicode().items()}
    out = []
    for i in range(vocab_size):
        s = tok.id_to_token(i)
        if s is None:
            out.append(b"")
        elif i in specials:
            out.append(SPECIAL + s.encode())
        elif byte_level:
            out.append(bytes(unmap[c] for c in s) if all(c in unmap for c in s) else s.encode())
        elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", s):
            out.append(bytes([int(s[3:5], 16)]))
        else:
            out.append(s.replace("\u2581", " ").encode())
    return out, specials


def _byte_to_unicode() -> dict[int, str]:
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    rest = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(rest)}}


class _Wrapper:
    """The shape llguidance's TokenizerWrapper reads: token bytes, special ids, a str -> ids function."""

    def __init__(self, tok: HFTokenizer, tokens: list[bytes], specials: list[int], eos: int):
        self.tokens, self.special_token_ids, self.eos_token_id, self.bos_token_id = tokens, specials, eos, None
        self._tok = tok

    def __call__(self, text: str | bytes) -> list[int]:
        s = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        return self._tok.encode(s, add_special_tokens=False).ids


class GrammarVocab:
    """A model's vocabulary as the grammar engine sees it, plus a cache of compiled grammars (compiling a JSON
    schema costs milliseconds; a request starts from a copy of the compiled matcher, which costs microseconds)."""

    def __init__(self, tok: HFTokenizer, vocab_size: int, stop_ids: Sequence[int], cache_size: int = 128):
        tokens, specials = token_bytes(tok, vocab_size)
        self.vocab_size, self.stop_ids = vocab_size, frozenset(stop_ids)
        # special tokens other than the stop tokens, and ids with no bytes, are never grammar output (llguidance
        # lets some through at a JSON start), so every mask is and-ed with the ids that may ever be produced
        self.never = frozenset(i for i, b in enumerate(tokens) if not b or (b.startswith(SPECIAL) and i not in
                                                                           self.stop_ids))
        self.producible = new_bitmask(1, vocab_size)[0] - 1
        for i in self.never:
            self.producible[i // 32] &= ~(1 << (i % 32))
        wrapper = _Wrapper(tok, tokens, specials, min(stop_ids))
        self.tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapper), n_vocab=vocab_size,
                                          eos_token=sorted(stop_ids))
        self._compiled: OrderedDict[ConstraintSpec, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size

    def compile(self, spec: ConstraintSpec) -> llguidance.LLMatcher:
        """The pristine matcher of `spec` (cached); raises ConstraintError for what cannot be honoured."""
        if spec in self._compiled:
            self._compiled.move_to_end(spec)
            return self._compiled[spec]
        m = llguidance.LLMatcher(self.tok, self._grammar(spec), log_level=0)
        if m.is_error():
            raise _compile_error(spec, m.get_error())
        self._check_expressible(spec, m)
        self._compiled[spec] = m
        if len(self._compiled) > self._cache_size:
            self._compiled.popitem(last=False)
        return m

    def matcher(self, spec: ConstraintSpec) -> "Matcher":
        return Matcher(self.compile(spec).deep_copy(), self)

    def _grammar(self, spec: ConstraintSpec) -> str:
        M = llguidance.LLMatcher
        if spec.kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if spec.kind == "json_schema":
            try:
                return M.grammar_from_json_schema(spec.text, defaults=JSON_OPTIONS)
            except ValueError as e:
                raise ConstraintError(spec.field, f"is not a valid JSON schema: {e}") from e
        if spec.kind == "regex":
            return M.grammar_from_regex(spec.text)
        if spec.kind == "choice":
            return M.grammar_from_regex("|".join(re.escape(o) for o in json.loads(spec.text)))
        return M.grammar_from_lark(spec.text)

    def _check_expressible(self, spec: ConstraintSpec, m: llguidance.LLMatcher) -> None:
        """A grammar whose first token the vocabulary cannot spell (a JSON object for a model with no `{`), or
        a choice it cannot spell, is refused up front rather than decoded into a dead end."""
        if spec.kind == "choice":
            for o in json.loads(spec.text):
                if self.tok.decode_str(self.tok.tokenize_str(o)) != o:
                    raise ConstraintError(spec.field, f"the model's vocabulary cannot express the choice {o!r}")
        mask = torch.zeros(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        m.deep_copy().unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        if not m.is_accepting() and not bool((mask & self.producible).any()):
            raise ConstraintError(spec.field, f"the model's vocabulary cannot express this {spec.kind}: no token "
                                  "of the vocabulary can start an output it allows")


def _compile_error(spec: ConstraintSpec, message: str) -> ConstraintError:
    """llguidance's message as a ConstraintError naming the unsupported feature where it names one."""
    first = message.strip().splitlines()[0] if message.strip() else "cannot be compiled"
    if m := re.search(r"Unimplemented keys: \[([^\]]*)\]", message):
        keys = [k.strip().strip('"') for k in m.group(1).split(",")]
        return ConstraintError(spec.field, f"uses the JSON schema keyword(s) {', '.join(keys)}, which structured "
                               "output does not support", feature=keys[0])
    if "look-around" in message or "backreferences" in message:
        feature = "look-around" if "look-around" in message else "backreferences"
        return ConstraintError(spec.field, f"uses regex {feature}, which structured output does not support",
                               feature=feature)
    if "retriev" in message:
        return ConstraintError(spec.field, "refers to an external $ref, which structured output does not fetch",
                               feature="$ref")
    return ConstraintError(spec.field, f"cannot be compiled: {first}")


class Matcher:
    """One request's grammar state: the tokens it has accepted, in order (the frontier's past)."""

    def __init__(self, m: llguidance.LLMatcher, vocab: GrammarVocab):
        self._m, self.stop_ids, self._vocab = m, vocab.stop_ids, vocab
        self.accepted: list[int] = []
        self.stopped = False  # a stop token was accepted: the output ends there, later tokens are not grammar's

    def restore(self, tokens: Sequence[int]) -> None:
        """Bring a fresh matcher to the state after `tokens` (a request moved or replayed elsewhere)."""
        if self.advance(tokens, -1) != len(tokens):
            raise ValueError("the tokens were not accepted by this grammar")

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Allowed next tokens into bitmask[row] (int32 words, bit i of word w = token 32 w + i); all
        allowed once stopped (those tokens are cut from the output anyway)."""
        if self.stopped:
            bitmask[row] = -1
        else:
            self._m.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), bitmask.shape[1] * 4)
            bitmask[row] &= self._vocab.producible

    def advance(self, proposals: Sequence[int], mask_id: int) -> int:
        """Accept the longest run of `proposals` the grammar allows (up to a `mask_id`); returns its length."""
        if self.stopped:
            k = next((i for i, t in enumerate(proposals) if t == mask_id), len(proposals))
            self.accepted += proposals[:k]
            return k
        run = list(proposals)
        run = run[: next((i for i, t in enumerate(run) if t in self._vocab.never), len(run))]
        k = self._m.validate_tokens(run)
        if k and not self._m.consume_tokens(run[:k]):
            raise RuntimeError(f"grammar matcher refused tokens it validated: {self._m.get_error()}")
        if k < len(run) and run[k] in self.stop_ids and self._m.is_accepting():
            self._m.consume_token(run[k])  # a stop token ends a complete output (the check may stop short of it)
            k += 1
        self.accepted += run[:k]
        if any(t in self.stop_ids for t in run[:k]):
            self.stopped = True
            return k + self.advance(run[k:], mask_id)
        return k

    def forced(self) -> list[int]:
        """Tokens the grammar allows as the only continuation (jump-forward); [] when there is a choice."""
        return [] if self.stopped else self._m.compute_ff_tokens()


@dataclass
class Settled:
    tokens: list[int]  # the row's tokens after the walk (rejected proposals masked, forced tokens written)
    frontier: int  # index of the first position not accepted
    remasked: int  # proposals the grammar rejected (masked again)
    forced: int  # tokens written by jump-forward


def settle(matcher: Matcher, tokens: Sequence[int], frontier: int, limit: int, mask_id: int,
           jump: bool = True) -> Settled:
    """Walk `tokens` from `frontier` (the first position not yet accepted) to `limit`: accept the longest run
    the grammar allows; mask the first rejected proposal (the ones after it stay provisional); at a mask,
    write the grammar's only continuation when it has one (jump-forward) and walk on."""
    out, remasked, forced = list(tokens), 0, 0
    while frontier < limit:
        frontier += matcher.advance(out[frontier:limit], mask_id)
        if frontier >= limit:
            break
        if out[frontier] != mask_id:
            remasked, out[frontier] = remasked + 1, mask_id
        ff = matcher.forced()[: limit - frontier] if jump else []
        if not ff:
            break
        out[frontier: frontier + len(ff)] = ff
        forced += len(ff)
    return Settled(out, frontier, remasked, forced)


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [n, V] with every token not allowed by bitmask [n, ceil(V / 32)] set to -inf, in place."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, : logits.shape[-1]]
    return logits.masked_fill_(allowed.to(logits.device) == 0, float("-inf"))


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.zeros(rows, (vocab_size + 31) // 32, dtype=torch.int32)
