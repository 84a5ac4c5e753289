"""Incremental detokenization with stop strings: the one detokenizer of the engine's `stream` and the HTTP ingress.

Committed blocks arrive over time. Each new token is decoded once, by `tokenizers`' `DecodeStream` (it keeps a
small window of previous ids, so a byte-level BPE token that ends inside a UTF-8 character yields nothing until
the character is complete): the cost of a request is linear in its length, not quadratic as re-decoding the
whole output per block would be. A stop string may straddle two blocks, so the tail that could still become a
stop string is held back. Concatenating everything `push` and `finish` return gives exactly the non-streaming
text (the full decode, cut before the first stop string): `finish` reconciles once with a full decode, which
also releases bytes that never formed a character (as U+FFFD, as the full decode shows them).
"""

from __future__ import annotations

from typing import Sequence

from tokenizers.decoders import DecodeStream

from mbd.tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self.tok = tokenizer
        self.stop = [s for s in stop if s]
        self.token_ids: list[int] = []
        self.stopped = False
        self._stream = DecodeStream(skip_special_tokens=True)
        self._text = ""
        self._emitted = 0

    def push(self, ids: Sequence[int]) -> str:
        """Add committed token ids; return the text that became final. Sets `stopped` on a stop string."""
        if self.stopped or not ids:
            return ""
        ids = list(ids)
        self.token_ids.extend(ids)
        chunk = self._stream.step(self.tok.tok, ids)
        if chunk:
            self._text += chunk
            self._cut_at_stop(len(self._text) - len(chunk))
        if self.stopped:
            return self._release(len(self._text))
        return self._release(len(self._text) - self._held_back())

    def finish(self) -> str:
        """The engine is done: reconcile with the full decode and release whatever was held back."""
        if not self.stopped:
            full = self.tok.decode(self.token_ids)
            if full.startswith(self._text[: self._emitted]):
                known = len(self._text)
                self._text = full
                self._cut_at_stop(min(known, len(full)))
        return self._release(len(self._text))

    @property
    def text(self) -> str:
        return self._text

    @property
    def returned_tokens(self) -> int:
        """Tokens that the returned text came from: all of them, or up to the stop string (usage counts these)."""
        return self._covering(len(self._text)) if self.stopped else len(self.token_ids)

    @property
    def released_tokens(self) -> int:
        """Tokens behind the text released so far (continuous usage statistics)."""
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

    def _cut_at_stop(self, new_from: int) -> None:
        """Cut the text before the first stop string that ends after position `new_from`."""
        if not self.stop:
            return
        start = max(0, new_from - max(len(s) for s in self.stop) + 1)
        hits = [i for i in (self._text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self._text, self.stopped = self._text[: max(min(hits), self._emitted)], True

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        t = self._text
        for k in range(min(max((len(s) for s in self.stop), default=1) - 1, len(t)), 0, -1):
            if any(s.startswith(t[-k:]) for s in self.stop):
                return k
        return 0

    def _release(self, end: int) -> str:
        end = max(end, self._emitted)
        out = self._text[self._emitted:end]
        self._emitted = end
        return out
