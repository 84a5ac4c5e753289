"""MultiTF training objectives (paper sec:appendix_objectives), on the noisy half of [x_t ; x_0].

The model predicts the clean token at the same position (no logit shift), and only positions of the
noisy stream that hold the mask token count: M_lambda = {i : x_t[i] = [M]}.

- `multitf_ce` (eq:appendix_multitf_ce): per row (= per layout) the mean CE over M_lambda, then the mean
  over rows. A row with no masked token (possible when t_low * B < 1) contributes 0 rather than NaN.
- `sdar_weighted_ce` (eq:appendix_sdar_multitf_loss): per row (1/K) sum_k 1/max(t_k, eps) sum_{i in M_k} CE_i
  with K the row's own number of blocks (prompt blocks included, batch padding excluded), then the mean
  over rows. Option `sdar_normalisation: self_normalized` is the authors' code instead
  (mbd-lms `compute_self_normalized_ipw_losses`): sum_{i in M} CE_i / t_i / sum_{i in M} 1 / t_i over the
  micro-batch of all data-parallel workers (the denominator is all-reduced; each worker's loss is scaled
  by the world size because DeepSpeed averages gradients).
- DMax OPUT (alg:oput_rollout): the standard branch is CE on x_t; the self-denoising branch replaces the
  masked positions of x_t with the argmax predictions of a no-grad pass. Both branches supervise the
  whole answer plus its trailing block-alignment pads (`Batch.targets`), not only M_lambda, as the
  authors' DMax rollout labels every post-prompt position; per row the mean CE over targets.
  The no-grad pass has the same input as the standard branch, so its logits are the standard branch's
  logits, detached: one forward is saved, nothing changes. The argmax excludes the mask token, so the
  second input has no mask token left.

Per-row losses are averaged over rows, so a global batch split into equal micro-batches and workers
gives the same loss and gradient as one process on the whole batch (the self-normalised SDAR option is
normalised per optimiser micro-step instead, as the authors').
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from mbd.config import StrictModel
from mbd.model.attention import Masked
from mbd.multitf.batching import KINDS, Batch

Forward = Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor]
GlobalSum = Callable[[torch.Tensor], torch.Tensor]  # sum of a detached scalar over data-parallel workers


ObjectiveName = Literal["multitf_ce", "sdar_weighted_ce", "dmax_oput"]
# the objective the paper gives each model family (sec:appendix_objectives): SDAR models the block-wise
# 1/t-weighted CE (sec:appendix_sdar_objective), LLaDA2 the global MultiTF CE
FAMILY_OBJECTIVE: dict[str, ObjectiveName] = {"sdar": "sdar_weighted_ce", "llada2_moe": "multitf_ce"}


class ObjectiveSection(StrictModel):
    name: ObjectiveName = "multitf_ce"
    sdar_eps: float = Field(default=1e-3, gt=0, description="epsilon of eq:appendix_sdar_multitf_loss")
    sdar_normalisation: Literal["paper", "self_normalized"] = Field(
        default="paper", description="paper: eq:appendix_sdar_multitf_loss (1/K per row); self_normalized: the "
        "authors' code, sum_M CE/t / sum_M 1/t over the micro-batch of all workers")
    oput_weight: float = Field(default=1.0, ge=0, description="weight of the DMax OPUT self-denoising branch")


def family_objective(family: str) -> ObjectiveSection:
    """The family's objective with its default options (the SDAR loss normalised as eq:appendix_sdar_multitf_loss)."""
    return ObjectiveSection(name=FAMILY_OBJECTIVE[family])


def masked_positions(noisy_ids: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """M_lambda as a bool [b, L]."""
    return noisy_ids == mask_token_id


def token_ce(logits: torch.Tensor, clean_ids: torch.Tensor) -> torch.Tensor:
    """Per-token CE [b, L] in fp32 of noisy-half logits [b, L, V] against the clean ids."""
    b, n, v = logits.shape
    return F.cross_entropy(logits.float().reshape(b * n, v), clean_ids.reshape(-1), reduction="none").view(b, n)


def multitf_ce(logits: torch.Tensor, clean_ids: torch.Tensor, noisy_ids: torch.Tensor,
               mask_token_id: int) -> torch.Tensor:
    """eq:appendix_multitf_ce on one batch: mean over rows of the mean CE over each row's masked positions."""
    return row_mean_ce(logits, clean_ids, masked_positions(noisy_ids, mask_token_id))


def row_mean_ce(logits: torch.Tensor, clean_ids: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Mean over rows of the mean CE over each row's positions `where` [b, L] (0 for an empty row)."""
    ce = token_ce(logits, clean_ids) * where
    return (ce.sum(1) / where.sum(1).clamp(min=1)).mean()


def sdar_weighted_ce(logits: torch.Tensor, clean_ids: torch.Tensor, noisy_ids: torch.Tensor, mask_token_id: int,
                     block_ratio: torch.Tensor, num_blocks: torch.Tensor, block_size: int,
                     eps: float = 1e-3) -> torch.Tensor:
    """eq:appendix_sdar_multitf_loss on one batch (block_ratio [b, K], num_blocks [b])."""
    b, n = clean_ids.shape
    masked = masked_positions(noisy_ids, mask_token_id)
    per_block = (token_ce(logits, clean_ids) * masked).view(b, n // block_size, block_size).sum(-1)
    weighted = per_block / block_ratio.float().clamp(min=eps)
    return (weighted.sum(1) / num_blocks.float()).mean()


def sdar_self_normalized_ce(logits: torch.Tensor, clean_ids: torch.Tensor, noisy_ids: torch.Tensor,
                            mask_token_id: int, block_ratio: torch.Tensor, block_size: int, eps: float = 1e-3,
                            global_sum: GlobalSum | None = None, world: int = 1) -> torch.Tensor:
    """The authors' SDAR loss: sum_M CE_i / t_i / sum_M 1 / t_i, the denominator summed over `world` workers
    by `global_sum` (None: one process); scaled by `world` so that averaged worker gradients equal the
    gradient of the global ratio."""
    masked = masked_positions(noisy_ids, mask_token_id)
    w = masked / block_ratio.float().clamp(min=eps).repeat_interleave(block_size, dim=1)
    den = w.sum().detach()
    if global_sum is not None:
        den = global_sum(den)
    return world * (token_ce(logits, clean_ids) * w).sum() / den.clamp(min=1e-6)


def oput_self_denoise_ids(noisy_ids: torch.Tensor, logits: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """alg:oput_rollout: masked positions of x_t replaced by the argmax prediction (never the mask token)."""
    with torch.no_grad():
        scores = logits.detach().clone()
        scores[..., mask_token_id] = float("-inf")
        pred = scores.argmax(-1)
    masked = masked_positions(noisy_ids, mask_token_id)
    return torch.where(masked, pred, noisy_ids)


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor  # scalar with grad
    ce: torch.Tensor  # [b, L] detached per-token CE of the standard branch
    masked: torch.Tensor  # [b, L] M_lambda
    parts: dict[str, float]  # branch losses (OPUT: standard / self-denoise)


def compute_objective(forward: Forward, batch: Batch, cfg: ObjectiveSection, mask_token_id: int,
                      global_sum: GlobalSum | None = None, world: int = 1) -> ObjectiveOutput:
    """Run the model on the batch and evaluate the configured objective on the noisy half. `global_sum` /
    `world`: the data-parallel reduction, used only by the self-normalised SDAR loss."""
    n = batch.noisy_ids.shape[1]
    logits = forward(batch.input_ids, batch.position_ids, Masked(batch.mask))[:, :n]
    masked = masked_positions(batch.noisy_ids, mask_token_id)
    ce = token_ce(logits.detach(), batch.clean_ids)
    if cfg.name == "sdar_weighted_ce":
        if cfg.sdar_normalisation == "self_normalized":
            loss = sdar_self_normalized_ce(logits, batch.clean_ids, batch.noisy_ids, mask_token_id, batch.block_ratio,
                                           batch.block_size, cfg.sdar_eps, global_sum, world)
        else:
            loss = sdar_weighted_ce(logits, batch.clean_ids, batch.noisy_ids, mask_token_id, batch.block_ratio,
                                    batch.num_blocks, batch.block_size, cfg.sdar_eps)
        return ObjectiveOutput(loss, ce, masked, {})
    if cfg.name == "multitf_ce":
        return ObjectiveOutput(multitf_ce(logits, batch.clean_ids, batch.noisy_ids, mask_token_id), ce, masked, {})
    targets = batch.targets
    loss = row_mean_ce(logits, batch.clean_ids, targets)
    denoised = batch.with_noisy(oput_self_denoise_ids(batch.noisy_ids, logits, mask_token_id))
    logits_sd = forward(denoised.input_ids, denoised.position_ids, Masked(denoised.mask))[:, :n]
    loss_sd = row_mean_ce(logits_sd, batch.clean_ids, targets)
    parts = {"loss_standard": float(loss.detach()), "loss_self_denoise": float(loss_sd.detach())}
    return ObjectiveOutput(loss + cfg.oput_weight * loss_sd, ce, masked, parts)


# ---------------------------------------------------------------- metrics: CE by layout kind and by slot

def stats_size(max_slots: int) -> int:
    return 2 * (len(KINDS) + max_slots) + 1


def loss_stats(batch: Batch, ce: torch.Tensor, masked: torch.Tensor, max_slots: int) -> torch.Tensor:
    """float64 vector of sums that add up across micro-batches and workers (all-reduce SUM):
    [CE sum, count] per layout kind, [CE sum, count] per slot in the noise-group (slots >= max_slots fall
    into the last one), masked-token count."""
    b, n = ce.shape
    m = masked.double()
    ce = ce.double() * m
    slot = batch.block_slot.repeat_interleave(batch.block_size, dim=1).clamp(0, max_slots - 1)
    by_kind = torch.zeros(len(KINDS), 2, dtype=torch.float64, device=ce.device)
    by_kind[:, 0].index_add_(0, batch.kind, ce.sum(1))
    by_kind[:, 1].index_add_(0, batch.kind, m.sum(1))
    by_slot = torch.zeros(max_slots, 2, dtype=torch.float64, device=ce.device)
    by_slot[:, 0].index_add_(0, slot.reshape(-1), ce.reshape(-1))
    by_slot[:, 1].index_add_(0, slot.reshape(-1), m.reshape(-1))
    return torch.cat([by_kind.reshape(-1), by_slot.reshape(-1), m.sum().reshape(1)])


def stats_metrics(stats: torch.Tensor, max_slots: int) -> dict[str, float]:
    """Token-mean CE per layout kind (`ce/<kind>`) and per slot (`ce/slot<i>`), plus `masked_tokens`."""
    s = stats.tolist()
    out: dict[str, float] = {}
    for i, kind in enumerate(KINDS):
        if s[2 * i + 1] > 0:
            out[f"ce/{kind}"] = s[2 * i] / s[2 * i + 1]
    base = 2 * len(KINDS)
    for j in range(max_slots):
        if s[base + 2 * j + 1] > 0:
            out[f"ce/slot{j}"] = s[base + 2 * j] / s[base + 2 * j + 1]
    out["masked_tokens"] = s[-1]
    return out
