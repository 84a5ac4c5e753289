"""What each key of a checkpoint's `config.json` means here, in two classes.

Strict by default, so that a checkpoint this code cannot honour is refused by name instead of decoding wrongly.

(a) Keys that change the computation: honoured, or refused by name.
- READ: keys that become `ModelConfig` fields (`use_qkv_bias` is LLaDA2's name for `attention_bias`).
- PINNED: settings whose value the model code implements and no other (`use_bias: false`, `use_qk_norm: true`,
  sigmoid routing, no rope scaling, no sliding window, dropout 0, ...): any other value is refused. A key absent
  from the file takes the reference config class's default (ABSENT), which for LLaDA2's `use_bias` (true) and
  dropouts (0.1) is not the pinned value: such a config is refused as well.
- DEFAULTS: a read key absent from the file takes the reference config class's default, where it differs from
  `ModelConfig`'s (LLaDA2MoeConfig: partial_rotary_factor 0.5, rms_norm_eps 1e-5; the authors' Diffulex SDARConfig:
  max_position_embeddings 32768).
- Keys that only restate read ones (`rotary_dim`, `layer_types`, ...) are accepted when they agree (`_derived_ok`).

(b) IGNORED: keys that choose a kernel, a parallel layout, a training switch, a cache or an output format, or are
bookkeeping: accepted whatever their value (a few only at the values listed in IGNORED_VALUES), each with the
reason it leaves the arithmetic unchanged. A key is added once its meaning is checked against the reference code
(transformers, the authors' modeling files), never by its name alone: an unknown key may change the arithmetic.

Every other key is refused with its name and value (docs/models.md has both classes as tables).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from mbd.config_error import ConfigError

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


class Ignored(NamedTuple):
    """Why a class-(b) key leaves the arithmetic unchanged: its kind and a one-line reason."""

    kind: str  # kernel | parallel | training | cache | output | bookkeeping
    why: str


IGNORED: dict[str, Ignored] = {
    # kernels: how a result is computed, not which result
    "attn_implementation": Ignored("kernel", "the attention kernel transformers runs (eager, sdpa, flex_attention, "
                                   "flash_attention_2/3): each computes softmax(QK^T/sqrt(d) + mask)V over the "
                                   "block-causal mask this code builds from block_size"),
    "fuse_cross_entropy": Ignored("kernel", "the authors' modeling_sdar.py fuses lm_head and cross-entropy in "
                                  "training only (`fuse_cross_entropy and self.training`): the same loss"),
    # parallel layouts: where a result is computed
    "ep_size": Ignored("parallel", "expert-parallel degree: how MoE experts are spread over ranks, every token still "
                       "reaching its top-k experts; the authors' modeling_sdar.py never reads it (SDAR-8B is dense)"),
    "use_deepep": Ignored("parallel", "DeepEP all-to-all kernels for expert-parallel dispatch: communication only; "
                          "the authors' modeling_sdar.py never reads it"),
    "use_deepspeed": Ignored("parallel", "DeepSpeed on or off in the authors' training launcher (sharding of "
                             "optimizer state and weights); not a model setting"),
    # training switches that leave the forward and the loss unchanged
    "micro_forward": Ignored("training", "a switch of the authors' training launcher; their modeling_sdar.py never "
                             "reads it"),
    "skip_checkpoint": Ignored("training", "a switch of the authors' training launcher (checkpointing); their "
                               "modeling_sdar.py never reads it"),
    "debug": Ignored("training", "a debugging switch of the authors' training launcher; their modeling_sdar.py "
                     "never reads it"),
    "mtp_loss_scaling_factor": Ignored("training", "weight of the multi-token-prediction loss; no MTP layers are "
                                       "built (LLaDA2's num_nextn_predict_layers is pinned to 0)"),
    "initializer_range": Ignored("training", "std of freshly initialised weights, which a checkpoint's weights "
                                 "replace"),
    # caches and output formats
    "use_cache": Ignored("cache", "whether transformers' forward returns past key/values; the engine keeps its own "
                         "KV cache"),
    "output_router_logits": Ignored("output", "returns the router logits as an extra output; LLaDA2's reference "
                                    "computes no auxiliary loss from them"),
    "return_dict": Ignored("output", "transformers' output container (dataclass or tuple)"),
    "output_hidden_states": Ignored("output", "transformers returns every layer's hidden states as well"),
    "output_attentions": Ignored("output", "transformers returns the attention probabilities as well"),
    "torchscript": Ignored("output", "transformers' TorchScript export: tied embeddings are cloned, same values"),
    # bookkeeping
    "auto_map": Ignored("bookkeeping", "names the authors' remote-code classes, which are never run: "
                        "`architectures` picks the family"),
    "torch_dtype": Ignored("bookkeeping", "the dtype the weights were saved in; the engine's dtype decides the "
                           "compute dtype (the router stays float32)"),
    "dtype": Ignored("bookkeeping", "transformers >= 4.56's name for torch_dtype (the two must agree)"),
    "transformers_version": Ignored("bookkeeping", "the transformers version that wrote the file"),
    "use_bfloat16": Ignored("bookkeeping", "a legacy TensorFlow/Flax storage flag"),
    "tokenizer_class": Ignored("bookkeeping", "the tokenizer's class; tokenizer.json is read directly"),
    "bos_token_id": Ignored("bookkeeping", "the tokenizer's BOS id; no layer reads it, prompts hold what the chat "
                            "template writes"),
    "max_window_layers": Ignored("bookkeeping", "read only with use_sliding_window: true, which is pinned off"),
    "sliding_window": Ignored("bookkeeping", "read only with use_sliding_window: true, which is pinned off"),
}
# the attention kernels whose arithmetic is known; another name may be an attention variant, and is refused
KERNELS = frozenset({"eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3"})
# class-(b) keys accepted at these values only: outside them the key's meaning is not the one its reason states
IGNORED_VALUES: dict[str, Callable[[Any], bool]] = {
    "attn_implementation": lambda v: v is None or v in KERNELS,
    "ep_size": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
    "use_deepep": lambda v: isinstance(v, bool),
}
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
    """Raise ConfigError naming the first key of `hf` that is neither read, ignored (at an accepted value), nor at
    its pinned value."""
    for key, value in ABSENT[family].items():
        if key not in hf and value != PINNED[family][key]:
            raise ConfigError(f"config.json states no {key!r}: the reference config class then assumes "
                              f"{key}={value!r}, which this code does not implement (it computes {key}="
                              f"{PINNED[family][key]!r}); state it if that is what the weights were trained with")
    for key, value in hf.items():
        if key in READ[family] or key.startswith("_"):
            continue
        if key in IGNORED:
            if key in IGNORED_VALUES and not IGNORED_VALUES[key](value):
                raise ConfigError(f"config.json {key}={value!r} is not a value this code knows to leave the "
                                  f"computation unchanged ({key}: {IGNORED[key].why})")
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
