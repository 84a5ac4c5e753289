"""MultiTF corruption: noisy ids for one group-layout, and the expansion of a sequence into rows.

Two masking rules (`Masking`), both over a block's MASKABLE positions (below):
- `floor_count` (alg:multitf_training, the MultiTF default): block k masks exactly floor(B * t_k) of them;
- `bernoulli` (eq:forward, how a BD-LM base is pretrained, as SDAR's `forward_add_noise_packed`): each is masked
  independently with probability t_k, so a block can be fully masked at any t > 0 (the state every SingleBD
  and MultiBD block opens in) and E[masked] = t_k * maskable; pair it with the 1/t-weighted loss of
  eq:block_diffusion (`sdar_weighted_ce`).

floor_count in detail: block k with ratio t_k masks exactly n_k = floor(B * t_k) positions,
chosen uniformly without replacement among its MASKABLE positions, i.e. the TARGETS: every position after
the prompt, prompt_len <= p < L, that is the response (with its EOS) AND the block-alignment pad tokens
after it (as the authors' `apply_chat_template_mdm`: "block-alignment padding participates in
training"). Why: at inference the final block holds EOS and then whatever the model writes in its
remaining positions; if those pads were never masked nor trained, the final block's trailing positions
would never be learned. Prompt positions of the block holding the prompt tail are never masked. When a
block has fewer maskable positions than floor(B * t_k) (that boundary block) n_k is clamped to the
number of maskable positions, so t_k stays a per-block ratio of B as in the paper.

The ratio is rounded to float32 BEFORE the count is taken, so that floor(B * block_ratio) recomputed
from a stored row gives the same count.

`layout_row` builds the training row of one group-layout and `expand_sequence` all |Lambda| of them; their
randomness is keyed by (seed, seq_id, epoch, layout_index) through `rng.generator`. Both leave out the
`recipe` column, which `mbd.multitf.rows` adds (it knows the whole layout section).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import numpy as np

from mbd.multitf.layouts import LayoutSpec, build_layout, first_response_block, layout_specs
from mbd.multitf.rng import Purpose, generator
from mbd.multitf.schedulers import NoiseScheduler

Masking = Literal["floor_count", "bernoulli"]


class RowField(NamedTuple):
    dtype: str  # numpy dtype name, or "str"
    per: str  # "" for a scalar; "L" (per token) or "K" (per block) for a list of that length
    meaning: str


# L = padded length (a multiple of B), K = L / B blocks.
ROW_SCHEMA: dict[str, RowField] = {
    "seq_id": RowField("int64", "", "stable id of the clean sequence; keys the random streams"),
    "epoch": RowField("int32", "", "expansion epoch; a new epoch draws fresh layouts and noise"),
    "layout_index": RowField("int32", "", "index in Lambda: systematic (g, h) ascending, then random layouts"),
    "layout_kind": RowField("str", "", "'systematic' or 'random'"),
    "g": RowField("int32", "", "noise-group size of a systematic layout; -1 for a random layout"),
    "h": RowField("int32", "", "shift of a systematic layout; -1 for a random layout"),
    "noisy_ids": RowField("int32", "L", "x_t: clean_ids with the sampled positions set to the mask token"),
    "clean_ids": RowField("int32", "L", "x_0: prompt + response + EOS, then block-alignment pad tokens up to L"),
    "block_group": RowField("int32", "K", "noise-group id per block; -1 = clean prompt block"),
    "block_ratio": RowField("float32", "K", "mask ratio t per block; 0 for clean blocks"),
    "prompt_len": RowField("int32", "", "prompt tokens (chat template applied)"),
    "response_len": RowField("int32", "", "response tokens including the appended EOS"),
    "total_len": RowField("int32", "", "L: prompt + response + block-alignment pads, all real (attended) "
                                       "tokens; the training targets are prompt_len <= p < total_len"),
    "recipe": RowField("str", "", "JSON of the layout section and seed that drew the row (`rows.Recipe`): "
                                  "training redraws its noise from it on every later pass"),
}


def mask_counts(block_ratio: np.ndarray, maskable: np.ndarray, block_size: int) -> np.ndarray:
    """n_k = min(floor(B * t_k), maskable positions of block k)."""
    want = np.floor(block_size * np.asarray(block_ratio, dtype=np.float64)).astype(np.int64)
    return np.minimum(want, maskable.sum(axis=1))


def sample_masked(block_ratio: np.ndarray, maskable: np.ndarray, block_size: int,
                  rng: np.random.Generator, masking: Masking = "floor_count") -> np.ndarray:
    """Boolean [K, B]: exactly n_k uniformly chosen maskable positions per block (`floor_count`), or each
    maskable position independently with probability t_k (`bernoulli`)."""
    if masking == "bernoulli":
        t = np.asarray(block_ratio, dtype=np.float64)[:, None]
        return maskable & (rng.random(maskable.shape) < t)
    counts = mask_counts(block_ratio, maskable, block_size)
    keys = rng.random(maskable.shape)
    keys[~maskable] = 2.0  # non-maskable positions sort last and are never picked
    order = np.argsort(keys, axis=1)
    masked = np.zeros(maskable.shape, dtype=bool)
    np.put_along_axis(masked, order, np.arange(maskable.shape[1]) < counts[:, None], axis=1)
    return masked


def corrupt(clean_ids: np.ndarray, block_ratio: np.ndarray, prompt_len: int, block_size: int,
            mask_token_id: int, rng: np.random.Generator, masking: Masking = "floor_count") -> np.ndarray:
    """Noisy ids x_t for one layout's per-block ratios; every position after the prompt is a target."""
    ids = np.asarray(clean_ids)
    pos = np.arange(ids.size).reshape(-1, block_size)
    maskable = pos >= prompt_len
    masked = sample_masked(block_ratio, maskable, block_size, rng, masking).reshape(-1)
    return np.where(masked, mask_token_id, ids).astype(ids.dtype)


def layout_row(clean_ids: np.ndarray, prompt_len: int, response_len: int, spec: LayoutSpec, index: int, *,
               block_size: int, gmax: int, scheduler: NoiseScheduler, mask_token_id: int, seed: int, seq_id: int,
               epoch: int, masking: Masking = "floor_count") -> dict[str, Any]:
    """The training row of group-layout `index` (= `spec`) of one sequence (ROW_SCHEMA less `recipe`)."""
    ids = np.asarray(clean_ids, dtype=np.int32)
    total = prompt_len + response_len
    if ids.size % block_size:
        raise ValueError(f"clean_ids length {ids.size} must be a multiple of block_size={block_size}: pad first")
    if response_len < 1 or prompt_len < 0 or total > ids.size:
        raise ValueError(f"need response_len >= 1, prompt_len >= 0, prompt_len + response_len <= {ids.size}; "
                         f"got prompt_len={prompt_len}, response_len={response_len}")
    key = (seed, seq_id, epoch, index)
    first = first_response_block(prompt_len, block_size)
    block_group = build_layout(spec, ids.size // block_size, first, gmax, generator(*key, Purpose.LAYOUT))
    ratio = scheduler.sample(block_group, generator(*key, Purpose.RATIOS)).astype(np.float32)
    noisy = corrupt(ids, ratio, prompt_len, block_size, mask_token_id, generator(*key, Purpose.POSITIONS), masking)
    return {
        "seq_id": seq_id, "epoch": epoch, "layout_index": index, "layout_kind": spec.kind,
        "g": spec.g, "h": spec.h, "noisy_ids": noisy, "clean_ids": ids,
        "block_group": block_group, "block_ratio": ratio,
        "prompt_len": prompt_len, "response_len": response_len, "total_len": ids.size,
    }


def expand_sequence(clean_ids: np.ndarray, prompt_len: int, response_len: int, *, block_size: int,
                    gmax: int, n_rand: int, scheduler: NoiseScheduler, mask_token_id: int,
                    seed: int, seq_id: int, epoch: int) -> list[dict[str, Any]]:
    """All |Lambda| = (Gmax+2)(Gmax-1)/2 + N_rand training rows of one sequence (ROW_SCHEMA less `recipe`)."""
    return [layout_row(clean_ids, prompt_len, response_len, spec, index, block_size=block_size, gmax=gmax,
                       scheduler=scheduler, mask_token_id=mask_token_id, seed=seed, seq_id=seq_id, epoch=epoch)
            for index, spec in enumerate(layout_specs(gmax, n_rand))]
