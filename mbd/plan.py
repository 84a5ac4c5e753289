"""Memory plan of a serve or train configuration, per rank, before anything is loaded.

Why: a config that cannot fit an accelerator should be refused in a second with the numbers and the reason,
not after minutes of loading weights and an out-of-memory error deep inside a forward. The weights are counted
exactly, by building the model at its real size on the meta device (no storage) with this rank's
tensor-parallel shard shapes; the KV page pool is sized by the same rule `ModelRunner` uses; the ZeRO states
follow DeepSpeed's layout (bf16/fp32 parameters, a fp32 master copy plus Adam's two moments partitioned over
the data-parallel ranks). Activations and CUDA-Graph pools are estimates from the tensor shapes a forward
creates; each term says what it counts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch

from mbd.config import ConfigError, DecodeConfig, ModelConfig

GiB = 1 << 30
FP32 = 4


@dataclass(frozen=True)
class DeviceMemory:
    """What one rank may use: `total` as CUDA reports it, less `reserved` for the CUDA context and libraries."""

    name: str
    total: int
    reserved: int

    @property
    def usable(self) -> int:
        return self.total - self.reserved


# An 80 GB H100 reports 79.2 GiB to CUDA; about 0.75 GiB goes to the context, cuBLAS and NCCL workspaces.
H100_80GB = DeviceMemory("H100 80GB", 85_031_714_816, 3 * GiB // 4)


@dataclass(frozen=True)
class Item:
    name: str
    bytes: int
    note: str = ""


@dataclass
class Plan:
    """One rank's memory: `items` add up to its need; `facts` are derived numbers (pages, tokens, ...)."""

    title: str
    device: DeviceMemory
    items: list[Item] = field(default_factory=list)
    facts: dict[str, str] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)  # why it does not fit; empty: it fits

    @property
    def total(self) -> int:
        """What serving needs from its first step on (every CUDA Graph is captured at start-up)."""
        return sum(i.bytes for i in self.items)

    def item(self, name: str) -> int:
        return next(i.bytes for i in self.items if i.name == name)

    @property
    def fits(self) -> bool:
        return not self.reasons

    def check_total(self) -> None:
        usable = f"the {self.device.name} has {gib(self.device.usable)} usable"
        if self.total > self.device.usable:
            big = max(self.items, key=lambda i: i.bytes)
            self.reasons.append(f"needs {gib(self.total)} per rank, {usable} ({gib(self.device.total)} less "
                                f"{gib(self.device.reserved)} reserved); the largest part is {big.name} ({gib(big.bytes)})")


class PlanError(ConfigError):
    """A configuration cannot fit its devices; the message is the plan and the reason."""


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 4 else f"{n / 2**20:.2f} MiB"


def elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------------------------------- weights

@functools.cache
def _meta_counts(cfg_json: str, tp_world: int) -> tuple[int, int]:
    from mbd.model.checkpoint import skeleton
    from mbd.model.tp import TPGroup

    model = skeleton(ModelConfig.model_validate_json(cfg_json), TPGroup(0, tp_world))
    params = sum(p.numel() for p in model.parameters())  # a tied head is one parameter, counted once
    buffers = sum(b.numel() for b in model.buffers())
    return params, buffers


def weight_elements(cfg: ModelConfig, tp: int = 1) -> tuple[int, int]:
    """(parameters, buffer elements) of one tensor-parallel rank, from the model built on the meta device."""
    return _meta_counts(cfg.model_dump_json(), tp)


def weight_bytes(cfg: ModelConfig, tp: int, dtype: torch.dtype) -> int:
    """Bytes of one rank's weights as `load_checkpoint` casts them: parameters in `dtype`, buffers (LLaDA2's expert
    bias, which routing reads in float32 as `router_dtype` says) in float32."""
    params, buffers = weight_elements(cfg, tp)
    return params * elem(dtype) + buffers * elem(torch.float32)


# ---------------------------------------------------------------------------------------------- serving

@dataclass(frozen=True)
class ServeShape:
    """The engine settings that decide memory (one place, so another source of engine settings maps onto it)."""

    tp: int
    dtype: torch.dtype
    cuda: bool
    max_batch_rows: int
    kv_cache_bytes: int | None = None
    kv_cache_fraction: float | None = None
    page_size: int | None = None
    attention: str = "sdpa"  # "flex": the paged kernel reads the pool in place (no gathered span)
    cuda_graphs: bool = False
    batch_buckets: tuple[int, ...] | None = None
    prefill_chunk: int = 512


def layer_activation(cfg: ModelConfig, tp: int, e: int, rows: int, width: int, span: int, attention: str) -> int:
    """Peak transient bytes inside one decoder layer for `rows` x `width` query tokens over `span` keys: hidden
    states, q/k/v, the gathered K/V of the span (sdpa; flex reads the pool in place), and either attention's
    intermediates or the MLP's. SDPA with a
    boolean mask and grouped K/V has no fused CUDA kernel (flash takes no mask, the others no GQA): the math kernel
    runs, in fp32, with K/V expanded to every head, the scores, their softmax and the mask as additive floats."""
    t, d, hd = rows * width, cfg.hidden_size, cfg.head_dim
    h, kv = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp
    hidden = t * (3 * d + h * hd) * e
    attn = 2 * t * (h + 2 * kv) * hd * e
    if attention == "sdpa":  # the gathered span; the math kernel keeps its intermediates in fp32 (torch's docs)
        attn += 2 * rows * kv * span * hd * e
        attn += 2 * rows * h * span * hd * FP32 + rows * h * width * span * 2 * FP32 + rows * width * span * FP32
    if cfg.num_experts:
        k, ff = cfg.num_experts_per_tok, cfg.moe_intermediate_size // tp
        mlp = t * cfg.num_experts * FP32 * 4 + t * d * e + t * k * (2 * d + 3 * ff) * e // cfg.num_experts
        mlp += 3 * t * ff * cfg.num_shared_experts * e
    else:
        mlp = 3 * t * (cfg.intermediate_size // tp) * e
    return hidden + max(attn, mlp)


def decode_activation(cfg: ModelConfig, tp: int, e: int, rows: int, slots: int, span: int, active: int,
                      attention: str) -> int:
    """One Block Buffer forward: the mask, then the larger of a layer's peak and the head (the logits of
    `active` slots per row, all-gathered over the vocabulary shards, and the policy's fp32 softmax)."""
    width = slots * cfg.block_size
    mask = rows * width * span if attention == "sdpa" else 0
    n_logits = rows * active * cfg.block_size
    head = n_logits * cfg.vocab_size * e // tp + n_logits * cfg.vocab_size * ((e if tp > 1 else 0) + 2 * FP32)
    return mask + max(layer_activation(cfg, tp, e, rows, width, span, attention), head)


def kv_pool(cfg: ModelConfig, shape: ServeShape, decode: DecodeConfig, free: int) -> dict[str, int]:
    """The page pool `ModelRunner` allocates: pages (scratch page included), page size, tokens per row."""
    from mbd.model.cache import KVCache, default_page_size
    from mbd.model.tp import TPGroup

    block = decode.block_size or cfg.block_size
    page = shape.page_size or default_page_size(block)
    q = decode.buffer_size * block
    max_len = min(decode.max_length, cfg.max_position_embeddings) + block
    row_tokens = max_len + q
    per_row = -(-row_tokens // page)
    page_bytes = KVCache.page_bytes(cfg, page, shape.dtype, TPGroup(0, shape.tp))
    if shape.kv_cache_fraction is not None:
        budget = int(free * shape.kv_cache_fraction)
        pages = budget // page_bytes
    elif shape.kv_cache_bytes is not None:
        pages = shape.kv_cache_bytes // page_bytes
    else:
        pages = 1 + shape.max_batch_rows * per_row
    return dict(pages=pages, page=page, page_bytes=page_bytes, per_row=per_row, size=row_tokens, q=q)


def serve_plan(cfg: ModelConfig, decode: DecodeConfig, shape: ServeShape, device: DeviceMemory) -> Plan:
    """Per-rank memory of an engine: weights, KV page pool, forward activations, CUDA-Graph pools."""
    cfg = cfg.model_copy(update={"block_size": decode.block_size or cfg.block_size})
    e = elem(shape.dtype)
    plan = Plan(f"serve {shape.tp}-way TP, {shape.max_batch_rows} rows, N_buf {decode.buffer_size}, "
                f"B {cfg.block_size}, {str(shape.dtype).removeprefix('torch.')}, per rank", device)
    weights = weight_bytes(cfg, shape.tp, shape.dtype)
    plan.items.append(Item("weights", weights, f"{sum(weight_elements(cfg, shape.tp)) / 1e9:.2f}B elements"))
    if weights > device.usable:
        plan.reasons.append(f"the weights alone ({gib(weights)} per rank) exceed the {device.name}'s "
                            f"{gib(device.usable)} usable; use more tensor-parallel ranks")
    pool = kv_pool(cfg, shape, decode, max(device.usable - weights, 0))
    pages, rows = pool["pages"], shape.max_batch_rows
    plan.items.append(Item("KV page pool", pages * pool["page_bytes"],
                           f"{pages:,} pages of {pool['page']} tokens, {pool['page_bytes'] / 2**20:.2f} MiB each"))
    usable_pages = max(pages - 1, 0)
    plan.facts |= {"KV pages (scratch incl.)": f"{pages:,}", "KV tokens": f"{usable_pages * pool['page']:,}",
                   "requests at max length": f"{usable_pages // pool['per_row']:,} "
                                             f"({pool['size']:,} tokens each)"}
    if usable_pages < pool["per_row"]:
        plan.reasons.append(f"the KV pool holds {usable_pages} usable pages; one request at max_length needs "
                            f"{pool['per_row']} (raise the KV budget or lower decode.max_length)")
    size, att = pool["size"], shape.attention
    n_buf, chunk = decode.buffer_size, min(shape.prefill_chunk, size)
    prefill = layer_activation(cfg, shape.tp, e, 1, chunk, size, "sdpa") + chunk * size
    if shape.cuda_graphs:  # decode steps run inside the graphs' pool (below)
        plan.items.append(Item("activations", prefill, f"a {chunk}-token prefill chunk (dense mask) at span "
                                                       f"{size:,}, eager"))
    else:
        act = max(decode_activation(cfg, shape.tp, e, rows, n_buf, size, n_buf, att), prefill)
        plan.items.append(Item("activations", act, f"largest of a full-batch step ({att}) and a {chunk}-token "
                                                   f"prefill chunk (dense mask) at span {size:,}"))
    plan.items.append(_graph_item(cfg, shape, decode, e))
    plan.check_total()
    return plan


def _graph_item(cfg: ModelConfig, shape: ServeShape, decode: DecodeConfig, e: int) -> Item:
    """The runner captures every decode shape (`decode_shapes`: batch bucket, slots, logits window) at start-up
    into one shared pool and writes every graph's logits into one buffer: the largest forward's peak, that buffer
    and each graph's small window output."""
    from mbd.decoding.compiled import decode_shapes
    from mbd.decoding.scheduler import power_of_two_buckets

    if not shape.cuda_graphs:
        return Item("CUDA-Graph pools", 0, "off (no CUDA Graphs)")
    shapes = decode_shapes(shape.batch_buckets or power_of_two_buckets(shape.max_batch_rows), decode.buffer_size)
    peak = max(decode_activation(cfg, shape.tp, e, b, s, 0, a, "flex") for b, s, a in shapes)
    outputs = sum(b * a * cfg.block_size * 8 for b, _, a in shapes)  # each graph's static window (int64 positions)
    logits = shape.max_batch_rows * decode.buffer_size * cfg.block_size * cfg.vocab_size * e
    return Item("CUDA-Graph pools", peak + logits + outputs, f"{len(shapes)} graphs in one shared pool, captured "
                "at start-up: the largest forward + one logits buffer + every graph's window")


# ---------------------------------------------------------------------------------------------- training

# DeepSpeed defaults the trainer does not change: ZeRO-2/3 reduce bucket (elements); ZeRO-3's gathered parameters.
REDUCE_BUCKET = 500_000_000
MAX_LIVE_PARAMETERS = 1_000_000_000


@dataclass(frozen=True)
class TrainShape:
    world: int  # data-parallel ranks (one per GPU)
    zero_stage: int
    bf16: bool
    micro_batch: int
    seq_len: int  # padded prompt + response; the dual-stream input is twice this
    attention: str = "dense"


def train_activation(cfg: ModelConfig, shape: TrainShape) -> int:
    """Bytes saved for the backward of one micro-batch (no recomputation): per layer the inputs of every norm
    (fp32), projection and MLP matmul, q/k/v, and with the dense mask the math kernel's fp32 attention
    probabilities and head-expanded K/V; plus the head's logits of the dual-stream input and the fp32 cross-entropy of its
    noisy half."""
    e = 2 if shape.bf16 else FP32
    b, n = shape.micro_batch, 2 * shape.seq_len
    t, d, hd = b * n, cfg.hidden_size, cfg.head_dim
    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if cfg.num_experts:
        k, ff = cfg.num_experts_per_tok, cfg.moe_intermediate_size
        mlp = k * (4 * ff + 2 * d) + 4 * ff * cfg.num_shared_experts
    else:
        mlp = 4 * cfg.intermediate_size
    layer = t * e * (4 * d + 2 * (h + 2 * kv) * hd + h * hd + mlp) + t * FP32 * 2 * d
    if shape.attention == "dense":  # the math kernel's fp32 probabilities and head-expanded K/V
        layer += b * h * n * n * FP32 + 2 * b * h * n * hd * FP32
    mask = b * n * n * (1 + FP32) if shape.attention == "dense" else 0  # the bool mask and its additive form
    logits = t * cfg.vocab_size * e + b * shape.seq_len * cfg.vocab_size * FP32 * 2
    return cfg.num_hidden_layers * layer + mask + logits


def zero_states(n_params: int, shape: TrainShape) -> list[Item]:
    """DeepSpeed's per-rank parameters, gradients and optimizer states under ZeRO-2 or ZeRO-3."""
    e, w = (2 if shape.bf16 else FP32), shape.world
    part = -(-n_params // w)
    if shape.zero_stage == 3:
        gathered = min(n_params - part, MAX_LIVE_PARAMETERS)
        params = Item("parameters", (part + gathered) * e,
                      f"1/{w} partition + up to {gathered / 1e9:.2f}B gathered for the running layers")
    else:
        params = Item("parameters", n_params * e, f"{n_params / 1e9:.2f}B, replicated on every rank")
    bucket = min(REDUCE_BUCKET, n_params)
    grads = Item("gradients", (part + bucket) * e, f"1/{w} partition + a {bucket / 1e6:.0f}M-element reduce bucket")
    optim = Item("optimizer states", part * 3 * FP32, f"fp32 master + Adam m, v: 12 B/param over {w} rank(s)")
    return [params, grads, optim]


def train_plan(cfg: ModelConfig, shape: TrainShape, device: DeviceMemory) -> Plan:
    """Per-rank memory of DeepSpeed ZeRO-2/3 training with a torch AdamW (parameters in bf16 on GPU)."""
    n_params = weight_elements(cfg, 1)[0]
    plan = Plan(f"train ZeRO-{shape.zero_stage} on {shape.world} rank(s), micro-batch {shape.micro_batch} x "
                f"{shape.seq_len} x 2, {'bf16' if shape.bf16 else 'fp32'}, per rank", device)
    plan.items += zero_states(n_params, shape)
    plan.items.append(Item("activations", train_activation(cfg, shape), f"saved for backward, {shape.attention} "
                                                                         "attention"))
    plan.facts["parameters (all ranks)"] = f"{n_params:,}"
    plan.check_total()
    if plan.reasons and shape.attention == "dense":
        flex = plan.total - plan.item("activations") + train_activation(cfg, replace(shape, attention="flex"))
        if flex <= device.usable:
            plan.reasons.append(f"the dense mask runs attention's math kernel, which keeps every head's [n, n] "
                                f"probabilities for the backward: with attention: flex it needs {gib(flex)}")
    return plan


# ---------------------------------------------------------------------------------------------- rendering

def render(plans: list[Plan], labels: list[str] | None = None, notes_of: int = 0) -> str:
    """A table: one column per plan, one row per item, then the derived facts and the verdict; below, what each
    item of plan `notes_of` counts, and every plan's reasons."""
    labels = labels or [p.title for p in plans]
    names = list(dict.fromkeys(i.name for p in plans for i in p.items))
    facts = list(dict.fromkeys(k for p in plans for k in p.facts))
    rows = [[n] + [gib(next((i.bytes for i in p.items if i.name == n), 0)) for p in plans] for n in names]
    rows.append(["total at start"] + [gib(p.total) for p in plans])
    rows.append(["usable"] + [gib(p.device.usable) for p in plans])
    rows += [[k] + [p.facts.get(k, "-") for p in plans] for k in facts]
    rows.append(["fits"] + ["yes" if p.fits else "NO" for p in plans])
    head = ["per rank"] + labels
    widths = [max(len(str(r[c])) for r in [head, *rows]) for c in range(len(head))]

    def line(r: list) -> str:
        return "| " + " | ".join(str(x).ljust(widths[c]) if c == 0 else str(x).rjust(widths[c])
                                 for c, x in enumerate(r)) + " |"

    out = [line(head), "|" + "|".join("-" * (wd + 1) + (":" if c else "-") for c, wd in enumerate(widths)) + "|"]
    out += [line(r) for r in rows]
    out += [f"  {i.name}: {i.note}" for i in plans[notes_of].items if i.note]
    for label, p in zip(labels, plans):
        out += [f"  {label}: DOES NOT FIT: {r}" for r in p.reasons]
    return "\n".join(out)


def refuse_unless_fits(plan: Plan, label: str) -> Plan:
    """The plan, or PlanError carrying the table and every reason."""
    if not plan.fits:
        raise PlanError(f"{label} does not fit, refused before loading:\n{render([plan], [plan.title])}")
    return plan
