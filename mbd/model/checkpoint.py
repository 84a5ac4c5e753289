"""HuggingFace-format checkpoints: config.json + *.safetensors (optionally sharded with an index).

safetensors only: pickled weights (`*.bin`, `*.pt`) are refused, and no code from the checkpoint directory
is ever imported. Every tensor of the directory is consumed, or the load fails naming it (a bias or norm the
config does not describe would otherwise be dropped without a word). Under tensor parallelism each rank reads the
full tensors and keeps its own shard. Buffers (LLaDA2's expert bias, router_dtype fp32) stay in float32 whatever
`dtype` the weights take.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.overrides import TorchFunctionMode

from mbd.checkpoint_files import TEMPLATE_FILE, read_model_config
from mbd.config import ConfigError, ModelConfig, read_json
from mbd.model.llada2_moe import LLaDA2MoeModelLM
from mbd.model.sdar import SDARForCausalLM
from mbd.model.tp import SINGLE, TPGroup

FAMILIES = {"sdar": SDARForCausalLM, "llada2_moe": LLaDA2MoeModelLM}
ALIASES = {"e_score_correction_bias": "expert_bias"}
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", TEMPLATE_FILE)


class CheckpointError(ValueError):
    """A checkpoint directory cannot be loaded; the message says which file/tensor and why."""


@runtime_checkable
class PackedTensors(Protocol):
    """A module whose parameter packs several checkpoint tensors (stacked experts, fused projections)."""

    def checkpoint_parts(self, name: str) -> list[str]: ...

    def join(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor: ...

    def split(self, name: str, full: torch.Tensor) -> list[torch.Tensor]: ...


@runtime_checkable
class Sharded(Protocol):
    """A tensor-parallel module that cuts the full tensor of its parameter `name` to this rank's part."""

    def shard_(self, name: str, full: torch.Tensor) -> torch.Tensor: ...


class _SkipInit(TorchFunctionMode):
    """Parameter initialisers become no-ops: a meta tensor has no values to fill, and `normal_` on the meta device
    runs a Python reference that imports torch._dynamo on first use (1.5-3 s of every engine and evaluation process
    that loads a checkpoint, none of which compiles on CPU)."""

    FILLS = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.FILLS or getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]  # nn.init passes its tensor by name
        return func(*args, **(kwargs or {}))


def skeleton(cfg: ModelConfig, tp: TPGroup = SINGLE) -> nn.Module:
    """The config's model on the meta device, uninitialised: its parameters' names, shapes and dtypes only."""
    with torch.device("meta"), _SkipInit():
        return FAMILIES[cfg.family](cfg, tp)


def build_model(cfg: ModelConfig, tp: TPGroup = SINGLE, seed: int | None = 0) -> nn.Module:
    """A randomly initialised model (std 0.02 normal, norms at 1) of the config's family."""
    if seed is not None:
        torch.manual_seed(seed)
    model = FAMILIES[cfg.family](cfg, tp)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            nn.init.normal_(p, std=0.02)
    return model


def _tensor_files(d: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file."""
    if (d / INDEX).is_file():
        weight_map = read_json(d / INDEX).get("weight_map", {})
        return {k: d / v for k, v in weight_map.items()}
    files = sorted(d.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in d.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".ckpt"})
        if pickles:
            raise CheckpointError(
                f"{d}: only pickled weights found ({', '.join(pickles)}); pickles can run code and are refused. "
                "Convert them to safetensors (e.g. with `safetensors.torch.save_file`) on a trusted machine."
            )
        raise CheckpointError(f"{d}: no *.safetensors weights found")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = f
    return out


def _canonical(name: str) -> str:
    head, _, leaf = name.rpartition(".")
    return f"{head}.{ALIASES.get(leaf, leaf)}" if leaf in ALIASES else name


def _canonical_files(d: Path) -> dict[str, tuple[str, Path]]:
    """Canonical tensor name -> (name in the checkpoint, file); a tensor present under two names is refused."""
    out: dict[str, tuple[str, Path]] = {}
    for k, f in _tensor_files(d).items():
        c = _canonical(k)
        if c in out:
            raise CheckpointError(f"{d}: tensors '{out[c][0]}' and '{k}' are the same parameter; keep one")
        out[c] = (k, f)
    return out


def load_checkpoint(path: str | Path, tp: TPGroup = SINGLE, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> tuple[nn.Module, ModelConfig]:
    d = Path(path)
    if not (d / "config.json").is_file():
        raise CheckpointError(f"{d}: missing config.json (expected a HuggingFace-format model directory)")
    try:
        cfg = read_model_config(d)
    except ConfigError as e:
        raise CheckpointError(f"{d}: {e}") from e
    files = _canonical_files(d)
    model = skeleton(cfg, tp)
    modules = dict(model.named_modules())
    expected = dict(model.state_dict(keep_vars=True))
    buffers = {name for name, _ in model.named_buffers()}
    embedding = next(k for k in expected if k.endswith(("embed_tokens.weight", "word_embeddings.weight")))
    state, missing, handles, used = {}, [], {}, set()
    for name, ref in expected.items():
        owner = modules[name.rpartition(".")[0]]
        parts = _parts(owner, name)
        if cfg.tie_word_embeddings and name == "lm_head.weight" and name not in files:
            parts = [embedding]  # the head shares the embedding's tensor (cut as a head under TP)
        absent = [p for p in parts if p not in files]
        if absent:
            missing += absent
            continue
        used.update(parts)
        tensors = [_tensor(handles, files[p][1], files[p][0]) for p in parts]
        full = owner.join(name, tensors) if len(parts) > 1 else tensors[0]
        t = owner.shard_(name, full) if isinstance(owner, Sharded) and tp.world > 1 else full
        if tuple(t.shape) != tuple(ref.shape):
            raise CheckpointError(
                f"{d}: tensor '{files[parts[0]][0]}' gives shape {tuple(t.shape)} per rank, the config implies "
                f"{tuple(ref.shape)} (tp={tp.world}); is config.json the one saved with these weights?"
            )
        state[name] = t.to(dtype if name not in buffers else torch.float32)
    if missing:
        raise CheckpointError(f"{d}: missing tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)} in all)")
    unused = sorted(files[k][0] for k in set(files) - used)
    if unused:
        raise CheckpointError(f"{d}: tensors the config does not describe: {unused[:5]}"
                              f"{' ...' if len(unused) > 5 else ''} ({len(unused)} in all); is config.json the "
                              "one saved with these weights (use_bias, use_qk_norm, ...)?")
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    return model.to(device).eval(), cfg


def _parts(owner: nn.Module, name: str) -> list[str]:
    """The checkpoint names of parameter `name`: itself, or the tensors a packed parameter joins."""
    return owner.checkpoint_parts(name) if isinstance(owner, PackedTensors) else [name]


def _tensor(handles: dict[Path, object], f: Path, name: str) -> torch.Tensor:
    if f not in handles:
        handles[f] = safe_open(str(f), framework="pt")
    return handles[f].get_tensor(name)


def checkpoint_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under their checkpoint (HF) names: packed parameters split into their parts."""
    modules = dict(model.named_modules())
    state = {}
    for name, t in model.state_dict().items():
        owner = modules[name.rpartition(".")[0]]
        parts = _parts(owner, name)
        pieces = owner.split(name, t) if parts != [name] else [t]
        state.update({p: x.detach().to("cpu").contiguous().clone() for p, x in zip(parts, pieces)})
    return state


def save_checkpoint(model: nn.Module, cfg: ModelConfig, path: str | Path, shard_bytes: int | None = None) -> Path:
    """Write config.json + model.safetensors (or shards + index when `shard_bytes` is set). TP=1 models only."""
    if getattr(model, "tp", SINGLE).world != 1:
        raise ValueError("save_checkpoint needs the unsharded model (tensor_parallel_size=1)")
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    state = checkpoint_state(model)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    (d / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    if not shard_bytes:
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
        return d
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in state.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    weight_map = {}
    for i, s in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(s, str(d / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in s})
    (d / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return d


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> None:
    """Copy a model directory's tokenizer files, generation config and chat template (those present) next to
    weights written elsewhere: the exported checkpoint stops and prompts as its source did."""
    import shutil

    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
