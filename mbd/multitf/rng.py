"""Deterministic randomness for MultiTF data expansion.

Every random choice of a training row (random group-layout, block mask ratios, masked positions) is
drawn from a generator keyed by (global seed, sequence id, epoch, layout index, purpose). Why:
- a re-run of the expansion job reproduces every row bit for bit, whatever the sharding or worker
  order, because no generator state is shared between sequences;
- a new epoch changes the key and therefore draws fresh layouts and noise for the same sequence;
- each purpose has its own stream, so switching the noise-scheduler (an ablation) keeps the random
  group-layouts and only changes the ratios, which makes scheduler ablations paired comparisons.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np


class Purpose(IntEnum):
    """Independent random streams inside one (sequence, epoch, layout) key."""

    LAYOUT = 0
    RATIOS = 1
    POSITIONS = 2


def generator(seed: int, seq_id: int, epoch: int, layout_index: int, purpose: Purpose) -> np.random.Generator:
    """A numpy Generator that depends only on its five key parts (all must be >= 0)."""
    key = (seq_id, epoch, layout_index, int(purpose))
    for name, value in (("seed", seed), ("seq_id", seq_id), ("epoch", epoch), ("layout_index", layout_index)):
        if value < 0:
            raise ValueError(f"{name}={value} must be >= 0 (it keys the random stream)")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy=seed, spawn_key=key)))
