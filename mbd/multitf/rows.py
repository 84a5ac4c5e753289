"""Training rows of one clean sequence, for every layout mode, and their noise redrawn on later passes.

Three layout modes (`LayoutSection.mode`):
- `multitf`: |Lambda| = (Gmax+2)(Gmax-1)/2 + N_rand group-layouts per sequence (`corrupt.layout_row`).
- `tf`: block-diffusion teacher forcing, one row where every response block is its own noise-group.
- `d2f`: the authors' D2F ablation (mbd-lms `noise_schedule_mode: d2f`): one row, ONE noise-group over all
  response blocks, and the deterministic `linear` ramp over the sequence's blocks counted from block 0, prompt
  blocks included (the authors' `preprocess_input_token_ids_global_linear` puts every content block in the
  group; prompt blocks take a ramp value but have nothing to mask).

Every row carries its `recipe` (the layout section and seed that drew it, as JSON), so a row can be rebuilt
with fresh noise anywhere the clean tokens are: `redraw_columns` gives training pass p > 0 over a Parquet
expansion the rows of epoch key `epoch + p` (seed, sequence, epoch, layout keyed as in `rng.py`), as the
authors' data transform redraws noise on every access. Pass 0 keeps the stored rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, Mapping, Sequence

import numpy as np
from pydantic import Field, model_validator

from mbd.config import StrictModel
from mbd.multitf.corrupt import Masking, corrupt, layout_row
from mbd.multitf.layouts import first_response_block, layout_specs, num_layouts
from mbd.multitf.rng import Purpose, generator
from mbd.multitf.schedulers import NoiseScheduler, SchedulerConfig, build_scheduler


class LayoutSection(StrictModel):
    """How rows are built from a clean sequence (the expansion job and on-the-fly training share it).

    mode `multitf`: |Lambda| group-layouts per sequence. mode `tf`: block-diffusion teacher forcing, one layout
    where every response block is its own noise-group (use scheduler `random_iid` with gamma_rand 1 for the usual
    independent t ~ U(t_low, t_high) per block). mode `d2f`: the authors' D2F ablation, one group over all
    response blocks with the `linear` scheduler (required). `masking`: `floor_count` (alg:multitf_training) or
    `bernoulli` (eq:forward, the BD-LM pretraining rule; see `mbd.multitf.corrupt`).
    """

    mode: Literal["multitf", "tf", "d2f"] = "multitf"
    gmax: int = Field(default=4, ge=2, description="G_max (also sizes the per-slot loss metrics)")
    n_rand: int = Field(default=0, ge=0)
    scheduler: SchedulerConfig = SchedulerConfig()
    masking: Masking = "floor_count"

    @model_validator(mode="after")
    def _check(self) -> "LayoutSection":
        if (self.mode == "d2f") != (self.scheduler.name == "linear"):
            raise ValueError("scheduler.name: the d2f layout mode uses the authors' deterministic `linear` ramp, "
                             "and `linear` is only meant for it")
        if self.mode == "multitf":
            self.scheduler.check_group_size(self.gmax)
        return self

    @property
    def max_slots(self) -> int:
        return 1 if self.mode == "tf" else self.gmax

    @property
    def layouts_per_sequence(self) -> int:
        return num_layouts(self.gmax, self.n_rand) if self.mode == "multitf" else 1


class Recipe(StrictModel):
    """What drew a row: stored with it (`recipe` column) so its noise can be redrawn on a later pass."""

    layouts: LayoutSection
    seed: int = Field(ge=0)


@dataclass(frozen=True)
class TokenizedSequence:
    """One clean training sequence: ids padded to a block multiple, prompt and response (incl. EOS) lengths."""

    seq_id: int
    clean_ids: np.ndarray
    prompt_len: int
    response_len: int


def _single_layout_row(seq: TokenizedSequence, kind: str, block_group: np.ndarray, ratio: np.ndarray, *,
                       block_size: int, mask_token_id: int, seed: int, epoch: int,
                       masking: Masking) -> dict[str, Any]:
    ids = np.asarray(seq.clean_ids, dtype=np.int32)
    ratio = ratio.astype(np.float32)
    noisy = corrupt(ids, ratio, seq.prompt_len, block_size, mask_token_id,
                    generator(seed, seq.seq_id, epoch, 0, Purpose.POSITIONS), masking)
    return {"seq_id": seq.seq_id, "epoch": epoch, "layout_index": 0, "layout_kind": kind,
            "g": 1 if kind == "tf" else -1, "h": 0 if kind == "tf" else -1, "noisy_ids": noisy, "clean_ids": ids,
            "block_group": block_group, "block_ratio": ratio, "prompt_len": seq.prompt_len,
            "response_len": seq.response_len, "total_len": ids.size}


def tf_row(seq: TokenizedSequence, *, block_size: int, scheduler: NoiseScheduler, mask_token_id: int,
           seed: int, epoch: int, masking: Masking = "floor_count") -> dict[str, Any]:
    """The block-diffusion TF row of a sequence: each response block is a noise-group of one block."""
    num_blocks = len(seq.clean_ids) // block_size
    first = first_response_block(seq.prompt_len, block_size)
    block_group = np.full(num_blocks, -1, dtype=np.int32)
    block_group[first:] = np.arange(num_blocks - first)
    ratio = scheduler.sample(block_group, generator(seed, seq.seq_id, epoch, 0, Purpose.RATIOS))
    return _single_layout_row(seq, "tf", block_group, ratio, block_size=block_size, mask_token_id=mask_token_id,
                              seed=seed, epoch=epoch, masking=masking)


def d2f_row(seq: TokenizedSequence, *, block_size: int, scheduler: NoiseScheduler, mask_token_id: int,
           seed: int, epoch: int, masking: Masking = "floor_count") -> dict[str, Any]:
    """The authors' D2F row: one noise-group over all response blocks, ramp over all K blocks from block 0."""
    num_blocks = len(seq.clean_ids) // block_size
    first = first_response_block(seq.prompt_len, block_size)
    ramp = scheduler.sample(np.zeros(num_blocks, dtype=np.int32),
                            generator(seed, seq.seq_id, epoch, 0, Purpose.RATIOS))
    block_group = np.full(num_blocks, -1, dtype=np.int32)
    block_group[first:] = 0
    ratio = np.where(block_group >= 0, ramp, 0.0)
    return _single_layout_row(seq, "d2f", block_group, ratio, block_size=block_size, mask_token_id=mask_token_id,
                              seed=seed, epoch=epoch, masking=masking)


def sequence_row(seq: TokenizedSequence, layouts: LayoutSection, layout_index: int, *, block_size: int,
                 mask_token_id: int, seed: int, epoch: int, scheduler: NoiseScheduler | None = None,
                 recipe: str | None = None) -> dict[str, Any]:
    """Row `layout_index` of a sequence (ROW_SCHEMA, `recipe` included)."""
    scheduler = scheduler or build_scheduler(layouts.scheduler)
    kw = dict(block_size=block_size, scheduler=scheduler, mask_token_id=mask_token_id, seed=seed, epoch=epoch,
              masking=layouts.masking)
    if layouts.mode == "tf":
        row = tf_row(seq, **kw)
    elif layouts.mode == "d2f":
        row = d2f_row(seq, **kw)
    else:
        spec = layout_specs(layouts.gmax, layouts.n_rand)[layout_index]
        row = layout_row(seq.clean_ids, seq.prompt_len, seq.response_len, spec, layout_index, gmax=layouts.gmax,
                         seq_id=seq.seq_id, **kw)
    row["recipe"] = recipe or Recipe(layouts=layouts, seed=seed).model_dump_json()
    return row


def sequence_rows(seq: TokenizedSequence, layouts: LayoutSection, *, block_size: int, mask_token_id: int,
                  seed: int, epoch: int, scheduler: NoiseScheduler | None = None) -> list[dict[str, Any]]:
    """All rows of one sequence: |Lambda| for multitf, one for tf and d2f."""
    scheduler = scheduler or build_scheduler(layouts.scheduler)
    recipe = Recipe(layouts=layouts, seed=seed).model_dump_json()
    return [sequence_row(seq, layouts, i, block_size=block_size, mask_token_id=mask_token_id, seed=seed,
                         epoch=epoch, scheduler=scheduler, recipe=recipe)
            for i in range(layouts.layouts_per_sequence)]


@lru_cache(maxsize=16)
def _parsed(recipe: str) -> tuple[Recipe, NoiseScheduler]:
    try:
        parsed = Recipe.model_validate(json.loads(recipe))
    except ValueError as e:
        raise ValueError(f"a training row's recipe is not a valid expansion recipe (re-run `mbd expand`): {e}") from e
    return parsed, build_scheduler(parsed.layouts.scheduler)


def redraw_columns(columns: Mapping[str, Sequence[Any]], pass_index: int, *, block_size: int,
                   mask_token_id: int) -> dict[str, Sequence[Any]]:
    """Rows given column-wise with their noise drawn for training pass `pass_index` (epoch key epoch + pass).

    Layouts, ratios and masked positions are redrawn from the stored clean tokens and the row's recipe; pass 0
    returns the rows as stored.
    """
    if pass_index == 0:
        return dict(columns)
    out = {k: list(v) for k, v in columns.items()}
    if "recipe" not in columns:
        raise ValueError("rows lack the `recipe` column: they were expanded by an older `mbd expand`; re-run it")
    fields = ("noisy_ids", "block_group", "block_ratio", "epoch")
    for i, text in enumerate(columns["recipe"]):
        recipe, scheduler = _parsed(str(text))
        seq = TokenizedSequence(int(columns["seq_id"][i]), np.asarray(columns["clean_ids"][i], dtype=np.int32),
                                int(columns["prompt_len"][i]), int(columns["response_len"][i]))
        row = sequence_row(seq, recipe.layouts, int(columns["layout_index"][i]), block_size=block_size,
                           mask_token_id=mask_token_id, seed=recipe.seed, scheduler=scheduler, recipe=str(text),
                           epoch=int(columns["epoch"][i]) + pass_index)
        for f in fields:
            out[f][i] = row[f]
    return out
