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


CASES = [(family, tied) for family in ("sdar", "llada2_moe") for tied in (False, True)]


def _worker(rank, world, port, root, out):
    """Every case's checkpoint as this rank's shard: one pair of processes for all cases (a spawn costs seconds)."""
    with gloo_group(rank, world, port):
        got = {}
        for family, tied in CASES:
            case = f"{family}-{tied}"
            model, cfg = load_checkpoint(f"{root}/{case}", tp=TPGroup(rank, world))
            ids = torch.load(f"{root}/{case}/ids.pt", weights_only=True)
            with torch.no_grad():
                got[case] = dict(zip(("full", "cached"), _forward(model, cfg, ids)))
        if rank == 0:
            torch.save(got, out)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """case -> (TP=1 outputs, TP=2 outputs) of each family, with and without a tied head."""
    root = tmp_path_factory.mktemp("tp")
    want = {}
    for family, tied in CASES:
        case = f"{family}-{tied}"
        cfg = tiny_cfg(family, tie_word_embeddings=tied)
        save_checkpoint(build_model(cfg, seed=7), cfg, root / case)
        model, _ = load_checkpoint(root / case)
        ids = torch.randint(0, 60, (2, 12))
        torch.save(ids, root / case / "ids.pt")
        with torch.no_grad():
            want[case] = dict(zip(("full", "cached"), _forward(model, cfg, ids)))
    mp.start_processes(_worker, args=(2, free_port(), str(root), str(root / "out.pt")), nprocs=2,
                       start_method="spawn")
    got = torch.load(root / "out.pt", weights_only=True)
    return {case: (want[case], got[case]) for case in want}


@pytest.mark.parametrize("family,tied", CASES)
def test_tp2_equals_tp1(tp2, family, tied):
    want, got = tp2[f"{family}-{tied}"]
    torch.testing.assert_close(got["full"], want["full"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got["cached"], want["cached"], atol=1e-5, rtol=1e-4)
