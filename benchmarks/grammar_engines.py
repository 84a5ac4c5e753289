"""Which grammar engine for structured output: the per-step cost of xgrammar, llguidance and outlines-core.

A diffusion decoder asks its matcher, every step, for (1) the token mask at the first undecided position and
(2) how many of the proposals after it the grammar accepts, left to right. This script times both, plus the
one-off compile, on a byte-level BPE vocabulary trained here on local text (Python's own sources; no download),
for a JSON schema (nested object, array, enum, number, pattern string) and a regex.

Per engine and grammar: compile (ms), mask (us per position: fill the next-token bitmask), advance (us per
token: accept one token) and run check (us per 16-token run: accept up to 16 proposals, then roll back; the
operation a Block Buffer step does). Each engine walks the same token sequence (a valid output, tokenized by
the tokenizer), rounds interleaved A B C C B A, medians over rounds.

    python benchmarks/grammar_engines.py                 # 32k vocabulary, 5 rounds (~2 minutes on 2 cores)
    python benchmarks/grammar_engines.py --vocab 100000  # a Qwen-sized vocabulary takes longer to train
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        "status": {"enum": ["open", "closed", "pending"]},
        "score": {"type": "number"},
        "owner": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                  "required": ["name", "age"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["id", "status", "score", "owner", "tags"],
    "additionalProperties": False,
}
INSTANCE = {"id": "AB-1234", "status": "pending", "score": -12.625,
            "owner": {"name": "Ada Lovelace, Countess of Lovelace", "age": 36},
            "tags": ["analytical engine", "notes", "bernoulli numbers", "poetical science"]}
REGEX = r"[0-9a-z+*/=;() -]{0,200}#### -?[0-9]{1,12}"
REGEX_TEXT = "(3 + 4) * 12 = 84; 84 / 2 = 42; so the answer is forty two #### 42"
RUN = 16


def train_bpe(vocab: int) -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2 / Qwen style) trained on the Python standard library's sources."""
    files = sorted(Path(sys.base_prefix, "lib").glob("python3*/**/*.py"))[:3000]
    texts = [p.read_bytes().decode("utf-8", "ignore") for p in files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def token_bytes(tok: Tokenizer) -> list[bytes]:
    """Each id's bytes (byte-level BPE: undo GPT-2's byte-to-unicode map); special tokens: b""."""
    table = {c: b for b, c in _byte_unicode().items()}
    out = []
    for i in range(tok.get_vocab_size()):
        s = tok.id_to_token(i)
        out.append(b"" if s.startswith("<|") else bytes(table[c] for c in s))
    return out


def _byte_unicode() -> dict[int, str]:
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer, vocab: list[bytes]):
        import xgrammar as xgr

        self.xgr, self.n = xgr, len(vocab)
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.n, stop_token_ids=[0])
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.mask = xgr.allocate_token_bitmask(1, self.n)

    def compile(self, kind: str, spec: str):
        if kind == "json":
            g = self.compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True,
                                                 separators=(",", ":"))
        else:
            g = self.compiler.compile_regex(spec)
        return self.xgr.GrammarMatcher(g, max_rollback_tokens=RUN)

    def fill(self, m) -> None:
        m.fill_next_token_bitmask(self.mask, 0)

    def accept(self, m, t: int) -> bool:
        return m.accept_token(t)

    def run(self, m, toks: list[int]) -> int:
        k = 0
        while k < len(toks) and m.accept_token(toks[k]):
            k += 1
        if k:
            m.rollback(k)
        return k


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Tokenizer, vocab: list[bytes]):
        import llguidance
        import llguidance.torch as llt

        self.llg, self.llt = llguidance, llt
        self.tok = llguidance.LLTokenizer(tok.to_str(), n_vocab=len(vocab), eos_token=[0])
        self.mask = llt.allocate_token_bitmask(1, len(vocab))

    def compile(self, kind: str, spec: str):
        M = self.llg.LLMatcher
        g = (M.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False}) if kind == "json"
             else M.grammar_from_regex(spec))
        m = M(self.tok, g, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def fill(self, m) -> None:
        self.llt.fill_next_token_bitmask(m, self.mask, 0)

    def accept(self, m, t: int) -> bool:
        return m.consume_token(t)

    def run(self, m, toks: list[int]) -> int:
        return m.validate_tokens(toks)  # no state change: nothing to roll back


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok: Tokenizer, vocab: list[bytes]):
        import outlines_core as oc

        self.oc, self.n = oc, len(vocab)
        table: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab):
            if b:
                table.setdefault(b, []).append(i)
        self.vocab = oc.Vocabulary(0, table)
        self.mask = torch.zeros(1, (self.n + 31) // 32, dtype=torch.int32)

    def compile(self, kind: str, spec: str):
        regex = self.oc.json_schema.build_regex_from_schema(spec, None) if kind == "json" else spec
        return self.oc.Guide(self.oc.Index(regex, self.vocab))

    def fill(self, m) -> None:
        m.write_mask_into(self.mask.data_ptr(), self.mask.numel(), 4)

    def accept(self, m, t: int) -> bool:
        m.advance(t)
        return True

    def run(self, m, toks: list[int]) -> int:
        k = 0
        while k < len(toks) and m.accepts_tokens(toks[: k + 1]):
            k += 1
        return k


def walk(engine, kind: str, spec: str, ids: list[int]) -> dict[str, float]:
    """Compile, then walk `ids`: per position fill the mask, check the next RUN proposals, accept one token."""
    t0 = time.perf_counter()
    m = engine.compile(kind, spec)
    compile_ms = 1e3 * (time.perf_counter() - t0)
    fill, adv, run = [], [], []
    for i, t in enumerate(ids):
        a = time.perf_counter()
        engine.fill(m)
        b = time.perf_counter()
        n = engine.run(m, ids[i: i + RUN])
        c = time.perf_counter()
        ok = engine.accept(m, t)
        d = time.perf_counter()
        assert ok and n == min(RUN, len(ids) - i), (engine.name, i, n)
        fill.append(b - a), run.append(c - b), adv.append(d - c)
    us = 1e6
    return {"compile_ms": compile_ms, "mask_us": us * statistics.median(fill),
            "advance_us": us * statistics.median(adv), "run16_us": us * statistics.median(run)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    tok = train_bpe(args.vocab)
    vocab = token_bytes(tok)
    print(f"byte-level BPE: {len(vocab)} tokens, trained in {time.perf_counter() - t0:.1f} s")
    cases = {"json": (json.dumps(SCHEMA), json.dumps(INSTANCE, separators=(",", ":"))), "regex": (REGEX, REGEX_TEXT)}
    engines = [cls(tok, vocab) for cls in (XGrammar, LLGuidance, OutlinesCore)]
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    for r in range(args.rounds):
        for e in engines if r % 2 == 0 else engines[::-1]:
            for kind, (spec, text) in cases.items():
                ids = tok.encode(text).ids
                rows.setdefault((e.name, kind), []).append(walk(e, kind, spec, ids))
    print(f"\n{'engine':14} {'grammar':7} {'compile ms':>11} {'mask us':>8} {'advance us':>11} {'run-16 us':>10}")
    for (name, kind), runs in rows.items():
        med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        print(f"{name:14} {kind:7} {med['compile_ms']:11.1f} {med['mask_us']:8.1f} {med['advance_us']:11.1f} "
              f"{med['run16_us']:10.1f}")


if __name__ == "__main__":
    main()
