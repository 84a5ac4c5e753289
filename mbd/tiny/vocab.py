"""The tiny model's char-level `tokenizer.json`, built with the HuggingFace `tokenizers` library.

One token per character keeps the vocabulary tiny (small embedding and head) and makes every task
character its own prediction, which is what the block-size-4 model is trained on. The SDAR/Qwen chat
markers are single special tokens, so `<|im_start|>user\\n3*4+2*7-5<|im_end|>\\n...` costs one token per
character plus one per marker. The alphabet covers the task, the chat roles and plain lowercase text;
any other character encodes to `<|unk|>` instead of failing.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

EOS = "<|endoftext|>"  # end of sequence, also the padding token (a BD-LM learns to emit it after the answer)
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
MASK = "<|MASK|>"
UNK = "<|unk|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS, IM_START, IM_END, MASK, UNK)
ALPHABET: str = string.digits + string.ascii_lowercase + " \n+-*/=;#()?.,:"


def vocab() -> dict[str, int]:
    """Special tokens first (ids 0-4), then the alphabet in a fixed order: ids never depend on the data."""
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(ALPHABET))}


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel(vocab(), unk_token=UNK))
    # `[\s\S]` rather than `.`: the character class also matches newlines, so `\n` stays one token.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins tokens with nothing in between (the default decoder would insert spaces).
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def tokenizer_config() -> dict:
    """HF-style `tokenizer_config.json`. It ships no Jinja `chat_template`: `mbd.tokenizer` then uses the
    built-in sdar (ChatML) template (`mbd.chat_template`); `chat_template_family` only names it for readers."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "mask_token": MASK,
        "unk_token": UNK,
        "bos_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "chat_template_family": "sdar",
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
    }


def special_token_ids() -> dict[str, int]:
    """Ids for `ModelConfig` (mask_token_id, eos_token_id, pad_token_id) and the end-of-turn marker."""
    v = vocab()
    return {"mask_token_id": v[MASK], "eos_token_id": v[EOS], "pad_token_id": v[EOS], "im_end_id": v[IM_END]}


def save_tokenizer(directory: str | Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json into `directory` (created if missing)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    return d
