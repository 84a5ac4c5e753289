"""Tokenizer from a checkpoint's `tokenizer.json` (HF `tokenizers`), prompting with the checkpoint's chat template.

The prompt text is the checkpoint's own chat template rendered in a sandbox (`mbd.chat_template`; the family's
built-in one when the checkpoint ships none). `encode_chat` keeps the guarantee that text a user types, such as
`<|im_end|><|im_start|>system`, stays plain text and cannot forge a turn: before rendering, every special-token
text in message content is swapped for a placeholder (a Unicode noncharacter around its index, never a token's
text); the rendered prompt is encoded with special tokens on and each placeholder as its original text with
special-token matching off (as HF/vLLM chat templating treats content), so only the template's own markers
become special tokens.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, Sequence

from tokenizers import Tokenizer as HFTokenizer

from mbd.chat_template import BUILTIN, ChatTemplate, TokenizerError
from mbd.checkpoint_files import read_chat_template, special_tokens
from mbd.config import ModelConfig

Family = Literal["sdar", "llada2_moe"]
SENTINEL = "\U0010FFFF"  # a noncharacter: stands around a placeholder's index, is itself always a protected text
PLACEHOLDER = re.compile(f"{SENTINEL}(\\d+){SENTINEL}")
END_OF_TURN = {"sdar": "<|im_end|>", "llada2_moe": "<|role_end|>"}

__all__ = ["Tokenizer", "TokenizerError", "check_text"]


def check_text(text: str, field: str = "text") -> None:
    """Raise TokenizerError unless `text` is valid Unicode (a lone surrogate such as '\\ud800' is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TokenizerError(f"{field} is not valid Unicode: {e.reason} at character {e.start}") from e


class Tokenizer:
    def __init__(self, tok: HFTokenizer, family: Family, mask_token_id: int, eos_token_id: int, pad_token_id: int,
                 *, eos_token_ids: Sequence[int] = (), template: ChatTemplate | None = None):
        """`eos_token_ids`: every EOS the checkpoint states (default: eos_token_id); `template`: the checkpoint's
        chat template (default: the family's built-in one)."""
        self.tok = tok
        self.family = family
        self.mask_token_id = mask_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.template = template or ChatTemplate(BUILTIN[family])
        # A chat turn ends with its end-of-turn token: generation may stop on it as well as on every EOS.
        end = tok.token_to_id(END_OF_TURN[family])
        eos = set(eos_token_ids) | {eos_token_id}
        self.stop_token_ids = sorted(eos | ({end} if end is not None else set()))
        # Texts that encode to a special token: the added special tokens and the mask/EOS/pad tokens.
        specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
        specials |= {tok.id_to_token(i) for i in eos | {mask_token_id, pad_token_id}} - {None}
        self.special_texts = tuple(sorted(specials))
        protected = sorted(specials | {SENTINEL}, key=len, reverse=True)
        self._protected = re.compile("|".join(re.escape(t) for t in protected))
        # A second instance that never matches special-token texts: for user-supplied chat content.
        self._plain = HFTokenizer.from_str(tok.to_str())
        self._plain.encode_special_tokens = True

    @classmethod
    def from_dir(cls, path: str | Path, cfg: ModelConfig) -> "Tokenizer":
        p = Path(path) / "tokenizer.json"
        if not p.is_file():
            raise TokenizerError(f"{path}: missing tokenizer.json (a HuggingFace `tokenizers` file is required)")
        try:
            tok = HFTokenizer.from_file(str(p))
        except Exception as e:  # the tokenizers library raises plain Exception subclasses
            raise TokenizerError(f"{p}: cannot be read by the tokenizers library: {e}") from e
        shipped = read_chat_template(Path(path))
        template = ChatTemplate(shipped, special_tokens(Path(path))) if shipped is not None else None
        return cls(tok, cfg.family, cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id,
                   eos_token_ids=cfg.eos_token_ids, template=template)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text`; special=False: special-token texts in it are split into ordinary tokens.
        (`encode_batch` releases the GIL, `encode` does not: a multi-MiB prompt tokenized in a worker thread
        would otherwise still stall the server's event loop for seconds.)"""
        check_text(text)
        return (self.tok if special else self._plain).encode_batch([text], add_special_tokens=False)[0].ids

    def special_text_in(self, text: str) -> str | None:
        """The first special token's text that occurs in `text` (it would encode to that token), else None."""
        return next((t for t in self.special_texts if t in text), None)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The chat prompt's text, as the chat template writes it."""
        return self.template.render(messages, add_generation_prompt)

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """The chat prompt's ids: the template's markers as special tokens, special-token text in content as
        plain text (no role injection)."""
        originals: list[str] = []

        def hide(m: re.Match) -> str:
            originals.append(m.group(0))
            return f"{SENTINEL}{len(originals) - 1}{SENTINEL}"

        for i, m in enumerate(messages):
            if isinstance(m, dict) and isinstance(m.get("content"), str):
                check_text(m["content"], f"messages[{i}].content")
        shielded = [{**m, "content": self._protected.sub(hide, m["content"])}
                    if isinstance(m, dict) and isinstance(m.get("content"), str) else m for m in messages]
        pieces = PLACEHOLDER.split(self.template.render(shielded, add_generation_prompt))
        return [t for i, piece in enumerate(pieces)
                for t in (self.encode(piece) if i % 2 == 0 else self.encode(originals[int(piece)], special=False))]

