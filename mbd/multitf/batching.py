"""Training rows -> model inputs, and the deterministic on-the-fly row stream for small runs.

A batch is `[noisy ; clean]` per row (length 2L, L = the longest row of the batch; shorter rows are
padded with the pad token and batch-padding blocks of group id -1), the shared position ids 0..L-1 of
both streams, and the Group-Aware Dual-Stream Mask built by `mbd.multitf.masks.DualStreamIndex` from the
per-block group ids (dense boolean for SDPA, or a FlexAttention BlockMask).

Block-diffusion teacher forcing (`rows.tf_row`, for pretraining a BD-LM) needs no mask of its own: every
response block is its own noise-group (group id = response-block index), and with singleton groups the
dual-stream mask is exactly the TF mask (a noisy block sees itself and the clean blocks before it).

On-the-fly rows (`OnTheFlyRows`, `StepSampler`) are a pure function of (seed, step, rank): a restarted
or resumed run sees exactly the rows it would have seen, and a single-process run with the same global
batch sees the union of what the workers see.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from mbd.multitf.masks import DualStreamIndex, dual_stream_position_ids
from mbd.multitf.rows import LayoutSection, TokenizedSequence, sequence_rows
from mbd.multitf.schedulers import build_scheduler

KINDS: tuple[str, ...] = ("systematic", "random", "tf", "d2f")


@dataclass(frozen=True)
class Batch:
    """Collated rows. L = noisy_ids.shape[1]; K = L / block_size."""

    noisy_ids: torch.Tensor  # [b, L] x_t (pad tokens after each row's own length)
    clean_ids: torch.Tensor  # [b, L] x_0
    position_ids: torch.Tensor  # [b, 2L]
    mask: Any  # bool [b, 1, 2L, 2L] (True = may attend) or a FlexAttention BlockMask
    block_ratio: torch.Tensor  # [b, K] float32 mask ratio t per block (0 for clean/padding blocks)
    block_slot: torch.Tensor  # [b, K] slot of the block inside its noise-group; -1 for clean/padding blocks
    num_blocks: torch.Tensor  # [b] K of each row before batch padding
    kind: torch.Tensor  # [b] index into KINDS
    total_len: torch.Tensor  # [b] real tokens per stream (prompt + response + block-alignment pads)
    prompt_len: torch.Tensor  # [b]
    block_size: int

    @property
    def targets(self) -> torch.Tensor:
        """[b, L] the trained positions of each row: after the prompt, before its own end (answer + pads)."""
        pos = torch.arange(self.noisy_ids.shape[1], device=self.noisy_ids.device)
        return (pos >= self.prompt_len[:, None]) & (pos < self.total_len[:, None])

    @property
    def input_ids(self) -> torch.Tensor:
        """[b, 2L]: the noisy stream first, then the clean stream."""
        return torch.cat([self.noisy_ids, self.clean_ids], dim=1)

    @property
    def rows(self) -> int:
        return self.noisy_ids.shape[0]

    def with_noisy(self, noisy_ids: torch.Tensor) -> "Batch":
        """The same layout and mask with another noisy stream (DMax OPUT's self-denoised input)."""
        if noisy_ids.shape != self.noisy_ids.shape:
            raise ValueError(f"noisy_ids shape {tuple(noisy_ids.shape)} must equal {tuple(self.noisy_ids.shape)}")
        return replace(self, noisy_ids=noisy_ids)


def block_slots(block_group: torch.Tensor) -> torch.Tensor:
    """Slot of every block inside its noise-group (0 = the group's first block); -1 where group id < 0."""
    k = block_group.shape[1]
    blocks = torch.arange(k, device=block_group.device).expand_as(block_group)
    starts = torch.ones_like(block_group, dtype=torch.bool)
    starts[:, 1:] = block_group[:, 1:] != block_group[:, :-1]
    first = torch.cummax(torch.where(starts, blocks, 0), dim=1).values
    return torch.where(block_group >= 0, blocks - first, -1)


def _pad(values: Sequence[Any], width: int, fill: float, dtype: torch.dtype, name: str) -> torch.Tensor:
    out = torch.full((len(values), width), fill, dtype=dtype)
    for i, v in enumerate(values):
        t = torch.as_tensor(np.array(v), dtype=dtype)  # a copy: Arrow-backed arrays are read-only
        if t.dim() != 1:
            raise ValueError(f"row {i}: '{name}' must be a 1-D list, got shape {tuple(t.shape)}")
        out[i, : t.numel()] = t
    return out


def collate(columns: Mapping[str, Sequence[Any]], *, block_size: int, pad_token_id: int,
            attention: str = "dense", device: torch.device | str = "cpu") -> Batch:
    """Rows given column-wise (ROW_SCHEMA names; Ray Data numpy batches are already in this form)."""
    need = ("noisy_ids", "clean_ids", "block_group", "block_ratio", "layout_kind", "total_len", "prompt_len")
    missing = [c for c in need if c not in columns]
    if missing:
        raise ValueError(f"rows lack columns {missing}: expected the layout-expansion schema (ROW_SCHEMA)")
    lengths = [len(v) for v in columns["clean_ids"]]
    for i, (n, noisy, bg) in enumerate(zip(lengths, columns["noisy_ids"], columns["block_group"])):
        if n % block_size or len(noisy) != n or len(bg) != n // block_size:
            raise ValueError(f"row {i}: clean_ids ({n}) and noisy_ids ({len(noisy)}) must have one length, a "
                             f"multiple of block_size={block_size}, and block_group ({len(bg)}) one id per block; "
                             "were the rows expanded with this model's block size?")
    kinds = [str(k) for k in columns["layout_kind"]]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"layout_kind {unknown} is not one of {KINDS}")
    width = max(lengths)
    k = width // block_size
    block_group = _pad(columns["block_group"], k, -1, torch.long, "block_group")
    total_len = torch.as_tensor(np.asarray(columns["total_len"], dtype=np.int64))
    index = DualStreamIndex.build(block_group, total_len, block_size, device=device)
    mask = index.dense_mask() if attention == "dense" else index.block_mask()
    return Batch(
        noisy_ids=_pad(columns["noisy_ids"], width, pad_token_id, torch.long, "noisy_ids").to(device),
        clean_ids=_pad(columns["clean_ids"], width, pad_token_id, torch.long, "clean_ids").to(device),
        position_ids=dual_stream_position_ids(width, len(lengths), device=device),
        mask=mask,
        block_ratio=_pad(columns["block_ratio"], k, 0.0, torch.float32, "block_ratio").to(device),
        block_slot=block_slots(block_group).to(device),
        num_blocks=torch.as_tensor([n // block_size for n in lengths], device=device),
        kind=torch.as_tensor([KINDS.index(x) for x in kinds], device=device),
        total_len=total_len.to(device),
        prompt_len=torch.as_tensor(np.asarray(columns["prompt_len"], dtype=np.int64), device=device),
        block_size=block_size,
    )


def rows_to_columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    if not rows:
        raise ValueError("cannot collate an empty list of rows")
    return {key: [r[key] for r in rows] for key in rows[0]}


# ---------------------------------------------------------------- rows built on the fly

class OnTheFlyRows:
    """Row j of an epoch = (sequence j // |Lambda|, layout j % |Lambda|), built exactly as `mbd expand`
    builds it (same random keys), so on-the-fly and Parquet training see the same rows."""

    def __init__(self, sequences: Sequence[TokenizedSequence], layouts: LayoutSection, *, block_size: int,
                 mask_token_id: int, seed: int):
        if not sequences:
            raise ValueError("no training sequences: the corpus is empty or every record was rejected")
        self.sequences = list(sequences)
        self.layouts = layouts
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.seed = seed
        self.scheduler = build_scheduler(layouts.scheduler)
        self.layouts_per_sequence = layouts.layouts_per_sequence
        self._expand = lru_cache(maxsize=512)(self._expand_uncached)

    @property
    def rows_per_epoch(self) -> int:
        return len(self.sequences) * self.layouts_per_sequence

    def _expand_uncached(self, seq_index: int, epoch: int) -> list[dict[str, Any]]:
        return sequence_rows(self.sequences[seq_index], self.layouts, block_size=self.block_size,
                             mask_token_id=self.mask_token_id, seed=self.seed, epoch=epoch, scheduler=self.scheduler)

    def row(self, epoch: int, j: int) -> dict[str, Any]:
        seq_index, layout = divmod(int(j), self.layouts_per_sequence)
        return self._expand(seq_index, epoch)[layout]

    def rows(self, epoch: int, indices: Sequence[int]) -> list[dict[str, Any]]:
        return [self.row(epoch, j) for j in indices]


class StepSampler:
    """Which rows each (step, rank, micro-batch) trains on: epoch-wise permutations keyed by (seed, epoch).

    A global batch of G = micro_batch * grad_accum * world rows is split so that micro-batch m of rank r
    takes slice m * world + r; a single process with the same G takes all slices of the step.
    """

    def __init__(self, rows_per_epoch: int, micro_batch: int, grad_accum: int, world: int, seed: int):
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.world = world
        self.seed = seed
        self.global_batch = micro_batch * grad_accum * world
        self.rows_per_epoch = rows_per_epoch
        self.steps_per_epoch = rows_per_epoch // self.global_batch
        if self.steps_per_epoch < 1:
            raise ValueError(f"global batch {self.global_batch} (micro_batch_size x grad_accum x num_workers) is "
                             f"larger than the {rows_per_epoch} rows of one epoch: lower it or add data")

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, epoch, 0x6D6264)).permutation(self.rows_per_epoch)

    def global_rows(self, step: int) -> tuple[int, np.ndarray]:
        """(epoch, the G row indices of optimiser step `step`, 1-based)."""
        if step < 1:
            raise ValueError(f"step={step} must be >= 1")
        epoch, i = divmod(step - 1, self.steps_per_epoch)
        return epoch, self._permutation(epoch)[i * self.global_batch:(i + 1) * self.global_batch]

    def micro_rows(self, step: int, rank: int, micro: int) -> tuple[int, np.ndarray]:
        epoch, rows = self.global_rows(step)
        part = micro * self.world + rank
        return epoch, rows[part * self.micro_batch:(part + 1) * self.micro_batch]
