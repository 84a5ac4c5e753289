"""Corpus records -> block-aligned token sequences: the one place that decides what a training record is.

Pure Python (no Ray, no Arrow), shared by the `mbd expand` Ray Data job and on-the-fly training, so both
tokenize a record identically. A record that cannot become a training sequence raises `BadRecord` with a
reason the caller counts and quarantines; no record can fail a whole job:
undecodable | invalid_schema | empty_response | invalid_unicode (lone surrogates: text no tokenizer can
encode) | special_token_text (a special token's text, e.g. the mask token, in the prompt or the response: it
would become that token in the training targets) | unencodable (the tokenizer failed) | too_long (padded
length > max_length; left out, never truncated: a cut answer would teach the model to stop mid-answer).
"""

from __future__ import annotations

import hashlib
import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

from mbd.checkpoint_files import read_model_config
from mbd.config import ModelConfig
from mbd.tokenizer import Tokenizer


class BadRecord(ValueError):
    """A record that goes to quarantine; `reason` is one of the job summary's quarantine_reasons keys."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def parse_record(record: Any) -> tuple[list[dict], str]:
    """(prompt messages, response text) from a prompt/response or chat-messages record."""
    if not isinstance(record, dict):
        raise BadRecord("invalid_schema", f"record must be a JSON object, got {type(record).__name__}")
    if record.get("messages") is not None:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
            raise BadRecord("invalid_schema", "'messages' must be a list of {role, content} objects")
        last = max((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), default=None)
        if last is None:
            raise BadRecord("invalid_schema", "'messages' has no assistant message to use as the response")
        bad = [i for i, m in enumerate(msgs[: last + 1])
               if m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str)]
        if bad:
            raise BadRecord("invalid_schema", f"messages[{bad[0]}] needs role system/user/assistant and string content")
        context, response = [dict(role=m["role"], content=m["content"]) for m in msgs[:last]], msgs[last]["content"]
    elif "prompt" in record and "response" in record:
        if not isinstance(record["prompt"], str) or not isinstance(record["response"], str):
            raise BadRecord("invalid_schema", "'prompt' and 'response' must be strings")
        context, response = [{"role": "user", "content": record["prompt"]}], record["response"]
    else:
        raise BadRecord("invalid_schema", "record needs 'prompt' + 'response' or 'messages'")
    if not response.strip():
        raise BadRecord("empty_response", "the response is empty")
    return context, response


@lru_cache(maxsize=4)
def load_tokenizer(model_dir: str) -> tuple[Tokenizer, ModelConfig]:
    """Tokenizer and model config of a checkpoint directory (cached once per worker process)."""
    cfg = read_model_config(model_dir)
    return Tokenizer.from_dir(model_dir, cfg), cfg


def seq_id_of(record: Any) -> int:
    canonical = json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return int.from_bytes(hashlib.blake2b(canonical.encode(), digest_size=8).digest(), "big") >> 1


def tokenize_record(text: str, tok: Tokenizer, block_size: int, max_length: int) -> tuple[int, list[int], int, int]:
    """(seq_id, padded clean ids, prompt_len, response_len incl. EOS) of one JSON record line."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRecord("undecodable", f"not valid JSON: {e}") from e
    context, response = parse_record(record)
    texts = [("response", response)] + [(f"prompt message {i}", m["content"]) for i, m in enumerate(context)]
    for where, t in texts:
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRecord("invalid_unicode", f"the {where} is not valid Unicode ({e.reason} at {e.start})") from None
        if (special := tok.special_text_in(t)) is not None:
            raise BadRecord("special_token_text", f"the {where} contains the special token text {special!r}")
    try:
        prompt = tok.encode(tok.render_chat(context, add_generation_prompt=True))
        answer = tok.encode(response) + [tok.eos_token_id]
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
        raise BadRecord("unencodable", f"the tokenizer failed: {type(e).__name__}: {str(e)[:200]}") from None
    total = len(prompt) + len(answer)
    padded = math.ceil(total / block_size) * block_size
    if padded > max_length:
        raise BadRecord("too_long", f"{padded} tokens after padding to B={block_size} > max_length={max_length}")
    ids = prompt + answer + [tok.pad_token_id] * (padded - total)
    return seq_id_of(record), ids, len(prompt), len(answer)
