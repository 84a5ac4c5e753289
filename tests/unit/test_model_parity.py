"""The sdar backbone equals transformers' Qwen3ForCausalLM on the same weights (block size 1 = causal)."""

import pytest
import torch

from mbd.model import load_checkpoint
from mbd.model.attention import Masked
from mbd.model.masks import block_causal_dense

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("tied", [False, True])
def test_sdar_equals_qwen3(tmp_path, tied):
    hf_cfg = transformers.Qwen3Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=tied, attention_bias=False, torch_dtype="float32",
    )
    torch.manual_seed(0)
    ref = transformers.Qwen3ForCausalLM(hf_cfg).eval()
    for p in ref.parameters():  # random norms too, so q/k norm weights are really exercised
        torch.nn.init.normal_(p, std=0.2)
    if tied:
        ref.tie_weights()
    ref.save_pretrained(tmp_path, safe_serialization=True)
    # an SDAR checkpoint is a Qwen3 one with the SDAR architecture and diffusion fields
    import json
    cfg_path = tmp_path / "config.json"
    d = json.loads(cfg_path.read_text())
    d.update(architectures=["SDARForCausalLM"], model_type="sdar", mask_token_id=95, block_size=1, eos_token_id=94)
    cfg_path.write_text(json.dumps(d))

    model, cfg = load_checkpoint(tmp_path)
    ids = torch.randint(0, 95, (2, 17))
    pos = torch.arange(17).expand(2, -1)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = model(ids, pos, Masked(block_causal_dense(pos, 17, torch.full((2,), 17), block_size=1)))
    diff = (want - got).abs().max().item()
    print(f"max abs logit diff vs Qwen3ForCausalLM: {diff:.2e}")
    assert diff < 1e-4, diff
