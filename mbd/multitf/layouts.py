"""Group-layouts of MultiTF (paper sec:appendix_layout_construction).

A group-layout partitions the response blocks of a sequence into consecutive noise-groups. It is
stored as per-block group ids: an int array of length K (all blocks of the padded sequence) where
-1 marks a clean prompt block (a block holding only prompt tokens, never noised) and the response
blocks carry group ids 0, 1, 2, ... in order. Why per-block ids: they are all that the noise-scheduler,
the corruption and the Group-Aware Dual-Stream Mask need, and they are K integers instead of an
L x L mask.

Which blocks are response blocks: block k (0-based) is a response block iff it holds at least one
response token, i.e. k >= prompt_len // B. A block that holds the prompt tail and the response start
is therefore the first response block (as in the paper's fully block-causal D2F construction); its
prompt positions are kept clean by the corruption step (see `corrupt.py`).

Systematic layouts lambda_{g,h} use exactly the paper's boundary set on the response blocks numbered
1..K_r: B_{g,h} = sort({1, K_r+1} U {1+h+qg : 1 < 1+h+qg < K_r+1}). Boundary groups are clipped and
may be shorter than g, down to a single block.

Trailing (and leading) single-block groups are KEPT as they are, not merged into a neighbour. A
single-block noise-group is the TF/SingleBD state (one noisy block on a clean prefix), which is a
real MultiBD state (the last block of a response, or a buffer holding one block). Merging it would
create a group larger than g (even larger than G_max) and would change which running-sets the
shifts cover, breaking the coverage property of sec:appendix_theory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

LayoutKind = Literal["systematic", "random"]


@dataclass(frozen=True)
class LayoutSpec:
    """What layout `layout_index` is: systematic (g, h) or random (g = h = -1)."""

    kind: LayoutKind
    g: int
    h: int


def check_layout_params(gmax: int, n_rand: int) -> None:
    if gmax < 2:
        raise ValueError(f"gmax={gmax} must be >= 2 (noise-group sizes are drawn from 2..gmax)")
    if n_rand < 0:
        raise ValueError(f"n_rand={n_rand} must be >= 0 (number of random group-layouts)")


def num_layouts(gmax: int, n_rand: int) -> int:
    """|Lambda| = (Gmax+2)(Gmax-1)/2 + N_rand."""
    check_layout_params(gmax, n_rand)
    return (gmax + 2) * (gmax - 1) // 2 + n_rand


def layout_specs(gmax: int, n_rand: int) -> list[LayoutSpec]:
    """All layouts of Lambda in layout_index order: systematic by (g, h) ascending, then random."""
    check_layout_params(gmax, n_rand)
    specs = [LayoutSpec("systematic", g, h) for g in range(2, gmax + 1) for h in range(g)]
    return specs + [LayoutSpec("random", -1, -1)] * n_rand


def first_response_block(prompt_len: int, block_size: int) -> int:
    """Index of the first block holding a response token (blocks before it are clean prompt blocks)."""
    return prompt_len // block_size


def systematic_layout(num_blocks: int, first_block: int, g: int, h: int) -> np.ndarray:
    """lambda_{g,h} over blocks first_block..num_blocks-1; -1 before first_block.

    With 0-based local index k = i - 1, the boundary set puts block k in group floor((k-h)/g) + [h>0]:
    for h > 0 the blocks k < h form the clipped leading group 0.
    """
    if not 0 <= h < g:
        raise ValueError(f"shift h={h} must be in 0..g-1 for g={g}")
    ids = np.full(num_blocks, -1, dtype=np.int32)
    k = np.arange(num_blocks - first_block)
    ids[first_block:] = (k - h) // g + (1 if h > 0 else 0)
    return ids


def random_layout(num_blocks: int, first_block: int, gmax: int, rng: np.random.Generator) -> np.ndarray:
    """Random layout: sizes g_m ~ Uniform{2..gmax} until the response blocks are covered (last clipped)."""
    ids = np.full(num_blocks, -1, dtype=np.int32)
    n = num_blocks - first_block
    if n <= 0:
        return ids
    # ceil(n/2) draws always cover n blocks (every size is >= 2); a fixed draw count keeps the stream
    # position independent of the sizes drawn.
    sizes = rng.integers(2, gmax + 1, size=(n + 1) // 2)
    ends = np.cumsum(sizes)
    ids[first_block:] = np.searchsorted(ends, np.arange(n), side="right")
    return ids


def build_layout(spec: LayoutSpec, num_blocks: int, first_block: int, gmax: int,
                 rng: np.random.Generator) -> np.ndarray:
    """Per-block group ids for one layout spec (`rng` is used only by random layouts)."""
    if spec.kind == "systematic":
        return systematic_layout(num_blocks, first_block, spec.g, spec.h)
    return random_layout(num_blocks, first_block, gmax, rng)


def groups(block_group: np.ndarray) -> list[np.ndarray]:
    """Block indices of each noise-group H_m, in order."""
    ids = np.asarray(block_group)
    return [np.flatnonzero(ids == m) for m in range(int(ids.max(initial=-1)) + 1)]
