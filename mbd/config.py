"""Configuration models shared by every layer.

Configs are pydantic models so that a bad value fails at load time with the field name, the value
and the allowed range, instead of deep inside a forward pass. One way to do each thing:
- `load_yaml(path, Model, sets=...)` loads every YAML file in `configs/`, with command-line overrides in one
  syntax, `--set key.sub=value` (`apply_sets`; the value is parsed as YAML);
- `resolve_path` is the one anchor for relative paths (working directory first, then the repository root);
- `parse_dtype` is the one dtype spelling (float32/bfloat16/float16, fp32/bf16/fp16 accepted as aliases);
- `EngineConfig` holds every engine knob (the `engine:` section of decode, eval and serve YAMLs), `load_decode`
  reads a decode YAML into its DecodeConfig and EngineConfig.
Model configs come from a checkpoint's own `config.json` (`ModelConfig.from_hf`, every key checked by
`mbd.hf_keys`), with the EOS ids its generation and tokenizer configs state (`mbd.checkpoint_files`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Sequence, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from mbd.config_error import ConfigError  # re-exported: `from mbd.config import ConfigError` everywhere else

T = TypeVar("T", bound=BaseModel)

REPO_ROOT = Path(__file__).resolve().parents[1]
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}

ARCHITECTURES = {"SDARForCausalLM": "sdar", "LLaDA2MoeModelLM": "llada2_moe"}
# documented family defaults (docs/models.md) for what a published config.json may leave out
FAMILY_MASK = {"sdar": 151669, "llada2_moe": 156895}
FAMILY_EOS = {"llada2_moe": 156892}
FAMILY_BLOCK = {"llada2_moe": 32}


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class ModelConfig(StrictModel):
    """Hyperparameters of a BD-LM backbone, read from / written to HuggingFace `config.json`.

    `eos_token_ids` are every end-of-sequence id the checkpoint states (a list-valued `eos_token_id` kept whole);
    `eos_token_id` is the first of them, the one training appends. `block_size_stated` is False when config.json
    names no block size and the family's documented decoding block stands in (training refuses that)."""

    family: Literal["sdar", "llada2_moe"]
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)
    partial_rotary_factor: float = Field(default=1.0, gt=0, le=1)
    max_position_embeddings: int = Field(default=4096, gt=0)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mask_token_id: int = Field(ge=0)
    eos_token_id: int = Field(ge=0)
    eos_token_ids: list[int] = Field(default_factory=list)
    pad_token_id: int = Field(default=0, ge=0)
    block_size: int = Field(default=4, gt=0)
    block_size_stated: bool = True
    # llada2_moe only
    moe_intermediate_size: int = Field(default=0, ge=0)
    num_experts: int = Field(default=0, ge=0)
    num_shared_experts: int = Field(default=0, ge=0)
    num_experts_per_tok: int = Field(default=0, ge=0)
    n_group: int = Field(default=1, gt=0)
    topk_group: int = Field(default=1, gt=0)
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = Field(default=0, ge=0)
    norm_topk_prob: bool = True

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.mask_token_id >= self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} must be < vocab_size={self.vocab_size}")
        if not self.eos_token_ids:
            self.eos_token_ids = [self.eos_token_id]
        if self.eos_token_ids[0] != self.eos_token_id or min(self.eos_token_ids) < 0:
            raise ValueError(f"eos_token_ids={self.eos_token_ids} must start with eos_token_id={self.eos_token_id}")
        if self.family == "llada2_moe" and self.num_experts:
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError("num_experts_per_tok must be <= num_experts")
            if self.num_experts % self.n_group or self.topk_group > self.n_group:
                raise ValueError(
                    f"num_experts={self.num_experts} must divide into n_group={self.n_group} groups "
                    f"and topk_group={self.topk_group} must be <= n_group"
                )
        return self

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def training_block_size(self) -> int:
        """The block size training uses: the one config.json states (a model is trained for one block size)."""
        if not self.block_size_stated:
            raise ConfigError(f"config.json states no block_size: {self.family} decodes with its documented "
                              f"block {self.block_size}, but training needs the block size the checkpoint was "
                              "trained with; add \"block_size\" to config.json")
        return self.block_size

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a HuggingFace config dict (every key checked by `mbd.hf_keys`); the family comes from
        `architectures`; the mask id, EOS and block size of a LLaDA2 config default to the family's documented
        ones (docs/models.md)."""
        from mbd.hf_keys import DEFAULTS, READ, check_keys, lift_rope

        archs = hf.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None:
            raise ConfigError(
                f"unknown architecture {archs!r} in config.json: supported are {sorted(ARCHITECTURES)}"
            )
        if hf.get("model_type", family) != family:
            raise ConfigError(f"config.json model_type={hf['model_type']!r} does not match {archs!r} ({family})")
        hf = lift_rope(hf)
        check_keys(hf, family)
        d = DEFAULTS[family] | {k: v for k, v in hf.items() if k in READ[family] and v is not None}
        d.update(family=family, attention_bias=bool(d.pop("use_qkv_bias", d.get("attention_bias", False))))
        d.pop("architectures", None), d.pop("model_type", None)
        heads = d.get("num_attention_heads")
        if isinstance(heads, int) and heads > 0 and isinstance(d.get("hidden_size"), int):
            d.setdefault("head_dim", d["hidden_size"] // heads)
            d.setdefault("num_key_value_heads", heads)
        eos = d.get("eos_token_id", FAMILY_EOS.get(family))
        if eos is None:
            raise ConfigError("no eos_token_id: generation_config.json, config.json and tokenizer_config.json "
                              f"state none and {family} has no documented default")
        d["eos_token_ids"] = list(eos) if isinstance(eos, list) else [eos]
        d["eos_token_id"] = d["eos_token_ids"][0] if d["eos_token_ids"] else None
        d.setdefault("pad_token_id", d["eos_token_id"])
        d.setdefault("mask_token_id", FAMILY_MASK[family])
        if "block_size" not in d:
            if family not in FAMILY_BLOCK:
                raise ConfigError(f"config.json states no block_size: {family} checkpoints are trained for one "
                                  "block size (4, 32, ...), which config.json must name")
            d.update(block_size=FAMILY_BLOCK[family], block_size_stated=False)
        try:
            return cls.model_validate(d)
        except ValidationError as e:
            raise ConfigError(f"invalid model config.json: {fmt_validation_error(e)}") from e

    def to_hf(self) -> dict[str, Any]:
        """config.json for this model, stating every setting the reference config classes would otherwise
        default differently (LLaDA2MoeConfig's use_bias=True, ...), so that another engine builds the same model."""
        from mbd.hf_keys import pinned_settings

        arch = {v: k for k, v in ARCHITECTURES.items()}[self.family]
        d = self.model_dump(exclude={"family", "eos_token_ids", "block_size_stated"})
        if len(self.eos_token_ids) > 1:
            d["eos_token_id"] = list(self.eos_token_ids)
        d["architectures"] = [arch]
        d["model_type"] = self.family
        if self.family == "sdar":
            for k in ("moe_intermediate_size", "num_experts", "num_shared_experts", "num_experts_per_tok",
                      "n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace", "norm_topk_prob"):
                d.pop(k)
        else:
            d["use_qkv_bias"] = d.pop("attention_bias")
            d.update(rotary_dim=self.rotary_dim, moe_shared_expert_intermediate_size=self.moe_intermediate_size)
        return d | pinned_settings(self.family)


class DecodeConfig(StrictModel):
    """MultiBD inference hyperparameters (one row of the paper's tab:appendix_infer_hparams).

    buffer_size = 1 is SingleBD. A threshold of None means "not used" (the table's dashes):
    tau_add None with buffer_size 1, tau_stable None disables the stability check, tau_t2t None
    disables token-to-token revision.
    """

    buffer_size: int = Field(default=1, ge=1, le=64, description="N_buf, slots in the Block Buffer")
    block_size: int | None = Field(default=None, gt=0, description="B; default: the model's block_size")
    max_length: int = Field(default=4096, gt=0, description="prompt + generation tokens")
    max_new_tokens: int = Field(default=4096, gt=0)
    max_nfe: int = Field(default=1024, gt=0, description="forward passes per request")
    tau_add: float | None = Field(default=None, ge=0,
                                  description="activate next block at progress > tau_add (a complete block passes 1.0)")
    tau_semi: float = Field(default=0.9, ge=0, le=1)
    tau_stable: float | None = Field(default=None, ge=0, le=1)
    tau_m2t: float = Field(default=0.95, ge=0, le=1)
    tau_t2t: float | None = Field(default=None, ge=0, le=1)
    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1, description="nucleus sampling (with temperature > 0)")
    top_k: int = Field(default=0, ge=0, description="sample among the k most likely tokens; 0: all")
    seed: int = 0
    ignore_eos: bool = Field(default=False, description="stop tokens do not end generation (benchmarks)")
    logprobs: bool = Field(default=False, description="report each output token's log-probability")
    top_logprobs: int = Field(default=0, ge=0, le=20, description=(
        "with logprobs: also the most likely tokens of the distribution each output token was accepted from"))
    provisional: bool = Field(default=False, description=(
        "also report, every step, the Block Buffer's tokens that are not final yet (masks included)"))
    strategy: Literal["block_buffer", "dmax"] = Field(
        default="block_buffer", description="decision rules: the paper's Block Buffer (M2T/T2T), or DMax's native "
        "SingleBD decoding (mbd.decoding.policy.DMaxPolicy; buffer_size 1, tau_t2t required)")

    @model_validator(mode="after")
    def _check(self) -> "DecodeConfig":
        if self.buffer_size > 1 and self.tau_add is None:
            raise ValueError(f"tau_add is required when buffer_size={self.buffer_size} > 1 (e.g. tau_add: 0.1)")
        if self.strategy == "dmax" and (self.buffer_size != 1 or self.tau_t2t is None):
            raise ValueError("strategy dmax is DMax's native SingleBD decoding: it needs buffer_size 1 and tau_t2t "
                             f"(DMax: 0), got buffer_size={self.buffer_size}, tau_t2t={self.tau_t2t}")
        return self


class EngineConfig(StrictModel):
    """Every knob of the decoding engine (`mbd.decoding.Engine`): where it runs, how many requests it batches,
    which attention kernel and compilation it uses, and how its KV page pool is sized. One `engine:` section of
    every decode, eval and serve YAML; `--set engine.attention=flex` changes it from the command line."""

    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description=(
        "auto: cuda if available when loading a checkpoint; a model handed to Engine stays where it is"))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(default="auto", description=(
        "weights and KV cache; auto: bfloat16 on cuda, float32 on cpu (a model handed to Engine keeps its own)"))
    threads: int | None = Field(default=None, ge=1, description="torch intra-op threads (CPU); None: torch's")
    max_batch_rows: int = Field(default=8, ge=1, le=1024, description="requests decoded together per step")
    batch_buckets: list[int] | None = Field(default=None, description=(
        "batch sizes a forward may run (each a static shape / CUDA Graph); None: powers of two up to max_batch_rows"))
    attention: Literal["auto", "sdpa", "flex"] = Field(default="auto", description=(
        "sdpa: dense bool masks over a gathered key span (the eager reference); flex: FlexAttention over the KV "
        "page pool itself, each row's pages named by a BlockMask (no gather, no span: few static shapes); "
        "auto: flex on cuda or where compile / cuda_graphs are set, sdpa on cpu"))
    compile: Literal["auto", "off", "default", "max-autotune"] = Field(default="auto", description=(
        "torch.compile mode of the decode forward's layers (attention flex only; off: eager); auto: default on "
        "cuda, off on cpu; max-autotune: autotuned GEMM templates, inductor's own CUDA Graphs off (the engine "
        "captures each step itself)"))
    cuda_graphs: Literal["auto", "on", "off"] = Field(default="auto", description=(
        "capture every decode shape as a CUDA Graph at start-up (attention flex only); auto: on cuda"))
    compile_cache: str | None = Field(default=None, description=(
        "directory for compiled kernels (inductor's and Triton's caches), reused by later starts; None: "
        "torch's default under the system temp directory"))
    prefill_chunk: int = Field(default=512, ge=1, description="prompt tokens per prefill forward (whole blocks)")
    prefill_budget: int = Field(default=64, ge=0, description=(
        "prompt tokens a decode step may carry while rows decode (chunked prefill; whole blocks, at least one)"))
    kv_cache_bytes: int | None = Field(default=None, ge=1, description=(
        "KV page pool budget (per tensor-parallel rank); None: room for every batch row at max_length"))
    kv_cache_fraction: float | None = Field(default=None, gt=0, le=0.95, description=(
        "or: this share of the device memory free once the weights are loaded (host memory on CPU)"))
    page_size: int | None = Field(default=None, ge=1, description=(
        "tokens per KV page, a multiple of the block size; None: 16 or one block, whichever is larger"))
    prefix_caching: bool = Field(default=True, description="reuse committed prefix pages across requests")
    trace: bool = Field(default=False, description="record every request's per-forward slot states")

    @field_validator("compile", "cuda_graphs", mode="before")
    @classmethod
    def _yaml_bools(cls, v: Any, info: ValidationInfo) -> Any:
        """YAML reads a bare off / on as a bool (`--set engine.compile=off`): take it as the word."""
        if isinstance(v, bool):
            return ("default" if info.field_name == "compile" else "on") if v else "off"
        return v

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.kv_cache_bytes is not None and self.kv_cache_fraction is not None:
            raise ValueError("set kv_cache_bytes or kv_cache_fraction, not both")
        if self.batch_buckets is not None:
            bad = [b for b in self.batch_buckets if not 1 <= b <= self.max_batch_rows]
            if bad or self.max_batch_rows not in self.batch_buckets:
                raise ValueError(f"batch_buckets {self.batch_buckets} must lie in [1, max_batch_rows="
                                 f"{self.max_batch_rows}] and include max_batch_rows")
        if self.device == "cpu" and self.cuda_graphs == "on":
            raise ValueError("cuda_graphs: on needs device cuda (or auto on a machine with a GPU)")
        if self.attention == "sdpa" and (self.compile not in ("auto", "off") or self.cuda_graphs == "on"):
            raise ValueError("compile and cuda_graphs need attention: flex (the sdpa path's key span is a shape of "
                             "its own: a graph per span bucket); set attention: flex, or compile: off and "
                             "cuda_graphs: off")
        return self

    def torch_device(self, own=None):
        """The engine's device, the one place "auto" is resolved: `own` (the device of a model handed to the
        Engine, which stays there), else cuda if available (where a checkpoint is loaded)."""
        import torch

        if self.device == "auto":
            return own if own is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device("cuda", 0) if self.device == "cuda" else torch.device("cpu")

    def torch_dtype(self, own=None):
        """The engine's dtype, the one place "auto" is resolved: `own` (the dtype of a model handed to the Engine,
        which keeps it), else bfloat16 on cuda and float32 on cpu (a checkpoint is loaded in it)."""
        import torch

        if self.dtype == "auto":
            if own is not None:
                return own
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return parse_dtype(self.dtype)

    def summary(self) -> str:
        """One line for the start of `mbd serve` / `mbd generate -v`."""
        return "engine: " + ", ".join(f"{k}={v}" for k, v in self.model_dump().items())


def load_decode(path: str | Path, sets: Sequence[str] = ()) -> tuple[DecodeConfig, EngineConfig]:
    """A decode YAML (`configs/decode/*.yaml`: DecodeConfig fields and an `engine:` section, or a file with a
    top-level `decode:` section beside `engine:`) with `--set` overrides (`--set engine.attention=flex`,
    `--set tau_add=0.2`)."""
    data = apply_sets(read_yaml(path), sets)
    engine = data.pop("engine", None) or {}
    decode = data["decode"] if "decode" in data else data
    if not isinstance(decode, dict) or not isinstance(engine, dict):
        raise ConfigError(f"{path}: `decode` and `engine` must be mappings of fields")
    return validate(DecodeConfig, decode, str(path)), validate(EngineConfig, engine, f"{path}: engine")


def fmt_validation_error(e: ValidationError) -> str:
    """Every error of `e` as "field 'a.b': message (got value)"."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "<root>"
        parts.append(f"field '{loc}': {err['msg']} (got {err.get('input')!r})")
    return "; ".join(parts)


def validate(model: type[T], data: dict[str, Any], source: str = "config") -> T:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source}: {fmt_validation_error(e)}") from e


def apply_sets(data: dict[str, Any], items: Sequence[str]) -> dict[str, Any]:
    """`--set a.b=value` items (value parsed as YAML) into the nested config dict, in order."""
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set deepspeed.zero_stage=3")
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: '{p}' is not a section")
        try:
            node[leaf] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML: {e}") from e
    return data


def read_yaml(path: str | Path, section: str | None = None) -> dict[str, Any]:
    """The mapping in a YAML file (or in its top-level `section`); a relative path is looked up in the working
    directory, then under the repository root (`resolve_path`), so `--config configs/...` works from anywhere
    (a `ray job submit` driver starts in a directory of its own)."""
    p = resolve_path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from e
    if section is not None:
        if not isinstance(data, dict) or section not in data:
            raise ConfigError(f"{p}: missing top-level section '{section}'")
        data = data[section]
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping of fields, got {type(data).__name__}")
    return data


def load_yaml(path: str | Path, model: type[T], section: str | None = None, sets: Sequence[str] = ()) -> T:
    """Load a YAML config, apply `--set` overrides and validate; `section` picks a top-level key."""
    return validate(model, apply_sets(read_yaml(path, section), sets), str(path))


def resolve_path(path: str | Path) -> Path:
    """`path` as given if it exists (or is absolute), else relative to the repository root, so configs that
    name `configs/decode/...` or `mbd/assets/tiny` work from any working directory."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or p.exists() else REPO_ROOT / p


def parse_dtype(name: str):
    """A dtype name of any config (float32/bfloat16/float16 or fp32/bf16/fp16) -> torch.dtype."""
    import torch

    if name not in DTYPE_NAMES:
        raise ConfigError(f"dtype {name!r}: expected one of {', '.join(DTYPE_NAMES)}")
    return getattr(torch, DTYPE_NAMES[name])


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from e
