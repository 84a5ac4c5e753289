"""The plain transformers loop of benchmarks/hf_baseline.py (independent code: Qwen3ForCausalLM, DynamicCache,
4D mask) decodes exactly what our engine's SingleBD decodes on the same weights: the benchmark's baseline is
the same algorithm, and our SingleBD is cross-checked against an implementation that shares none of its code."""

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks.hf_baseline import PlainBlockDiffusion, random_sdar, singlebd_config, to_qwen3  # noqa: E402
from mbd.decoding import Engine, EngineConfig  # noqa: E402


@pytest.mark.parametrize("block,plen", [(4, 10), (8, 16)])
def test_plain_loop_equals_engine_singlebd(block, plen):
    model, cfg = random_sdar("tiny", block, 256)
    hf = to_qwen3(model, cfg)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size - 2, (3, plen), generator=g).tolist()
    budgets = [7, 24, 13]  # the lock-step batch runs to its longest row; each row stops at its own budget
    plain = PlainBlockDiffusion(hf, block, cfg.mask_token_id, {cfg.eos_token_id}).generate(prompts, 0.3, budgets, 256)
    engine = Engine(model, None, singlebd_config(0.3, 24, 256), EngineConfig(max_batch_rows=3))
    ids = [engine.add_request(p, {"max_new_tokens": n}) for p, n in zip(prompts, budgets)]
    got = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    assert [got[i] for i in ids] == plain.token_ids
    assert [len(t) for t in plain.token_ids] == budgets
    # the plain loop's forwards: per block, the slowest row's denoising forwards + one store forward
    assert plain.nfe >= max(budgets) // block
