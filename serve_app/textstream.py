"""Incremental detokenization with stop strings, for committed blocks arriving over time (the engine itself
already cuts its output at the first stop token).

Text is released only once it can no longer change: a byte-level BPE token may end inside a UTF-8 character
(decoded as U+FFFD until its continuation arrives), and a stop string may straddle two blocks, so the tail
that could still become a stop string is held back. Concatenating everything `push` and `finish` return
gives exactly the non-streaming text.

Tokens are accounted the same way: `returned_tokens` are those that produced the returned text (a stop
string cuts the committed block, and the tokens after it were never returned: usage must not count them),
and `released_tokens` those that produced the text released so far (their log-probabilities can be sent).
"""

from __future__ import annotations

from typing import Sequence

from mbd.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self.tok = tokenizer
        self.stop = [s for s in stop if s]
        self.token_ids: list[int] = []
        self.stopped = False
        self._text = ""
        self._emitted = 0

    def push(self, ids: Sequence[int]) -> str:
        """Add committed token ids; return the text that became final. Sets `stopped` on a stop string."""
        if self.stopped:
            return ""
        self.token_ids.extend(ids)
        self._text = self.tok.decode(self.token_ids)
        start = max(0, self._emitted - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (self._text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self._text, self.stopped = self._text[: min(hits)], True
        if self.stopped:
            return self._release(len(self._text))
        return self._release(len(self._text) - self._held_back())

    def finish(self) -> str:
        """The engine is done: release whatever was held back."""
        return self._release(len(self._text))

    @property
    def text(self) -> str:
        return self._text

    @property
    def returned_tokens(self) -> int:
        return self._covering(len(self._text)) if self.stopped else len(self.token_ids)

    @property
    def released_tokens(self) -> int:
        return self._covering(self._emitted)

    def _covering(self, n_chars: int) -> int:
        """The fewest leading tokens whose text reaches n_chars characters (binary search over prefixes)."""
        lo, hi = 0, len(self.token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.tok.decode(self.token_ids[:mid])) >= n_chars:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _held_back(self) -> int:
        t = self._text
        hold = len(t) - len(t.rstrip(REPLACEMENT))
        for s in self.stop:
            for k in range(min(len(s) - 1, len(t)), hold, -1):
                if t.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def _release(self, end: int) -> str:
        end = max(end, self._emitted)
        out = self._text[self._emitted:end]
        self._emitted = end
        return out
