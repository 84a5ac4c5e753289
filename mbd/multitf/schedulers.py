"""Block-level noise-schedulers: per-block mask ratios for one group-layout.

Every scheduler has the same interface, `sample(block_group, rng) -> block_ratio`: it takes the
per-block group ids of a layout (-1 = clean prompt block, see `layouts.py`) and returns one mask
ratio per block (0.0 for clean blocks). Inside a noise-group H_m = (j_1, ..., j_n) "slot i" is the
i-th block of the group. Definitions (t_low <= t_high in [0, 1]):

- chain_uniform (paper alg:multitf_training, sec:appendix_chain_uniform_scheduler):
  t_eff = t_high - rho (t_high - t_low); l ~ U(t_low, t_eff); t_{j_i} ~ U(l, t_eff), l <- t_{j_i}.
- d2f (D2F-style monotonic, tab:ablation): the monotonic block schedule of D2F (Wang et al. 2025,
  "Diffusion LLMs Can Do Faster-Than-AR Inference via Discrete Diffusion Forcing", arXiv:2508.09192;
  code: zhijie-group/Discrete-Diffusion-Forcing, D2F-train/utils/util.py `generate_monotonic_pmasks`),
  applied inside each noise-group as the paper's ablation does ("we ablate the block-level
  noise-scheduler within each noise-group"). D2F draws the first block's ratio p_0 ~ U(0.2, 0.7) and
  increments d_i ~ U(0, (0.7 - p_0) / (n - 1)), t_i = p_0 + d_1 + ... + d_i; we replace D2F's fixed
  bounds 0.2 / 0.7 by (t_low, t_high): t_{j_1} ~ U(t_low, t_high), d_i ~ U(0, (t_high - t_{j_1}) / (n - 1)).
  The ratios are non-decreasing with small, similar steps and t_{j_n} <= t_high.
- random (tab:ablation "random scheduler", the authors' `buffer_internal_ramp: random` of mbd-lms
  `multi_bd_sft_noise_transition`): an increasing chain with power-law steps per group, starting at
  t_low: t_{j_i} = c + (t_eff - c)(1 - (1 - u)^gamma_rand), u ~ U(0, 1), c <- t_{j_i} (c = t_low for the
  first block). gamma_rand > 1 (the authors' noise_transition_gamma = 2) makes each step take more than
  half of the remaining room on average, so ratios drift quickly towards t_eff (high noise).
- random_iid (our earlier ablation, kept for comparison): every block independently,
  t = t_low + (t_high - t_low) u^gamma_rand; no order inside the group, gamma_rand > 1 biases it towards
  t_low.
- sorted_uniform (alg:sorted_uniform_scheduler): u_1..u_n iid U(t_low, t_high), sorted ascending.
- explicit_slots (the authors' MBD-DMax run: `explicit_block{1,2}_noise_{min,max}` of their OPUT training
  config, `explicit_buffer_block_noise_ranges` of mbd-lms `multi_bd_sft_noise_transition`): slot i of every
  group draws t ~ U(lo_i, hi_i) from its own fixed range, independently of the other slots; no t_eff margin.
  A group with more slots than ranges is an error (the authors raise too).
- linear (the ramp of the authors' `noise_schedule_mode: d2f`, `buffer_internal_ramp: linear`): deterministic,
  slot i of a group of n blocks gets t_low + (t_eff - t_low) i / (n - 1); a one-block group draws
  t ~ U(t_low, t_eff). Used by the `d2f` layout mode (`mbd.multitf.rows`), one group over the whole sequence.

All of them are vectorised over groups (a loop over slots, not over blocks) because the expansion
job calls them |Lambda| times per sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

SchedulerName = Literal["chain_uniform", "d2f", "random", "random_iid", "sorted_uniform", "explicit_slots", "linear"]


class SchedulerConfig(BaseModel):
    """Noise-scheduler choice and parameters (tab:appendix_train_hparams: t_low, t_high, rho).

    rho is the paper's noise_transition_margin_ratio (its value, rho_cfg, is not reported; 0.01 is the
    authors' `noise_transition_margin_ratio` in every mbd-lms training config). gamma_rand is used only by
    the `random` (default 2, the authors' noise_transition_gamma) and `random_iid` schedulers. slot_ranges
    (one [lo, hi] per slot) is used only, and required, by `explicit_slots`.
    """

    model_config = ConfigDict(extra="forbid")

    name: SchedulerName = "chain_uniform"
    t_low: float = Field(default=0.001, ge=0.0, le=1.0)
    t_high: float = Field(default=1.0, ge=0.0, le=1.0)
    rho: float = Field(default=0.01, ge=0.0, le=1.0)
    gamma_rand: float = Field(default=2.0, gt=0.0)
    slot_ranges: list[tuple[float, float]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> "SchedulerConfig":
        if self.t_low > self.t_high:
            raise ValueError(f"t_low={self.t_low} must be <= t_high={self.t_high}")
        if (self.name == "explicit_slots") != bool(self.slot_ranges):
            raise ValueError("slot_ranges: set it (one [lo, hi] per slot) exactly when name is explicit_slots")
        for i, (lo, hi) in enumerate(self.slot_ranges):
            if not 0.0 <= lo <= hi <= 1.0:
                raise ValueError(f"slot_ranges[{i}]=[{lo}, {hi}] must satisfy 0 <= lo <= hi <= 1")
        return self

    def check_group_size(self, gmax: int) -> None:
        """explicit_slots needs a range for every slot of the largest noise-group."""
        if self.name == "explicit_slots" and gmax > len(self.slot_ranges):
            raise ValueError(f"scheduler.slot_ranges has {len(self.slot_ranges)} ranges but noise-groups have up to "
                             f"gmax={gmax} slots: give one [lo, hi] per slot")

    @property
    def t_eff(self) -> float:
        return self.t_high - self.rho * (self.t_high - self.t_low)


class NoiseScheduler:
    """Maps a layout's per-block group ids to per-block mask ratios; subclasses define `sample_groups`."""

    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg

    def sample(self, block_group: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Per-block ratios (float64, length K); 0.0 for clean blocks (group id -1)."""
        ids = np.asarray(block_group)
        member = ids >= 0
        gid = ids[member].astype(np.int64)
        ratios = np.zeros(ids.shape[0], dtype=np.float64)
        if gid.size:
            steps = np.diff(gid)
            if gid[0] != 0 or np.any((steps < 0) | (steps > 1)):
                raise ValueError(
                    f"block_group must number noise-groups 0, 1, 2, ... in block order, got {ids.tolist()}")
            ratios[member] = self.sample_groups(gid, rng)
        return ratios

    def sample_groups(self, gid: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Ratios of the member blocks given their group ids (non-decreasing 0, 0, 1, 2, 2, ...)."""
        raise NotImplementedError


def _slots(gid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(group sizes, first member index of each group, slot of each member block inside its group)."""
    sizes = np.bincount(gid)
    starts = np.cumsum(sizes) - sizes
    return sizes, starts, np.arange(gid.size) - starts[gid]


def _rising(gid: np.ndarray, floor: np.ndarray, draw: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """Slot by slot, each member's level is `draw(floor)` of its group, and becomes the floor of the next member:
    the chain schedulers' non-decreasing levels (the draws happen slot-major, as the seeded rows expect)."""
    slot = _slots(gid)[2]
    out = np.empty(gid.size)
    for s in range(int(slot.max()) + 1):
        at = slot == s
        t = draw(floor[gid[at]])
        floor[gid[at]] = t
        out[at] = t
    return out


class ChainUniform(NoiseScheduler):
    def sample_groups(self, gid: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        t_low, t_eff = self.cfg.t_low, self.cfg.t_eff
        floor = rng.uniform(t_low, t_eff, size=np.bincount(gid).size)
        return _rising(gid, floor, lambda c: rng.uniform(c, t_eff))


class D2FMonotonic(NoiseScheduler):
    def sample_groups(self, gid: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        t_low, t_high = self.cfg.t_low, self.cfg.t_high
        sizes, starts, slot = _slots(gid)
        base = rng.uniform(t_low, t_high, size=sizes.size)
        max_step = (t_high - base) / np.maximum(sizes - 1, 1)
        inc = rng.uniform(0.0, 1.0, size=gid.size) * max_step[gid]
        inc[slot == 0] = 0.0
        csum = np.cumsum(inc)
        return np.minimum(base[gid] + csum - csum[starts][gid], t_high)


class RandomPowerLawChain(NoiseScheduler):
    def sample_groups(self, gid: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        t_eff, gamma = self.cfg.t_eff, self.cfg.gamma_rand
        floor = np.full(np.bincount(gid).size, self.cfg.t_low)
        return _rising(gid, floor, lambda c: c + (t_eff - c) * (1.0 - (1.0 - rng.random(c.size)) ** gamma))


class RandomIID(NoiseScheduler):
    def sample_groups(self, gid: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        t_low, t_high = self.cfg.t_low, self.cfg.t_high
        return t_low + (t_high - t_low) * rng.random(gid.size) ** self.cfg.gamma_rand


class SortedUniform(NoiseScheduler):
    def sample_groups(self, gid: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        u = rng.uniform(self.cfg.t_low, self.cfg.t_high, size=gid.size)
        return u[np.lexsort((u, gid))]


class ExplicitSlots(NoiseScheduler):
    def sample_groups(self, gid: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        _, _, slot = _slots(gid)
        ranges = np.asarray(self.cfg.slot_ranges, dtype=np.float64)
        if slot.max() >= len(ranges):
            raise ValueError(f"a noise-group has {slot.max() + 1} blocks but slot_ranges gives {len(ranges)} ranges")
        lo, hi = ranges[slot, 0], ranges[slot, 1]
        return lo + (hi - lo) * rng.random(gid.size)


class LinearRamp(NoiseScheduler):
    def sample_groups(self, gid: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        t_low, t_eff = self.cfg.t_low, self.cfg.t_eff
        sizes, _, slot = _slots(gid)
        n = sizes[gid]
        single = rng.uniform(t_low, t_eff, size=sizes.size)[gid]
        return np.where(n > 1, t_low + (t_eff - t_low) * slot / np.maximum(n - 1, 1), single)


_SCHEDULERS: dict[str, type[NoiseScheduler]] = {
    "chain_uniform": ChainUniform,
    "d2f": D2FMonotonic,
    "random": RandomPowerLawChain,
    "random_iid": RandomIID,
    "sorted_uniform": SortedUniform,
    "explicit_slots": ExplicitSlots,
    "linear": LinearRamp,
}


def build_scheduler(cfg: SchedulerConfig) -> NoiseScheduler:
    return _SCHEDULERS[cfg.name](cfg)
