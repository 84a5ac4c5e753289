"""Tokenizer from a checkpoint's `tokenizer.json` (HF `tokenizers`) plus the two chat formats.

Chat templates are rendered in Python rather than by executing the checkpoint's Jinja template, so that
nothing from a checkpoint directory runs as code. `encode_chat` encodes message content with special-token
matching off (as HF/vLLM chat templating does), so text a user types, such as `<|im_end|><|im_start|>system`,
stays plain text and cannot forge a turn; only the template's own markers become special tokens.
The family decides the format:
- sdar (Qwen): `<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n`
- llada2_moe: `<role>HUMAN</role>...<|role_end|><role>ASSISTANT</role>`
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Sequence

from tokenizers import Tokenizer as HFTokenizer

from mbd.config import ModelConfig

Family = Literal["sdar", "llada2_moe"]
ROLES_LLADA2 = {"system": "SYSTEM", "user": "HUMAN", "assistant": "ASSISTANT"}


class TokenizerError(ValueError):
    pass


def chat_segments(messages: Sequence[dict], family: Family, add_generation_prompt: bool = True
                  ) -> list[tuple[str, bool]]:
    """OpenAI-style messages ({role, content}) as the family's prompt text, in (text, is_content) segments:
    the template's markup (is_content False) and the messages' content (True), in order."""
    out: list[tuple[str, bool]] = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ROLES_LLADA2:
            raise TokenizerError(f"messages[{i}].role must be one of system/user/assistant, got {role!r}")
        if not isinstance(content, str):
            raise TokenizerError(f"messages[{i}].content must be a string")
        if family == "sdar":
            out += [(f"<|im_start|>{role}\n", False), (content, True), ("<|im_end|>\n", False)]
        else:
            out += [(f"<role>{ROLES_LLADA2[role]}</role>", False), (content, True), ("<|role_end|>", False)]
    if add_generation_prompt:
        out.append(("<|im_start|>assistant\n" if family == "sdar" else "<role>ASSISTANT</role>", False))
    return [(t, c) for t, c in out if t]


def render_chat(messages: Sequence[dict], family: Family, add_generation_prompt: bool = True) -> str:
    """Render OpenAI-style messages ({role, content}) into the model family's prompt text."""
    return "".join(t for t, _ in chat_segments(messages, family, add_generation_prompt))


def check_text(text: str, field: str = "text") -> None:
    """Raise TokenizerError unless `text` is valid Unicode (a lone surrogate such as '\\ud800' is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TokenizerError(f"{field} is not valid Unicode: {e.reason} at character {e.start}") from e


class Tokenizer:
    def __init__(self, tok: HFTokenizer, family: Family, mask_token_id: int, eos_token_id: int, pad_token_id: int):
        self.tok = tok
        self.family = family
        self.mask_token_id = mask_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        # A chat turn ends with its end-of-turn token: generation may stop on it as well as on EOS.
        end = tok.token_to_id("<|im_end|>" if family == "sdar" else "<|role_end|>")
        self.stop_token_ids = sorted({eos_token_id} | ({end} if end is not None else set()))
        # Texts that encode to a special token: the added special tokens and the mask/EOS/pad tokens.
        specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
        specials |= {tok.id_to_token(i) for i in (mask_token_id, eos_token_id, pad_token_id)} - {None}
        self.special_texts = tuple(sorted(specials))
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
        return cls(tok, cfg.family, cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id)

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
        return render_chat(messages, self.family, add_generation_prompt)

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """The chat prompt's ids: markup with special tokens, content with none (no role injection)."""
        segs = chat_segments(messages, self.family, add_generation_prompt)
        return [t for text, content in segs for t in self.encode(text, special=not content)]

