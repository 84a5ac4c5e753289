"""TP=2 over two gloo processes gives the same logits as TP=1, for both families, with and without cache."""

import pytest
import torch
import torch.multiprocessing as mp

from mbd.model import KVCache, TPGroup, load_checkpoint, save_checkpoint, build_model
from mbd.model.attention import Cached, Masked
from mbd.model.masks import block_causal_dense
from tests.conftest import tiny_cfg
from tests.unit.gloo import free_port, gloo_group


def _forward(model, cfg, ids):
    B = cfg.block_size
    pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    full = model(ids, pos, Masked(block_causal_dense(pos, ids.shape[1], torch.full((ids.shape[0],), ids.shape[1]), B)))
    cache = KVCache(cfg, ids.shape[0], ids.shape[1], tp=model.tp)
    parts = []
    for j in range(0, ids.shape[1], B):
        p = pos[:, j:j + B]
        parts.append(model(ids[:, j:j + B], p, Cached(cache, block_causal_dense(p, cache.size, cache.lengths + B, B), p)))
        cache.commit(torch.arange(ids.shape[0]), B)
    return full, torch.cat(parts, 1)


def _worker(rank, world, port, ckpt, ids, out):
    with gloo_group(rank, world, port):
        model, cfg = load_checkpoint(ckpt, tp=TPGroup(rank, world))
        with torch.no_grad():
            full, cached = _forward(model, cfg, ids)
        if rank == 0:
            torch.save({"full": full, "cached": cached}, out)


@pytest.mark.parametrize("tied", [False, True])
def test_tp2_equals_tp1(tmp_path, family, tied):
    cfg = tiny_cfg(family, tie_word_embeddings=tied)
    save_checkpoint(build_model(cfg, seed=7), cfg, tmp_path / "ck")
    model, _ = load_checkpoint(tmp_path / "ck")
    ids = torch.randint(0, 60, (2, 12))
    with torch.no_grad():
        want_full, want_cached = _forward(model, cfg, ids)
    out = tmp_path / "out.pt"
    mp.start_processes(_worker, args=(2, free_port(), str(tmp_path / "ck"), ids, str(out)), nprocs=2, start_method="spawn")
    got = torch.load(out, weights_only=True)
    torch.testing.assert_close(got["full"], want_full, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got["cached"], want_cached, atol=1e-5, rtol=1e-4)
