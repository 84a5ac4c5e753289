"""What each key of a checkpoint's `config.json` means here: read, irrelevant, or pinned to the value we compute.

Strict by default, so that a checkpoint this code cannot honour is refused by name instead of decoding wrongly:
- READ: keys that become `ModelConfig` fields (`use_qkv_bias` is LLaDA2's name for `attention_bias`);
- IGNORED: bookkeeping that changes neither inference nor training (`torch_dtype` / `dtype`: the engine picks the
  dtype the weights are cast to; `max_window_layers` / `sliding_window`: read only with `use_sliding_window`, which is
  pinned off);
- PINNED: settings whose value the model code implements and no other (`use_bias: false`, `use_qk_norm: true`,
  sigmoid routing, no rope scaling, dropout 0, ...). A key absent from the file takes the reference config class's
  default (ABSENT), which for LLaDA2's `use_bias` (true) and dropouts (0.1) is not the pinned value: such a config
  is refused as well.
- DEFAULTS: a read key absent from the file takes the reference config class's default, where it differs from
  `ModelConfig`'s (LLaDA2MoeConfig: partial_rotary_factor 0.5, rms_norm_eps 1e-5; the authors' Diffulex SDARConfig:
  max_position_embeddings 32768).
Every other key is refused with its name and value.
"""

from __future__ import annotations

from typing import Any

from mbd.config import ConfigError

COMMON_READ = frozenset({
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "partial_rotary_factor",
    "max_position_embeddings", "tie_word_embeddings", "mask_token_id", "eos_token_id", "pad_token_id", "block_size",
})
READ = {
    "sdar": COMMON_READ | {"attention_bias"},
    "llada2_moe": COMMON_READ | {"use_qkv_bias", "moe_intermediate_size", "num_experts", "num_shared_experts",
                                 "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor",
                                 "first_k_dense_replace", "norm_topk_prob"},
}
IGNORED = frozenset({
    "auto_map", "torch_dtype", "dtype", "transformers_version", "use_cache", "initializer_range", "bos_token_id",
    "output_router_logits", "max_window_layers", "sliding_window", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "use_bfloat16", "tokenizer_class",
    # training-launcher flags some SDAR configs carry (loss kernel, DeepSpeed, checkpointing): not the model
    "fuse_cross_entropy", "use_deepspeed", "micro_forward", "skip_checkpoint", "debug",
    # the multi-token-prediction loss weight: no MTP layers are built (num_nextn_predict_layers is pinned to 0)
    "mtp_loss_scaling_factor",
})
PINNED: dict[str, dict[str, Any]] = {
    "sdar": {"hidden_act": "silu", "rope_scaling": None, "use_sliding_window": False, "attention_dropout": 0.0},
    "llada2_moe": {
        "use_bias": False, "use_qk_norm": True, "score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "router_dtype": "fp32", "norm_head": False, "norm_softmax": False, "rope_scaling": None,
        "hidden_act": "silu", "use_rmsnorm": True, "use_sliding_window": False, "num_nextn_predict_layers": 0,
        "using_split_qkv_in_self_attention": False, "embedding_dropout": 0.0, "attention_dropout": 0.0,
        "output_dropout": 0.0,
    },
}
# the reference config classes' defaults where they differ from the pinned value (LLaDA2MoeConfig: use_bias=True)
ABSENT: dict[str, dict[str, Any]] = {"sdar": {}, "llada2_moe": {
    "use_bias": True, "embedding_dropout": 0.1, "attention_dropout": 0.1, "output_dropout": 0.1}}
DEFAULTS: dict[str, dict[str, Any]] = {
    "sdar": {"max_position_embeddings": 32768},
    "llada2_moe": {"partial_rotary_factor": 0.5, "rms_norm_eps": 1e-5, "max_position_embeddings": 16384},
}


def check_keys(hf: dict[str, Any], family: str) -> None:
    """Raise ConfigError naming the first key of `hf` that is neither read, ignored, nor at its pinned value."""
    for key, value in ABSENT[family].items():
        if key not in hf and value != PINNED[family][key]:
            raise ConfigError(f"config.json states no {key!r}: the reference config class then assumes "
                              f"{key}={value!r}, which this code does not implement (it computes {key}="
                              f"{PINNED[family][key]!r}); state it if that is what the weights were trained with")
    for key, value in hf.items():
        if key in READ[family] or key in IGNORED or key.startswith("_"):
            continue
        if key in PINNED[family]:
            if value != PINNED[family][key]:
                raise ConfigError(f"config.json {key}={value!r} is not supported: this code computes "
                                  f"{key}={PINNED[family][key]!r} only")
            continue
        if not _derived_ok(hf, family, key, value):
            raise ConfigError(f"config.json {key}={value!r} is not read by this code and would change the "
                              "computation (or is unknown); refusing the checkpoint rather than ignoring it")
    for a, b in (("torch_dtype", "dtype"),):
        if a in hf and b in hf and hf[a] != hf[b]:
            raise ConfigError(f"config.json states {a}={hf[a]!r} and {b}={hf[b]!r}: they must agree")


def lift_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """`hf` with transformers >= 5's `rope_parameters` lifted to the top-level keys older versions write
    (rope_theta, partial_rotary_factor); any RoPE type but the default is refused."""
    rp = hf.get("rope_parameters")
    if rp is None:
        return hf
    if not isinstance(rp, dict) or rp.get("rope_type", "default") != "default" \
            or set(rp) - {"rope_type", "rope_theta", "partial_rotary_factor"}:
        raise ConfigError(f"config.json rope_parameters={rp!r} is not supported: only default RoPE "
                          "(rope_theta, partial_rotary_factor)")
    out = {k: v for k, v in hf.items() if k != "rope_parameters"}
    for k in ("rope_theta", "partial_rotary_factor"):
        if k in rp:
            if k in out and out[k] != rp[k]:
                raise ConfigError(f"config.json states {k}={out[k]!r} and rope_parameters.{k}={rp[k]!r}")
            out[k] = rp[k]
    return out


def _derived_ok(hf: dict[str, Any], family: str, key: str, value: Any) -> bool:
    """Keys that restate what the read keys already decide: accepted when they agree with them."""
    if key == "layer_types":  # transformers >= 4.56 writes one entry per layer
        return isinstance(value, list) and all(v == "full_attention" for v in value)
    if family != "llada2_moe":
        return False
    if key == "rotary_dim":
        head_dim = hf.get("head_dim") or hf.get("hidden_size", 0) // max(hf.get("num_attention_heads", 1), 1)
        return value == int(head_dim * hf.get("partial_rotary_factor", DEFAULTS[family]["partial_rotary_factor"]))
    if key == "moe_shared_expert_intermediate_size":  # the shared experts are moe_intermediate_size wide each
        return value is None or value == hf.get("moe_intermediate_size")
    return False


def pinned_settings(family: str) -> dict[str, Any]:
    """The pinned settings, for `ModelConfig.to_hf` to state (another engine then builds the same model)."""
    return dict(PINNED[family])
