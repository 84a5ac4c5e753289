"""Rows per layout mode (the authors' D2F ablation included) and noise redrawn on every training pass."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from pydantic import ValidationError

from mbd.multitf.corrupt import ROW_SCHEMA
from mbd.multitf.rows import LayoutSection, TokenizedSequence, redraw_columns, sequence_rows
from mbd.multitf.schedulers import SchedulerConfig

B, MASK = 4, 99
# 10 blocks of 4: block 0 prompt only, block 1 holds the prompt tail and the response start, 3 trailing pads
SEQ = TokenizedSequence(seq_id=5, clean_ids=(np.arange(40) % 17 + 20).astype(np.int32), prompt_len=6, response_len=31)
MULTITF = LayoutSection(gmax=3, n_rand=2, scheduler=SchedulerConfig())
D2F = LayoutSection(mode="d2f", scheduler=SchedulerConfig(name="linear", t_low=0.001, t_high=1.0, rho=0.01))


def rows(layouts: LayoutSection, epoch: int = 0, seed: int = 3) -> list[dict]:
    return sequence_rows(SEQ, layouts, block_size=B, mask_token_id=MASK, seed=seed, epoch=epoch)


def columns(rs: list[dict]) -> dict[str, list]:
    return {k: [r[k] for r in rs] for k in rs[0]}


def test_d2f_row_is_the_authors_global_linear_schedule():
    """Reference: mbd-lms `noise_schedule_mode: d2f`: ONE buffer over all K = content_length / B blocks
    (`preprocess_input_token_ids_global_linear`), block k's ratio low + (t_eff - low) * k / (K - 1) with
    t_eff = 0.99001, prompt blocks included in the count; no layouts (one row per sequence)."""
    (row,) = rows(D2F)
    k = np.arange(10)
    ramp = 0.001 + (0.99001 - 0.001) * k / 9
    assert row["layout_kind"] == "d2f" and row["block_group"].tolist() == [-1] + [0] * 9
    assert np.allclose(row["block_ratio"], np.where(k >= 1, ramp, 0.0).astype(np.float32))
    masked = (row["noisy_ids"] == MASK).reshape(-1, B)
    maskable = (np.arange(40) >= 6).reshape(-1, B).sum(1)
    assert masked.sum(1).tolist() == np.minimum(np.floor(B * row["block_ratio"].astype(np.float64)),
                                                maskable).astype(int).tolist()
    assert rows(D2F)[0]["noisy_ids"].tolist() == row["noisy_ids"].tolist()  # deterministic ratios, keyed positions
    assert set(row) == set(ROW_SCHEMA)


def test_d2f_mode_requires_the_linear_ramp():
    with pytest.raises(ValidationError, match="linear"):
        LayoutSection(mode="d2f")
    with pytest.raises(ValidationError, match="linear"):
        LayoutSection(scheduler=SchedulerConfig(name="linear"))


@pytest.mark.parametrize("layouts", [MULTITF, D2F, LayoutSection(mode="tf", scheduler=SchedulerConfig(
    name="random_iid", gamma_rand=1.0))], ids=["multitf", "d2f", "tf"])
def test_redraw_gives_each_pass_the_rows_of_its_own_epoch(layouts):
    """Pass p over stored rows of epoch e trains on exactly the rows an expansion of epoch e + p writes: the
    reference is the expansion itself. Pass 0 is the stored rows; no two passes share their masks."""
    stored = columns(rows(layouts, epoch=2))
    assert redraw_columns(stored, 0, block_size=B, mask_token_id=MASK) == stored
    seen = {tuple(np.concatenate(stored["noisy_ids"]))}
    for p in (1, 2, 3):
        got = redraw_columns(stored, p, block_size=B, mask_token_id=MASK)
        want = columns(rows(layouts, epoch=2 + p))
        for key in ("noisy_ids", "block_group", "block_ratio", "clean_ids", "epoch", "layout_index"):
            assert all(np.array_equal(a, b) for a, b in zip(got[key], want[key])), key
        seen.add(tuple(np.concatenate(got["noisy_ids"])))
    assert len(seen) == 4
    assert stored["epoch"] == [2] * len(stored["epoch"])  # the input is not modified


def test_redraw_through_arrow_columns_and_the_train_collate():
    """The Parquet path: rows written with the expansion's Arrow schema, read back as the numpy columns Ray
    Data hands to the training collate, whose pass-1 batch holds the epoch-1 rows."""
    import torch

    from mbd.config import ModelConfig
    from pipelines.expand_layouts import rows_to_table
    from pipelines.train_multitf import RowCollate
    from tests.conftest import tiny_cfg

    table = rows_to_table(rows(MULTITF))
    numpy_batch = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
    mcfg: ModelConfig = tiny_cfg().model_copy(update={"block_size": B, "mask_token_id": MASK})
    batch = RowCollate(mcfg, "dense", torch.device("cpu"), pass_index=1)(numpy_batch)
    want = np.stack([r["noisy_ids"] for r in rows(MULTITF, epoch=1)])
    assert np.array_equal(batch.noisy_ids.numpy(), want)
    old = RowCollate(mcfg, "dense", torch.device("cpu"), pass_index=0)(numpy_batch)
    assert np.array_equal(old.noisy_ids.numpy(), np.stack([r["noisy_ids"] for r in rows(MULTITF)]))
    assert table.column("recipe").type == pa.string()


def test_rows_without_a_recipe_cannot_be_redrawn():
    stored = columns(rows(MULTITF))
    del stored["recipe"]
    with pytest.raises(ValueError, match="recipe"):
        redraw_columns(stored, 1, block_size=B, mask_token_id=MASK)
    stored = columns(rows(MULTITF))
    stored["recipe"] = ["{}"] * len(stored["recipe"])
    with pytest.raises(ValueError, match="re-run `mbd expand`"):
        redraw_columns(stored, 1, block_size=B, mask_token_id=MASK)


def test_reproduce_d2f_variant_expands_the_authors_d2f_rows():
    """`mbd reproduce --parts schedulers`: the D2F variant expands one row per sequence (mode d2f, linear ramp)."""
    from pipelines.expand_layouts import ExpandConfig
    from pipelines.reproduce import variant_expand
    from pipelines.stages import DEFAULT_CONFIG, load_config

    cfg = load_config(DEFAULT_CONFIG)
    d2f, chain = variant_expand(cfg, "d2f"), variant_expand(cfg, "chain")
    assert (d2f.mode, d2f.scheduler.name, chain.mode, chain.scheduler.name) == ("d2f", "linear", "multitf",
                                                                                 "chain_uniform")
    expand = ExpandConfig(inputs=["x.jsonl"], output_dir="o", model_dir="m", mode=d2f.mode, gmax=d2f.gmax,
                          n_rand=d2f.n_rand, scheduler=d2f.scheduler)
    assert expand.layouts().layouts_per_sequence == 1


def test_the_quickstart_masking_reaches_the_rows_and_the_training_record(tmp_path):
    """`expand.masking` (the tiny recipe's bernoulli, eq:forward, since issue 67; floor_count, alg:multitf_training,
    the library's default) is what the expansion corrupts with and what the post-training run records."""
    from pipelines.expand_layouts import ExpandConfig
    from pipelines.stages import DEFAULT_CONFIG, ExpandSection, load_config, train_config

    assert ExpandSection().masking == "floor_count" and ExpandConfig(inputs=["x"], output_dir="o",
                                                                     model_dir="m").masking == "floor_count"
    for sets, masking in (([], "bernoulli"), (["expand.masking=floor_count"], "floor_count")):
        cfg = load_config(DEFAULT_CONFIG, sets)
        e = cfg.expand
        expand = ExpandConfig(inputs=["x.jsonl"], output_dir="o", model_dir="m", gmax=e.gmax, n_rand=e.n_rand,
                              scheduler=e.scheduler, masking=e.masking)
        assert e.masking == expand.layouts().masking == masking
        assert train_config(cfg, tmp_path, Path("mbd/assets/tiny").resolve(), str(tmp_path)).layouts.masking == masking
