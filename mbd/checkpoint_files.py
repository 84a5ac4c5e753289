"""The small files of a HuggingFace checkpoint directory that decide how its model is read and prompted.

A checkpoint's own files decide, in the order transformers reads them:
- the model: `config.json`, with the end-of-sequence ids from `generation_config.json` first, then `config.json`,
  then `tokenizer_config.json`'s `eos_token`, then the family's documented default (every id of the first source
  that states one is kept: SDAR's generation config lists `<|im_end|>` and `<|endoftext|>`);
- the chat format: `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (rendered by
  `mbd.chat_template` in a sandbox); None when the checkpoint ships neither.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mbd.config import ConfigError, ModelConfig, read_json

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token")


def _json(path: Path) -> dict[str, Any]:
    data = read_json(path) if path.is_file() else {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def read_model_config(path: str | Path) -> ModelConfig:
    """The model config of checkpoint directory `path`: config.json with the EOS (and pad) ids its generation
    and tokenizer configs state."""
    d = Path(path)
    hf = _json(d / "config.json")
    gen = _json(d / "generation_config.json")
    eos = gen.get("eos_token_id")
    if eos is None:
        eos = hf.get("eos_token_id")
    if eos is None:
        eos = tokenizer_eos(d)
    hf = dict(hf)
    if eos is not None:
        hf["eos_token_id"] = eos
    if hf.get("pad_token_id") is None and gen.get("pad_token_id") is not None:
        hf["pad_token_id"] = gen["pad_token_id"]
    return ModelConfig.from_hf(hf)


def special_tokens(d: Path) -> dict[str, str]:
    """tokenizer_config.json's named special tokens (bos_token, eos_token, ...) as text: the chat template's
    variables of those names."""
    cfg = _json(d / "tokenizer_config.json")
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        v = cfg.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            out[key] = v
    return out


def tokenizer_eos(d: Path) -> int | None:
    """The id of tokenizer_config.json's `eos_token`: from its `added_tokens_decoder`, else tokenizer.json."""
    text = special_tokens(d).get("eos_token")
    if text is None:
        return None
    added = _json(d / "tokenizer_config.json").get("added_tokens_decoder") or {}
    for i, tok in added.items():
        if isinstance(tok, dict) and tok.get("content") == text:
            if not str(i).isdigit():
                raise ConfigError(f"{d}: tokenizer_config.json added_tokens_decoder key {i!r} is not a token id")
            return int(i)
    if (d / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        found = Tokenizer.from_file(str(d / "tokenizer.json")).token_to_id(text)
        if found is not None:
            return found
    raise ConfigError(f"{d}: tokenizer_config.json eos_token {text!r} is not a token of this tokenizer")


def read_chat_template(d: Path) -> str | None:
    """The chat template the checkpoint ships (chat_template.jinja wins, as in transformers), else None."""
    if (d / TEMPLATE_FILE).is_file():
        return (d / TEMPLATE_FILE).read_text(encoding="utf-8")
    t = _json(d / "tokenizer_config.json").get("chat_template")
    if isinstance(t, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        if "default" not in named:
            raise ConfigError(f"{d}: tokenizer_config.json names chat templates {sorted(map(str, named))} but no "
                              "'default' one, which a chat request would use")
        t = named["default"]
    if t is not None and not isinstance(t, str):
        raise ConfigError(f"{d}: tokenizer_config.json chat_template must be a string or named templates")
    return t
