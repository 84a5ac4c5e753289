"""MultiTF objectives, collation and the on-the-fly row stream, on hand-built examples."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mbd.config import ConfigError
from mbd.model import build_model
from mbd.multitf.batching import KINDS, OnTheFlyRows, StepSampler, block_slots, collate, rows_to_columns
from mbd.multitf.corrupt import expand_sequence
from mbd.multitf.masks import dense_reference
from mbd.multitf.objectives import (compute_objective, loss_stats, multitf_ce, oput_self_denoise_ids,
                                    sdar_weighted_ce, stats_metrics, stats_size)
from mbd.multitf.schedulers import SchedulerConfig, build_scheduler
from mbd.multitf.rows import LayoutSection, TokenizedSequence, tf_row
from mbd.model.attention import Masked
from mbd.multitf.objectives import ObjectiveSection
from mbd.train_config import DeepSpeedSection, load_train_config
from tests.conftest import tiny_cfg

M = 9  # mask id of the hand-built examples (vocab 10)


def nll(logits_row: torch.Tensor, target: int) -> float:
    return -torch.log_softmax(logits_row.double(), -1)[target].item()


def hand_example():
    torch.manual_seed(0)
    clean = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8], [2, 2, 2, 2, 3, 3, 3, 3]])
    noisy = torch.tensor([[1, M, 3, M, M, M, 7, 8], [2, 2, 2, 2, 3, 3, 3, 3]])  # row 2: nothing masked
    logits = torch.randn(2, 8, 10)
    return logits, clean, noisy


def test_multitf_ce_is_the_per_row_masked_mean():
    logits, clean, noisy = hand_example()
    row0 = [nll(logits[0, i], int(clean[0, i])) for i in (1, 3, 4, 5)]
    expected = (sum(row0) / 4 + 0.0) / 2  # the unmasked row contributes 0
    assert multitf_ce(logits, clean, noisy, M).item() == pytest.approx(expected, rel=1e-6)


def test_sdar_weighting_equals_the_formula():
    logits, clean, noisy = hand_example()
    ratio = torch.tensor([[0.25, 0.75], [0.0, 0.0]])
    blocks = torch.tensor([2, 2])
    eps = 1e-3
    # masked positions 1, 3 lie in block 0 (positions 0-3), 4, 5 in block 1
    b0 = (nll(logits[0, 1], 2) + nll(logits[0, 3], 4)) / 0.25
    b1 = (nll(logits[0, 4], 5) + nll(logits[0, 5], 6)) / 0.75
    expected = ((b0 + b1) / 2 + 0.0) / 2
    got = sdar_weighted_ce(logits, clean, noisy, M, ratio, blocks, block_size=4, eps=eps)
    assert got.item() == pytest.approx(expected, rel=1e-6)
    # eps guards tiny ratios: t = 1e-5 is divided as if it were eps
    tiny = torch.tensor([[1e-5, 0.75], [0.0, 0.0]])
    got = sdar_weighted_ce(logits, clean, noisy, M, tiny, blocks, block_size=4, eps=eps)
    assert got.item() == pytest.approx(((b0 * 0.25 / eps + b1) / 2) / 2, rel=1e-6)


def test_oput_input_replaces_exactly_the_masked_positions_and_never_with_the_mask_token():
    logits, clean, noisy = hand_example()
    logits[0, 3, M] = 100.0  # the mask token is the argmax at one masked position
    ids = oput_self_denoise_ids(noisy, logits, M)
    masked = noisy == M
    assert not (ids == M).any()
    assert torch.equal(ids[~masked], noisy[~masked])
    expected = logits.clone()
    expected[..., M] = -math.inf
    assert torch.equal(ids[masked], expected.argmax(-1)[masked])


# ---------------------------------------------------------------- collation

def rows_for(block_size=4, gmax=3, n_rand=1, seed=0):
    sched = build_scheduler(SchedulerConfig(t_low=0.3, t_high=1.0))
    seqs = [(np.r_[np.arange(5) + 1, np.arange(9) + 10, [62], [61] * 5], 5, 10),  # K = 5, prompt tail in block 1
            (np.r_[np.arange(8) + 1, np.arange(7) + 20, [62]], 8, 8)]  # K = 4
    rows = []
    for sid, (ids, p, r) in enumerate(seqs):
        rows += expand_sequence(ids.astype(np.int32), p, r, block_size=block_size, gmax=gmax, n_rand=n_rand,
                                scheduler=sched, mask_token_id=63, seed=seed, seq_id=sid, epoch=0)[-2:]
    return rows


def test_collate_builds_dual_stream_inputs_and_the_reference_mask():
    rows = rows_for()
    batch = collate(rows_to_columns(rows), block_size=4, pad_token_id=61)
    L = 20
    assert batch.input_ids.shape == (4, 2 * L)
    assert torch.equal(batch.position_ids[0], torch.arange(L).repeat(2))
    for i, r in enumerate(rows):
        n = len(r["clean_ids"])
        assert batch.noisy_ids[i, :n].tolist() == list(r["noisy_ids"])
        assert batch.input_ids[i, L:L + n].tolist() == list(r["clean_ids"])
        assert (batch.input_ids[i, n:L] == 61).all()
        bg = np.full(L // 4, -1)
        bg[: n // 4] = r["block_group"]
        assert torch.equal(batch.mask[i, 0], dense_reference(bg, r["total_len"], 4))
        assert batch.num_blocks[i] == n // 4
        assert KINDS[batch.kind[i]] == r["layout_kind"]


def test_block_slots_count_positions_inside_each_group():
    bg = torch.tensor([[-1, 0, 0, 0, 1, 1, 2, -1], [-1, -1, 0, 1, 1, 1, 1, 2]])
    assert block_slots(bg).tolist() == [[-1, 0, 1, 2, 0, 1, 0, -1], [-1, -1, 0, 0, 1, 2, 3, 0]]


def test_tf_row_has_singleton_groups_and_the_standard_tf_mask():
    seq = TokenizedSequence(7, np.r_[np.arange(6) + 1, np.arange(9) + 20, [62]].astype(np.int32), 6, 10)
    sched = build_scheduler(SchedulerConfig(name="random", t_low=0.5, t_high=1.0))
    row = tf_row(seq, block_size=4, scheduler=sched, mask_token_id=63, seed=0, epoch=0)
    assert row["block_group"].tolist() == [-1, 0, 1, 2]
    b = collate(rows_to_columns([row]), block_size=4, pad_token_id=61)
    mask = b.mask[0, 0]
    blk = torch.arange(16) // 4
    for i in range(4, 16):  # noisy response tokens
        sees_noisy = mask[i, :16]
        sees_clean = mask[i, 16:]
        assert torch.equal(sees_noisy, blk == blk[i])  # only its own noisy block
        assert torch.equal(sees_clean, blk < blk[i])  # and the clean blocks before it
    # every block masks floor(B t) of its response positions (prompt positions 4, 5 stay clean)
    noisy = row["noisy_ids"]
    assert (noisy[:6] != 63).all()
    counts = [(noisy[4 * k:4 * k + 4] == 63).sum() for k in (1, 2, 3)]
    maskable = [2, 4, 4]
    assert counts == [min(math.floor(4 * float(row["block_ratio"][k])), maskable[k - 1]) for k in (1, 2, 3)]


def test_loss_stats_split_by_kind_and_slot():
    rows = rows_for()
    batch = collate(rows_to_columns(rows), block_size=4, pad_token_id=61)
    ce = torch.rand(batch.noisy_ids.shape)
    masked = batch.noisy_ids == 63
    stats = loss_stats(batch, ce, masked, max_slots=3)
    assert stats.shape == (stats_size(3),)
    metrics = stats_metrics(stats, 3)
    assert metrics["masked_tokens"] == masked.sum().item()
    slot = batch.block_slot.repeat_interleave(4, 1)
    for j in range(3):
        sel = masked & (slot == j)
        if sel.any():
            assert metrics[f"ce/slot{j}"] == pytest.approx(ce[sel].double().mean().item())
    for k, kind in enumerate(KINDS):
        sel = masked & (batch.kind == k).unsqueeze(1)
        if sel.any():
            assert metrics[f"ce/{kind}"] == pytest.approx(ce[sel].double().mean().item())


# ---------------------------------------------------------------- objectives through a model

def oput_reference(logits, batch, rows):
    """DMax OPUT supervises every position after the prompt of a row (answer + its trailing
    block-alignment pads), masked or not; mean per row, then over rows."""
    losses = []
    for i, r in enumerate(rows):
        pos = range(int(r["prompt_len"]), len(r["clean_ids"]))
        ce = [torch.nn.functional.cross_entropy(logits[i, p].float(), batch.clean_ids[i, p]) for p in pos]
        losses.append(torch.stack(ce).mean())
    return torch.stack(losses).mean()


def test_oput_targets_cover_unmasked_answer_and_trailing_pads():
    rows = rows_for()
    batch = collate(rows_to_columns(rows), block_size=4, pad_token_id=61)
    t = batch.targets
    assert t[0].tolist() == [False] * 5 + [True] * 15  # row 0: prompt 5, answer 10 (+EOS), 5 pads, L = 20
    assert t[2].tolist() == [False] * 8 + [True] * 8 + [False] * 4  # 16 tokens, then batch padding
    assert (t & (batch.noisy_ids != 63)).any()  # targets the masked-only CE would skip


def test_sdar_self_normalized_is_the_authors_ratio():
    """The authors' normalisation: sum_M CE_i / t_i / sum_M 1 / t_i (one process)."""
    model = build_model(tiny_cfg(), seed=0)
    batch = collate(rows_to_columns(rows_for()), block_size=4, pad_token_id=61)
    obj = ObjectiveSection(name="sdar_weighted_ce", sdar_normalisation="self_normalized")
    out = compute_objective(lambda i, p, m: model(i, p, m), batch, obj, 63)
    L = batch.noisy_ids.shape[1]
    with torch.no_grad():
        logits = model(batch.input_ids, batch.position_ids, Masked(batch.mask))[:, :L]
    num = den = 0.0
    for i in range(batch.rows):
        for p in range(L):
            if batch.noisy_ids[i, p] == 63:
                w = 1.0 / max(float(batch.block_ratio[i, p // 4]), obj.sdar_eps)
                num += w * float(torch.nn.functional.cross_entropy(logits[i, p], batch.clean_ids[i, p]))
                den += w
    assert out.loss.item() == pytest.approx(num / den, rel=1e-5)
    # two workers holding the same micro-batch: each scales by 2 and divides by the doubled denominator
    two = compute_objective(lambda i, p, m: model(i, p, m), batch, obj, 63, global_sum=lambda x: 2 * x, world=2)
    assert two.loss.item() == pytest.approx(num / den, rel=1e-5)


@pytest.mark.parametrize("name", ["multitf_ce", "sdar_weighted_ce", "dmax_oput"])
def test_compute_objective_matches_the_definitions(name):
    cfg = tiny_cfg()
    model = build_model(cfg, seed=0)
    batch = collate(rows_to_columns(rows_for()), block_size=4, pad_token_id=61)
    calls = []

    def forward(ids, pos, attn):
        calls.append(ids.clone())
        return model(ids, pos, attn)

    obj = ObjectiveSection(name=name, oput_weight=0.5)
    out = compute_objective(forward, batch, obj, cfg.mask_token_id)
    L = batch.noisy_ids.shape[1]
    logits = model(batch.input_ids, batch.position_ids, Masked(batch.mask))[:, :L]
    std = multitf_ce(logits, batch.clean_ids, batch.noisy_ids, 63)
    if name == "multitf_ce":
        expected = std
    elif name == "sdar_weighted_ce":
        expected = sdar_weighted_ce(logits, batch.clean_ids, batch.noisy_ids, 63, batch.block_ratio,
                                    batch.num_blocks, 4, obj.sdar_eps)
    else:
        assert len(calls) == 2
        second = calls[1][:, :L]
        assert not (second == 63).any()
        assert torch.equal(calls[1][:, L:], batch.clean_ids)
        sd_ids = oput_self_denoise_ids(batch.noisy_ids, logits, 63)
        assert torch.equal(second, sd_ids)
        sd_logits = model(batch.with_noisy(sd_ids).input_ids, batch.position_ids, Masked(batch.mask))[:, :L]
        expected = oput_reference(logits, batch, rows_for()) + 0.5 * oput_reference(sd_logits, batch, rows_for())
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-5)
    out.loss.backward()  # gradients flow (through both OPUT branches' forwards with grad)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad and p.dim() > 1)


def test_flex_block_mask_gives_the_dense_logits():
    model = build_model(tiny_cfg(), seed=0)
    cols = rows_to_columns(rows_for())
    dense = collate(cols, block_size=4, pad_token_id=61)
    flex = collate(cols, block_size=4, pad_token_id=61, attention="flex")
    with torch.no_grad():  # FlexAttention has no backward on CPU: training uses it on GPU only
        a = model(dense.input_ids, dense.position_ids, Masked(dense.mask))
        b = model(flex.input_ids, flex.position_ids, Masked(flex.mask))
    real = (torch.arange(20) < dense.total_len.unsqueeze(1)).repeat(1, 2)
    torch.testing.assert_close(a[real], b[real], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- on-the-fly rows and the step sampler

def test_on_the_fly_rows_equal_the_expansion_rows():
    ids = np.r_[np.arange(5) + 1, np.arange(10) + 10, [62]].astype(np.int32)
    seq = TokenizedSequence(11, ids, 5, 11)
    layouts = LayoutSection(gmax=3, n_rand=2, scheduler=SchedulerConfig())
    src = OnTheFlyRows([seq], layouts, block_size=4, mask_token_id=63, seed=3)
    ref = expand_sequence(ids, 5, 11, block_size=4, gmax=3, n_rand=2, scheduler=build_scheduler(SchedulerConfig()),
                          mask_token_id=63, seed=3, seq_id=11, epoch=1)
    assert src.rows_per_epoch == len(ref) == 7
    for j, r in enumerate(ref):
        got = src.row(1, j)
        assert np.array_equal(got["noisy_ids"], r["noisy_ids"]) and got["layout_index"] == r["layout_index"]


def test_step_sampler_splits_the_global_batch_across_ranks_and_micro_batches():
    s = StepSampler(rows_per_epoch=50, micro_batch=2, grad_accum=3, world=2, seed=1)
    assert s.global_batch == 12 and s.steps_per_epoch == 4
    seen = []
    for step in range(1, 5):
        epoch, rows = s.global_rows(step)
        parts = [s.micro_rows(step, r, m)[1] for m in range(3) for r in range(2)]
        assert np.array_equal(np.concatenate(parts), rows)
        seen += rows.tolist()
    assert len(set(seen)) == 48  # one epoch: no row twice
    assert s.global_rows(5)[0] == 1 and not np.array_equal(s.global_rows(5)[1], s.global_rows(1)[1])
    with pytest.raises(ValueError, match="global batch"):
        StepSampler(rows_per_epoch=5, micro_batch=2, grad_accum=3, world=1, seed=0)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    ds = DeepSpeedSection(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    assert [ds.lr_factor(s, 20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert ds.lr_factor(4, 20) == pytest.approx(1.0)
    assert ds.lr_factor(12, 20) == pytest.approx(0.55)
    assert ds.lr_factor(20, 20) == pytest.approx(0.1)
    cfg = DeepSpeedSection(zero_stage=3, micro_batch_size=2, grad_accum=4).ds_config(use_gpu=False)
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["bf16"]["enabled"] is False
    assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["gradient_accumulation_steps"] == 4


# ---------------------------------------------------------------- training configs

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "train"


@pytest.mark.parametrize("path", sorted(p for p in CONFIGS.glob("*.yaml") if not p.stem.startswith("tiny_pretrain")),
                         ids=lambda p: p.stem)
def test_every_train_config_validates(path):
    cfg = load_train_config(path)
    assert cfg.steps > 0 and cfg.layouts.gmax >= 2


def test_tiny_pretrain_config_is_teacher_forcing():
    from pipelines.pretrain_tiny import DEFAULT_CONFIG, load_pretrain_config

    cfg = load_pretrain_config(DEFAULT_CONFIG, [], None, None)
    assert cfg.train.layouts.mode == "tf" and cfg.train.steps > 0


def test_train_configs_cover_the_paper_table():
    rows = {p.stem: load_train_config(p) for p in CONFIGS.glob("mbd-*.yaml")}
    assert len(rows) == 8  # tab:appendix_train_hparams has 8 rows
    got = {(c.objective.name, c.layouts.gmax, c.layouts.n_rand, c.steps) for c in rows.values()}
    assert ("dmax_oput", 2, 2, 4000) in got and ("sdar_weighted_ce", 4, 2, 200) in got
    assert all(c.data.max_length == 2048 and c.layouts.scheduler.t_low == 0.001 for c in rows.values())


def test_bad_train_config_names_the_field(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("run: {name: x}\nmodel_path: m\ndata: {jsonl: a.jsonl, parquet: rows}\nsteps: 1\n")
    with pytest.raises(ConfigError, match="data"):
        load_train_config(p)
    p.write_text("run: {name: x}\nmodel_path: m\ndata: {jsonl: a.jsonl}\nsteps: 1\ndeepspeed: {zero_stage: 1}\n")
    with pytest.raises(ConfigError, match="deepspeed.zero_stage"):
        load_train_config(p)
