"""Tokenizer from a checkpoint's `tokenizer.json` (HF `tokenizers`) plus the two chat formats.

Chat templates are rendered in Python rather than by executing the checkpoint's Jinja template, so that
nothing from a checkpoint directory runs as code. The family decides the format:
- sdar (Qwen): `<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n`
- llada2_moe: `<role>HUMAN</role>...<|role_end|><role>ASSISTANT</role>`
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, Sequence

from tokenizers import Tokenizer as HFTokenizer

from mbd.config import ModelConfig

Family = Literal["sdar", "llada2_moe"]
ROLES_LLADA2 = {"system": "SYSTEM", "user": "HUMAN", "assistant": "ASSISTANT"}


class TokenizerError(ValueError):
    pass


def render_chat(messages: Sequence[dict], family: Family, add_generation_prompt: bool = True) -> str:
    """Render OpenAI-style messages ({role, content}) into the model family's prompt text."""
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ROLES_LLADA2:
            raise TokenizerError(f"messages[{i}].role must be one of system/user/assistant, got {role!r}")
        if not isinstance(content, str):
            raise TokenizerError(f"messages[{i}].content must be a string")
        if family == "sdar":
            out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        else:
            out.append(f"<role>{ROLES_LLADA2[role]}</role>{content}<|role_end|>")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n" if family == "sdar" else "<role>ASSISTANT</role>")
    return "".join(out)


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

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def special_text_in(self, text: str) -> str | None:
        """The first special token's text that occurs in `text` (it would encode to that token), else None."""
        return next((t for t in self.special_texts if t in text), None)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        return render_chat(messages, self.family, add_generation_prompt)

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt))


def save_tokenizer_json(tok: HFTokenizer, path: str | Path, extra: dict | None = None) -> None:
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(extra or {}, indent=2))
