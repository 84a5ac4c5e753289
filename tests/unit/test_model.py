"""Backbone invariants: attention backends agree, KV-cached decoding equals recomputation, checkpoints
round-trip, LLaDA2 routing matches a per-token reference, bad checkpoints fail clearly."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from mbd.model import CheckpointError, KVCache, build_model, load_checkpoint, save_checkpoint
from mbd.model.attention import Cached, Masked
from mbd.model.layers import attend, rope_cos_sin
from mbd.model.masks import block_causal_dense
from tests.conftest import tiny_cfg


def block_causal_block_mask(q_pos: torch.Tensor, kv_len: int, visible: torch.Tensor, block_size: int):
    """The same rule as `block_causal_dense`, as a FlexAttention mask_mod (the generic create_block_mask path)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, n = q_pos.shape

    def mask_mod(bi, h, qi, ki):
        p = q_pos[bi, qi]
        return ((ki < visible[bi]) & (ki // block_size <= p // block_size)) | (ki == p)

    return create_block_mask(mask_mod, b, None, n, kv_len, device=q_pos.device)


@pytest.mark.parametrize("n,block", [(16, 4), (40, 8), (33, 4), (128, 32)])
def test_flex_equals_sdpa(n, block):
    torch.manual_seed(n)
    q, k, v = torch.randn(2, 4, n, 16), torch.randn(2, 2, n, 16), torch.randn(2, 2, n, 16)
    pos = torch.arange(n).expand(2, -1)
    visible = torch.tensor([n, n - 5])
    dense = attend(q, k, v, block_causal_dense(pos, n, visible, block))
    flex = attend(q, k, v, block_causal_block_mask(pos, n, visible, block))
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


def full_logits(model, ids, block):
    pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    return model(ids, pos, Masked(block_causal_dense(pos, ids.shape[1], torch.full((ids.shape[0],), ids.shape[1]), block)))


def test_kv_cached_blocks_equal_full_forward(family):
    cfg = tiny_cfg(family)
    model = build_model(cfg).eval()
    B, L = cfg.block_size, 6 * cfg.block_size
    ids = torch.randint(0, 60, (2, L))
    with torch.no_grad():
        want = full_logits(model, ids, B)
        cache = KVCache(cfg, rows=2, max_len=L)
        got = []
        for j in range(0, L, B):
            pos = torch.arange(j, j + B).expand(2, -1)
            mask = block_causal_dense(pos, cache.size, cache.lengths + B, B)
            got.append(model(ids[:, j:j + B], pos, Cached(cache, mask, pos)))
            cache.commit(torch.arange(2), B)
    torch.testing.assert_close(torch.cat(got, 1), want, atol=1e-4, rtol=1e-4)


def test_checkpoint_round_trip(tmp_path, family):
    cfg = tiny_cfg(family)
    model = build_model(cfg, seed=3).eval()
    if family == "llada2_moe":  # a non-zero expert bias must survive the round trip and change routing
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.expert_bias.copy_(torch.randn(cfg.num_experts))
    save_checkpoint(model, cfg, tmp_path / "a", shard_bytes=20_000)
    assert (tmp_path / "a" / "model.safetensors.index.json").is_file()
    loaded, cfg2 = load_checkpoint(tmp_path / "a")
    assert cfg2 == cfg
    ids = torch.randint(0, 60, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(full_logits(loaded, ids, 4), full_logits(model, ids, 4), atol=0, rtol=0)


def test_the_skeleton_has_the_built_models_parameters(family):
    """The loader's meta-device skeleton (initialisers skipped) names, shapes and types what a built model holds."""
    from mbd.model.checkpoint import skeleton

    cfg = tiny_cfg(family)
    meta = {k: (v.shape, v.dtype, v.device.type) for k, v in skeleton(cfg).state_dict().items()}
    built = {k: (v.shape, v.dtype, "meta") for k, v in build_model(cfg).state_dict().items()}
    assert meta == built


def test_llada2_accepts_e_score_correction_bias(tmp_path):
    cfg = tiny_cfg("llada2_moe")
    model = build_model(cfg, seed=1).eval()
    save_checkpoint(model, cfg, tmp_path)
    from safetensors.torch import load_file
    sd = load_file(tmp_path / "model.safetensors")
    sd = {k.replace("gate.expert_bias", "gate.e_score_correction_bias"): v + (k.endswith("expert_bias") * 0.5)
          for k, v in sd.items()}
    save_file(sd, str(tmp_path / "model.safetensors"))
    loaded, _ = load_checkpoint(tmp_path)
    assert torch.all(loaded.model.layers[1].mlp.gate.expert_bias == 0.5)


def reference_route(gate, x, cfg):
    """Straightforward per-token DeepSeek-V3-style group-limited routing with sigmoid scores."""
    out = []
    per_group = cfg.num_experts // cfg.n_group
    for t in range(x.shape[0]):
        s = torch.sigmoid(gate.weight.float() @ x[t].float())
        c = s + gate.expert_bias
        gscore = [sorted(c[g * per_group:(g + 1) * per_group].tolist(), reverse=True)[:2] for g in range(cfg.n_group)]
        gscore = [sum(v) for v in gscore]
        groups = sorted(range(cfg.n_group), key=lambda g: -gscore[g])[:cfg.topk_group]
        allowed = [e for e in range(cfg.num_experts) if e // per_group in groups]
        chosen = sorted(allowed, key=lambda e: -c[e].item())[:cfg.num_experts_per_tok]
        w = torch.stack([s[e] for e in chosen])
        w = w / w.sum() * cfg.routed_scaling_factor
        out.append(dict(zip(chosen, w.tolist())))
    return out


def test_llada2_routing_matches_reference():
    cfg = tiny_cfg("llada2_moe")
    model = build_model(cfg, seed=5)
    gate = model.model.layers[1].mlp.gate
    gate.expert_bias.copy_(torch.randn(cfg.num_experts) * 0.1)
    x = torch.randn(20, cfg.hidden_size)
    idx, w = gate(x)
    ref = reference_route(gate, x, cfg)
    for t in range(20):
        got = dict(zip(idx[t].tolist(), w[t].tolist()))
        assert got.keys() == ref[t].keys()
        for e in got:
            assert abs(got[e] - ref[t][e]) < 1e-5
    # the MoE output equals the explicit weighted sum over chosen experts plus the shared expert
    moe = model.model.layers[1].mlp
    y = moe(x.unsqueeze(0))[0]
    want = torch.stack([sum(ref[t][e] * expert(moe, e, x[t]) for e in ref[t]) + moe.shared_experts(x[t:t + 1])[0]
                        for t in range(20)])
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)


def expert(moe, e: int, x: torch.Tensor) -> torch.Tensor:
    """Routed expert e of a LLaDA2 MoE on one token, from its stacked weights (HF's per-expert SwiGLU)."""
    ex = moe.experts
    return (F.silu(x @ ex.gate_proj[e].T) * (x @ ex.up_proj[e].T)) @ ex.down_proj[e].T


def test_grouped_expert_dispatch_equals_the_loop():
    """bfloat16 runs the experts as grouped GEMMs over tokens sorted by expert (static shapes, no host sync);
    float64 the loop over the experts some token chose (`fused_moe.expert_path`). Both equal the per-token loop
    over the chosen experts, written here in float64 from the same (bf16) weights, with experts no token chose (an
    empty group inside the offsets and one at their end) and a token choosing adjacent experts."""
    cfg = tiny_cfg("llada2_moe")
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    moe = build_model(cfg, seed=2).model.layers[1].mlp.to(torch.bfloat16)
    ref = copy.deepcopy(moe).double()
    x = torch.randn(37, cfg.hidden_size).bfloat16()
    with torch.no_grad():
        _, w = moe.gate(x)
    chosen = torch.tensor([e for e in range(E) if e not in (2, E - 1)])  # experts 2 and E - 1 get no token
    g = torch.Generator().manual_seed(0)
    idx = torch.stack([chosen[torch.randperm(len(chosen), generator=g)[:k]] for _ in range(37)])
    idx[0] = torch.arange(k)  # adjacent experts
    counts = torch.bincount(idx.flatten(), minlength=E)
    assert counts[2] == counts[E - 1] == 0 and bool((counts[chosen] > 0).all())
    want = torch.stack([sum(float(w[t, j]) * expert(ref, int(idx[t, j]), x[t].double())
                            for j in range(idx.shape[1])) for t in range(37)])
    with torch.no_grad():
        grouped = moe.experts(x, idx, w)
    assert grouped.dtype == torch.bfloat16
    torch.testing.assert_close(grouped.double(), want, atol=2e-2 * want.abs().max().item(), rtol=0)
    torch.testing.assert_close(ref.experts(x.double(), idx, w.double()), want, atol=1e-12, rtol=1e-12)


def test_bad_checkpoint_dirs(tmp_path):
    cfg = tiny_cfg("sdar")
    model = build_model(cfg)
    with pytest.raises(CheckpointError, match="missing config.json"):
        load_checkpoint(tmp_path)
    save_checkpoint(model, cfg, tmp_path / "ok")
    # pickle-only weights are refused
    pk = tmp_path / "pickle"
    pk.mkdir()
    (pk / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    torch.save(model.state_dict(), pk / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickled weights"):
        load_checkpoint(pk)
    # wrong shape
    d = json.loads((tmp_path / "ok" / "config.json").read_text())
    d["intermediate_size"] = 48
    (tmp_path / "ok" / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="shape"):
        load_checkpoint(tmp_path / "ok")
    # missing tensor
    d["intermediate_size"] = 64
    (tmp_path / "ok" / "config.json").write_text(json.dumps(d))
    from safetensors.torch import load_file
    sd = load_file(tmp_path / "ok" / "model.safetensors")
    sd.pop("model.layers.1.mlp.up_proj.weight")
    save_file(sd, str(tmp_path / "ok" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensors.*up_proj"):
        load_checkpoint(tmp_path / "ok")
    # unknown architecture
    d["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "ok" / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="unknown architecture"):
        load_checkpoint(tmp_path / "ok")


@pytest.mark.parametrize("family", ["sdar", "llada2_moe"])
def test_a_layer_adds_the_previous_output_to_the_residual_stream_bit_for_bit(family):
    """A layer takes (x, residual) and leaves its own output for the next layer to add (the fused add + RMSNorm):
    residual + output equals, bit for bit, the pre-norm layer written out here, h = r + x, h += attn(norm(h)),
    h += mlp(norm2(h))."""
    torch.manual_seed(0)
    model = build_model(tiny_cfg(family), seed=3).eval()
    x, r = torch.randn(2, 8, model.cfg.hidden_size), torch.randn(2, 8, model.cfg.hidden_size)
    pos = torch.arange(8).expand(2, -1)
    attn = Masked(block_causal_dense(pos, 8, torch.tensor([8, 8]), 4))
    cos, sin = rope_cos_sin(pos, model.cfg.rotary_dim, model.cfg.rope_theta, x.dtype)
    for layer in model.model.layers:
        mixer = layer.self_attn if family == "sdar" else layer.attention
        with torch.no_grad():
            h = r + x
            h = h + mixer(layer.input_layernorm(h), cos, sin, attn)
            want = h + layer.mlp(layer.post_attention_layernorm(h))
            out, residual = layer(x, r, cos, sin, attn)
        assert torch.equal(residual + out, want)
