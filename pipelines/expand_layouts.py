"""Ray Data job: expand a prompt/response corpus into MultiTF training rows (Parquet shards).

Each clean sequence becomes |Lambda| = (Gmax+2)(Gmax-1)/2 + N_rand rows, one per group-layout, with
noisy ids and small per-block arrays (schema: `mbd.multitf.corrupt.ROW_SCHEMA`; never an L x L mask).
The algorithms live in `mbd.multitf`; this module only moves data.

Input: `.jsonl`/`.json` files (one JSON record per line) and `.parquet` files, given as files or
directories (resolved on the driver, so they must be local or on a filesystem shared by the cluster).
A record has either `prompt` + `response` strings or `messages` (a list of {role, content}); for
`messages` the LAST assistant message is the response and the messages before it are the prompt.

Stages:
1. read: JSONL files as raw bytes, split into lines in a task (one undecodable line is quarantined,
   the file is not lost); Parquet with `read_parquet`, each row serialised to JSON.
2. tokenize (`map_batches`, pyarrow): chat template (`Tokenizer.render_chat` + generation prompt),
   response ids + EOS, pad with the pad token to a multiple of B. Bad records get a `reason`:
   undecodable | invalid_schema | empty_response | invalid_unicode (lone surrogates: text no tokenizer
   can encode) | special_token_text (a special token's text, e.g. the mask token, in the prompt or the
   response: it would become that token in the training targets) | unencodable (the tokenizer failed) |
   too_long (padded length > max_length).
3. expand (`map_batches`, pyarrow): ONE input row -> |Lambda| output rows. map_batches may return a
   different number of rows than it receives; that is intended here.
4. write: rows to `<output_dir>/rows/*.parquet`, bad records (reason, source, record) to
   `<output_dir>/quarantine/*.json` (JSON lines). The job never fails because of one bad record.

Determinism: seq_id is a 63-bit BLAKE2b hash of the canonical record JSON, and every random draw is
keyed by (seed, seq_id, epoch, layout_index), so a re-run gives the same set of rows whatever the file
order or sharding (file names and row order inside the shards may differ). Exact duplicate records get
the same seq_id and therefore the same noise: deduplicate upstream if that matters.

Run:
    python -m pipelines.expand_layouts --config configs/expand/x.yaml        # local ray.init()
    mbd expand --config configs/expand/x.yaml --epoch 1                       # flags override YAML
    ray job submit --working-dir . -- python -m pipelines.expand_layouts --config configs/expand/x.yaml
`ray.init()` joins the cluster named by RAY_ADDRESS (set by `ray job submit`) or starts a local one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray
import yaml
from pydantic import BaseModel, ConfigDict, Field

from mbd.config import ConfigError, ModelConfig, read_json, validate
from mbd.multitf.corrupt import ROW_SCHEMA, expand_sequence
from mbd.multitf.layouts import num_layouts
from mbd.multitf.schedulers import SchedulerConfig, build_scheduler
from mbd.tokenizer import Tokenizer

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
QUARANTINE_RECORD_CHARS = 4000  # a quarantined record is kept for inspection, truncated


class ExpandConfig(BaseModel):
    """Inputs, tokenizer and MultiTF expansion settings (tab:appendix_train_hparams)."""

    model_config = ConfigDict(extra="forbid")

    inputs: list[str] = Field(min_length=1, description="JSONL/Parquet files or directories")
    output_dir: str
    model_dir: str = Field(description="directory with config.json and tokenizer.json")
    block_size: int | None = Field(default=None, gt=0, description="B; default: the model's block_size")
    max_length: int = Field(default=2048, gt=0, description="padded prompt + response tokens")
    gmax: int = Field(default=4, ge=2, description="G_max, largest noise-group")
    n_rand: int = Field(default=0, ge=0, description="N_rand, random group-layouts per sequence")
    scheduler: SchedulerConfig = SchedulerConfig()
    seed: int = Field(default=0, ge=0)
    epoch: int = Field(default=0, ge=0)
    sequences_per_task: int = Field(default=32, gt=0, description="records per block: the unit of parallelism")


class ExpandSummary(BaseModel):
    """What the job did; printed as JSON by `main`. rows/s covers read + tokenize + expand + write."""

    sequences_in: int
    sequences_ok: int
    quarantined: int
    quarantine_reasons: dict[str, int]
    layouts_per_sequence: int
    rows_out: int
    elapsed_s: float
    rows_per_s: float
    rows_dir: str
    quarantine_dir: str | None


class BadRecord(ValueError):
    """A record that goes to quarantine; `reason` is one of the job summary's quarantine_reasons keys."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


# ---------------------------------------------------------------- arrow schemas

def _arrow_type(dtype: str) -> pa.DataType:
    scalar = {"int64": pa.int64(), "int32": pa.int32(), "float32": pa.float32(), "string": pa.string()}
    if dtype.startswith("list<"):
        return pa.list_(scalar[dtype[5:dtype.index(">")]])
    return scalar[dtype]


ROWS_ARROW_SCHEMA = pa.schema([(name, _arrow_type(dtype)) for name, (dtype, _) in ROW_SCHEMA.items()])
TOKENIZED_SCHEMA = pa.schema([
    ("seq_id", pa.int64()), ("clean_ids", pa.list_(pa.int32())), ("prompt_len", pa.int32()),
    ("response_len", pa.int32()), ("reason", pa.string()), ("source", pa.string()), ("record", pa.string()),
])


def rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Training rows (dicts of numpy arrays) -> Arrow table with ROWS_ARROW_SCHEMA, built column-wise."""
    cols = []
    for field in ROWS_ARROW_SCHEMA:
        values = [r[field.name] for r in rows]
        if pa.types.is_list(field.type):
            offsets = np.zeros(len(values) + 1, dtype=np.int32)
            np.cumsum([len(v) for v in values], out=offsets[1:])
            flat = np.concatenate(values) if values else np.zeros(0)
            cols.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=field.type.value_type)))
        else:
            cols.append(pa.array(values, type=field.type))
    return pa.Table.from_arrays(cols, schema=ROWS_ARROW_SCHEMA)


# ---------------------------------------------------------------- records -> token ids

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
    cfg = ModelConfig.from_hf(read_json(Path(model_dir) / "config.json"))
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


def tokenize_batch(batch: pa.Table, *, model_dir: str, block_size: int, max_length: int) -> pa.Table:
    """Columns `record` (JSON text or None if undecodable) + `source` -> TOKENIZED_SCHEMA rows."""
    tok, _ = load_tokenizer(model_dir)
    out: dict[str, list] = {name: [] for name in TOKENIZED_SCHEMA.names}
    for text, source in zip(batch.column("record").to_pylist(), batch.column("source").to_pylist()):
        try:
            if text is None:
                raise BadRecord("undecodable", "line is not valid UTF-8")
            seq_id, ids, p_len, r_len = tokenize_record(text, tok, block_size, max_length)
            reason, kept = None, None
        except BadRecord as e:
            seq_id, ids, p_len, r_len = -1, [], 0, 0
            record = (text or "")[:QUARANTINE_RECORD_CHARS].encode("utf-8", "backslashreplace").decode("utf-8")
            reason, kept = e.reason, f"{e}; record: {record}"
        for name, value in zip(TOKENIZED_SCHEMA.names, (seq_id, ids, p_len, r_len, reason, source, kept)):
            out[name].append(value)
    return pa.table(out, schema=TOKENIZED_SCHEMA)


# ---------------------------------------------------------------- readers

def split_jsonl(batch: pa.Table) -> pa.Table:
    """Whole-file bytes -> one row per non-empty line; undecodable lines become record=None."""
    records, sources = [], []
    for data, path in zip(batch.column("bytes").to_pylist(), batch.column("path").to_pylist()):
        for line_no, line in enumerate(data.split(b"\n"), start=1):
            if not line.strip():
                continue
            try:
                records.append(line.decode("utf-8"))
            except UnicodeDecodeError:
                records.append(None)
            sources.append(f"{path}:{line_no}")
    return pa.table({"record": pa.array(records, pa.string()), "source": pa.array(sources, pa.string())})


def parquet_to_records(batch: pa.Table) -> pa.Table:
    """Parquet rows -> canonical JSON text per row (the same seq_id as the equivalent JSONL record)."""
    paths = batch.column("path").to_pylist() if "path" in batch.column_names else ["<parquet>"] * batch.num_rows
    rows = batch.drop_columns(["path"]).to_pylist() if "path" in batch.column_names else batch.to_pylist()
    # null columns (a file mixing prompt/response and messages rows) are dropped, as in the JSONL record
    rows = [{k: v for k, v in r.items() if v is not None} for r in rows]
    return pa.table({
        "record": pa.array([json.dumps(r, ensure_ascii=False, default=str) for r in rows], pa.string()),
        "source": pa.array(paths, pa.string()),
    })


def resolve_inputs(inputs: Sequence[str]) -> tuple[list[str], list[str]]:
    """(jsonl files, parquet files) from files and directories."""
    jsonl, parquet = [], []
    for item in inputs:
        p = Path(item)
        if not p.exists():
            raise FileNotFoundError(f"inputs: {item} does not exist")
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        for f in files:
            if f.name.endswith(JSONL_SUFFIXES):
                jsonl.append(str(f))
            elif f.name.endswith(PARQUET_SUFFIXES):
                parquet.append(str(f))
            elif not p.is_dir():
                raise ValueError(f"inputs: {f} must end in {JSONL_SUFFIXES + PARQUET_SUFFIXES}")
    if not jsonl and not parquet:
        raise ValueError(f"inputs: no {JSONL_SUFFIXES + PARQUET_SUFFIXES} files found in {list(inputs)}")
    return jsonl, parquet


def read_records(inputs: Sequence[str]) -> ray.data.Dataset:
    jsonl, parquet = resolve_inputs(inputs)
    parts = []
    if jsonl:
        raw = ray.data.read_binary_files(jsonl, include_paths=True)
        parts.append(raw.map_batches(split_jsonl, batch_format="pyarrow", batch_size=1))
    if parquet:
        parts.append(ray.data.read_parquet(parquet, include_paths=True)
                     .map_batches(parquet_to_records, batch_format="pyarrow"))
    return parts[0] if len(parts) == 1 else parts[0].union(*parts[1:])


# ---------------------------------------------------------------- expansion

def select(batch: pa.Table, *, bad: bool) -> pa.Table:
    """Keep quarantined rows (bad=True) or good rows, with the columns the next stage needs."""
    is_bad = batch.column("reason").is_valid()
    kept = batch.filter(is_bad if bad else pc.invert(is_bad))
    cols = ["reason", "source", "record"] if bad else ["seq_id", "clean_ids", "prompt_len", "response_len"]
    return kept.select(cols)


def expand_batch(batch: pa.Table, *, cfg_json: str, block_size: int, mask_token_id: int) -> pa.Table:
    """N sequences -> N * |Lambda| training rows (the row count changes on purpose)."""
    cfg = ExpandConfig.model_validate_json(cfg_json)
    scheduler = build_scheduler(cfg.scheduler)
    rows: list[dict[str, Any]] = []
    for seq_id, ids, p_len, r_len in zip(*(batch.column(c).to_pylist() for c in
                                            ("seq_id", "clean_ids", "prompt_len", "response_len"))):
        rows += expand_sequence(np.asarray(ids, dtype=np.int32), p_len, r_len, block_size=block_size,
                                gmax=cfg.gmax, n_rand=cfg.n_rand, scheduler=scheduler,
                                mask_token_id=mask_token_id, seed=cfg.seed, seq_id=seq_id, epoch=cfg.epoch)
    return rows_to_table(rows)


def run_expand(cfg: ExpandConfig) -> ExpandSummary:
    """Run the expansion job on the current Ray cluster (ray.init() if none is connected)."""
    if not ray.is_initialized():
        ray.init()
    _, model_cfg = load_tokenizer(cfg.model_dir)
    block_size = cfg.block_size or model_cfg.block_size
    start = time.perf_counter()
    # Re-block by record count: one large JSONL file would otherwise be tokenized and expanded by one task.
    tokenized = read_records(cfg.inputs).repartition(target_num_rows_per_block=cfg.sequences_per_task).map_batches(
        tokenize_batch, batch_format="pyarrow",
        fn_kwargs=dict(model_dir=cfg.model_dir, block_size=block_size, max_length=cfg.max_length),
    ).materialize()
    good = tokenized.map_batches(select, batch_format="pyarrow", fn_kwargs=dict(bad=False))
    bad = tokenized.map_batches(select, batch_format="pyarrow", fn_kwargs=dict(bad=True)).materialize()

    out = Path(cfg.output_dir)
    rows_dir, quarantine_dir = out / "rows", out / "quarantine"
    good.map_batches(
        expand_batch, batch_format="pyarrow", batch_size=cfg.sequences_per_task,
        fn_kwargs=dict(cfg_json=cfg.model_dump_json(), block_size=block_size, mask_token_id=model_cfg.mask_token_id),
    ).write_parquet(str(rows_dir))
    quarantined = bad.count()
    reasons = Counter(r for b in bad.select_columns(["reason"]).iter_batches(batch_format="pyarrow")
                      for r in b.column("reason").to_pylist())
    if quarantined:
        bad.write_json(str(quarantine_dir))
    elapsed = time.perf_counter() - start
    rows_out = sum(pq.ParquetFile(f).metadata.num_rows for f in rows_dir.glob("*.parquet"))
    sequences_in = tokenized.count()
    return ExpandSummary(
        sequences_in=sequences_in, sequences_ok=sequences_in - quarantined, quarantined=quarantined,
        quarantine_reasons=dict(sorted(reasons.items())), layouts_per_sequence=num_layouts(cfg.gmax, cfg.n_rand),
        rows_out=rows_out, elapsed_s=round(elapsed, 3), rows_per_s=round(rows_out / max(elapsed, 1e-9), 1),
        rows_dir=str(rows_dir), quarantine_dir=str(quarantine_dir) if quarantined else None,
    )


# ---------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mbd expand", description="Expand a corpus into MultiTF rows (Ray Data).")
    ap.add_argument("--config", help="YAML file with ExpandConfig fields; flags override it")
    ap.add_argument("--input", dest="inputs", action="append", help="JSONL/Parquet file or directory (repeatable)")
    ap.add_argument("--output-dir", dest="output_dir")
    ap.add_argument("--model-dir", dest="model_dir")
    for flag, typ in (("block-size", int), ("max-length", int), ("gmax", int), ("n-rand", int), ("seed", int),
                      ("epoch", int)):
        ap.add_argument(f"--{flag}", dest=flag.replace("-", "_"), type=typ)
    ap.add_argument("--scheduler", dest="name", choices=["chain_uniform", "d2f", "random", "random_iid", "sorted_uniform"])
    for flag in ("t-low", "t-high", "rho", "gamma-rand"):
        ap.add_argument(f"--{flag}", dest=flag.replace("-", "_"), type=float)
    return ap


def config_from_args(argv: Sequence[str] | None) -> ExpandConfig:
    args = vars(build_parser().parse_args(argv))
    path = args.pop("config")
    data: dict[str, Any] = {}
    if path:
        if not Path(path).is_file():
            raise ConfigError(f"--config: file not found: {path}")
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of ExpandConfig fields")
    sched = {k: args.pop(k) for k in ("name", "t_low", "t_high", "rho", "gamma_rand")}
    data.update({k: v for k, v in args.items() if v is not None})
    data["scheduler"] = {**data.get("scheduler", {}), **{k: v for k, v in sched.items() if v is not None}}
    return validate(ExpandConfig, data, path or "command line")


def main(argv: Sequence[str] | None = None) -> int:
    summary = run_expand(config_from_args(argv))
    print(summary.model_dump_json(indent=2))
    return 0


if __name__ == "__main__":
    # Re-import under the package name so Ray pickles the stage functions by reference, not from __main__.
    from pipelines.expand_layouts import main as package_main

    sys.exit(package_main())
