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
2. tokenize (`map_batches`, pyarrow): `mbd.multitf.records.tokenize_record` (chat template, response ids +
   EOS, pads to a multiple of B); a bad record gets its `BadRecord` reason (listed there).
3. expand (`map_batches`, pyarrow): ONE input row -> |Lambda| output rows. map_batches may return a
   different number of rows than it receives; that is intended here.
4. write: rows to `<output_dir>/rows/*.parquet`, bad records (reason, source, record) to
   `<output_dir>/quarantine/*.json` (JSON lines). The job never fails because of one bad record.

Determinism: seq_id is a 63-bit BLAKE2b hash of the canonical record JSON, and every random draw is
keyed by (seed, seq_id, epoch, layout_index), so a re-run gives the same set of rows whatever the file
order or sharding (file names and row order inside the shards may differ). Exact duplicate records get
the same seq_id and therefore the same noise: deduplicate upstream if that matters.

Run:
    python -m pipelines.expand_layouts --config configs/expand/x.yaml        # a local cluster of its own
    mbd expand --config configs/expand/x.yaml --epoch 1                       # flags override YAML
    ray job submit --working-dir . -- python -m pipelines.expand_layouts --config configs/expand/x.yaml
It joins the cluster named by RAY_ADDRESS (set by `ray job submit`), else starts a local one of its own
(`pipelines/ray_session.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray
from pydantic import BaseModel, ConfigDict, Field, model_validator

from mbd import storage
from mbd.config import apply_sets, read_yaml, validate
from mbd.hub import resolve_model
from mbd.multitf.corrupt import ROW_SCHEMA, Masking
from mbd.multitf.records import BadRecord, load_tokenizer, tokenize_record
from mbd.multitf.rows import LayoutSection, TokenizedSequence, sequence_rows
from mbd.multitf.schedulers import SchedulerConfig, SchedulerName, build_scheduler
from pipelines.parquet import read_parquet
from pipelines.ray_session import init_ray, ray_cluster

__all__ = ["run_expand", "ExpandConfig", "ExpandSummary", "main"]  # what other pipelines may use

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
QUARANTINE_RECORD_CHARS = 4000  # a quarantined record is kept for inspection, truncated


class ExpandConfig(BaseModel):
    """Inputs, tokenizer and MultiTF expansion settings (tab:appendix_train_hparams)."""

    model_config = ConfigDict(extra="forbid")

    inputs: list[str] = Field(min_length=1, description="JSONL/Parquet files or directories")
    output_dir: str = Field(description="a local directory or a filesystem URI every node sees (file://, s3://, ...)")
    model_dir: str = Field(description="directory with config.json and tokenizer.json (relative: to the working "
                                       "directory, then the repository root), or a Hub id ORG/NAME[@REVISION]")
    block_size: int | None = Field(default=None, gt=0, description="B; default: the model's block_size")
    max_length: int = Field(default=2048, gt=0, description="padded prompt + response tokens")
    mode: Literal["multitf", "d2f"] = Field(default="multitf", description="d2f: the authors' D2F ablation rows")
    gmax: int = Field(default=4, ge=2, description="G_max, largest noise-group")
    n_rand: int = Field(default=0, ge=0, description="N_rand, random group-layouts per sequence")
    scheduler: SchedulerConfig = SchedulerConfig()
    masking: Masking = Field(default="floor_count", description="floor_count (alg:multitf_training) or bernoulli "
                                                                "(eq:forward): mbd.multitf.corrupt")
    seed: int = Field(default=0, ge=0)
    epoch: int = Field(default=0, ge=0, description="epoch key of the rows; training pass p redraws epoch + p")
    sequences_per_task: int = Field(default=32, gt=0, description="records per block: the unit of parallelism")

    @model_validator(mode="after")
    def _check_layouts(self) -> "ExpandConfig":
        self.layouts()  # mode / scheduler / gmax consistency, with LayoutSection's message
        return self

    def layouts(self) -> LayoutSection:
        return LayoutSection(mode=self.mode, gmax=self.gmax, n_rand=self.n_rand, scheduler=self.scheduler,
                             masking=self.masking)


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


# ---------------------------------------------------------------- arrow schemas

def _arrow_type(dtype: str, per: str) -> pa.DataType:
    """A ROW_SCHEMA field's Arrow type: numpy dtype name (or "str"), a list when it has a length."""
    scalar = pa.string() if dtype == "str" else pa.from_numpy_dtype(np.dtype(dtype))
    return pa.list_(scalar) if per else scalar


ROWS_ARROW_SCHEMA = pa.schema([(name, _arrow_type(f.dtype, f.per)) for name, f in ROW_SCHEMA.items()])
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
        parts.append(read_parquet(parquet, include_paths=True)
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
    layouts = cfg.layouts()
    scheduler = build_scheduler(cfg.scheduler)
    rows: list[dict[str, Any]] = []
    for seq_id, ids, p_len, r_len in zip(*(batch.column(c).to_pylist() for c in
                                            ("seq_id", "clean_ids", "prompt_len", "response_len"))):
        seq = TokenizedSequence(seq_id, np.asarray(ids, dtype=np.int32), p_len, r_len)
        rows += sequence_rows(seq, layouts, block_size=block_size, mask_token_id=mask_token_id, seed=cfg.seed,
                              epoch=cfg.epoch, scheduler=scheduler)
    return rows_to_table(rows)


def run_expand(cfg: ExpandConfig) -> ExpandSummary:
    """Run the expansion job on the current Ray cluster (`init_ray` if none is connected)."""
    if not ray.is_initialized():
        init_ray()
    # an absolute directory for the driver and every task (a job's driver and Ray's workers each start in a
    # directory of their own): the path as given, else under the repository root, else a Hub id's snapshot
    model_dir = str(resolve_model(cfg.model_dir).resolve())
    _, model_cfg = load_tokenizer(model_dir)
    block_size = cfg.block_size or model_cfg.training_block_size()
    start = time.perf_counter()
    # Re-block by record count: one large JSONL file would otherwise be tokenized and expanded by one task.
    tokenized = read_records(cfg.inputs).repartition(target_num_rows_per_block=cfg.sequences_per_task).map_batches(
        tokenize_batch, batch_format="pyarrow",
        fn_kwargs=dict(model_dir=model_dir, block_size=block_size, max_length=cfg.max_length),
    ).materialize()
    good = tokenized.map_batches(select, batch_format="pyarrow", fn_kwargs=dict(bad=False))
    bad = tokenized.map_batches(select, batch_format="pyarrow", fn_kwargs=dict(bad=True)).materialize()

    # output_dir: a local path or a URI every node sees (mbd/storage.py); Ray Data writes through its filesystem
    rows_dir, quarantine_dir = storage.join(cfg.output_dir, "rows"), storage.join(cfg.output_dir, "quarantine")
    fs, rows_path = storage.filesystem(rows_dir)
    good.map_batches(
        expand_batch, batch_format="pyarrow", batch_size=cfg.sequences_per_task,
        fn_kwargs=dict(cfg_json=cfg.model_dump_json(), block_size=block_size, mask_token_id=model_cfg.mask_token_id),
    ).write_parquet(rows_path, filesystem=fs)
    quarantined = bad.count()
    reasons = Counter(r for b in bad.select_columns(["reason"]).iter_batches(batch_format="pyarrow")
                      for r in b.column("reason").to_pylist())
    if quarantined:
        bad.write_json(storage.filesystem(quarantine_dir)[1], filesystem=fs)
    elapsed = time.perf_counter() - start
    rows_out = sum(pq.ParquetFile(f, filesystem=fs).metadata.num_rows for f in storage.list_files(rows_dir, ".parquet"))
    sequences_in = tokenized.count()
    return ExpandSummary(
        sequences_in=sequences_in, sequences_ok=sequences_in - quarantined, quarantined=quarantined,
        quarantine_reasons=dict(sorted(reasons.items())), layouts_per_sequence=cfg.layouts().layouts_per_sequence,
        rows_out=rows_out, elapsed_s=round(elapsed, 3), rows_per_s=round(rows_out / max(elapsed, 1e-9), 1),
        rows_dir=str(rows_dir), quarantine_dir=str(quarantine_dir) if quarantined else None,
    )


# ---------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mbd expand", description="Expand a corpus into MultiTF rows (Ray Data).")
    ap.add_argument("--config", help="YAML file with ExpandConfig fields; flags override it")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field, e.g. --set scheduler.rho=0.01")
    ap.add_argument("--input", dest="inputs", action="append", help="JSONL/Parquet file or directory (repeatable)")
    ap.add_argument("--output-dir", dest="output_dir")
    ap.add_argument("--model-dir", dest="model_dir")
    for flag, typ in (("block-size", int), ("max-length", int), ("gmax", int), ("n-rand", int), ("seed", int),
                      ("epoch", int)):
        ap.add_argument(f"--{flag}", dest=flag.replace("-", "_"), type=typ)
    ap.add_argument("--mode", choices=["multitf", "d2f"])
    ap.add_argument("--scheduler", dest="name", choices=list(SchedulerName.__args__))
    for flag in ("t-low", "t-high", "rho", "gamma-rand"):
        ap.add_argument(f"--{flag}", dest=flag.replace("-", "_"), type=float)
    return ap


def config_from_args(argv: Sequence[str] | None) -> ExpandConfig:
    """The YAML (optional) with `--set` items, then the flags, which are shorthands for sets."""
    args = vars(build_parser().parse_args(argv))
    path, sets = args.pop("config"), args.pop("sets")
    data = apply_sets(read_yaml(path) if path else {}, sets)
    sched = {k: args.pop(k) for k in ("name", "t_low", "t_high", "rho", "gamma_rand")}
    data.update({k: v for k, v in args.items() if v is not None})
    data["scheduler"] = {**data.get("scheduler", {}), **{k: v for k, v in sched.items() if v is not None}}
    return validate(ExpandConfig, data, path or "command line")


def main(argv: Sequence[str] | None = None) -> int:
    cfg = config_from_args(argv)
    with ray_cluster():
        summary = run_expand(cfg)
    print(summary.model_dump_json(indent=2))
    return 0


if __name__ == "__main__":
    # Re-import under the package name so Ray pickles the stage functions by reference, not from __main__.
    from pipelines.expand_layouts import main as package_main

    sys.exit(package_main())
