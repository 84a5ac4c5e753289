"""How a decode forward runs: eager, or compiled and captured at a few fixed shapes (this module).

gpt-fast says it in one line, `torch.compile(model, mode="reduce-overhead", fullgraph=True)`; the engine's version
is `decode_mode(engine, device)` to choose, then `CompiledForward(forward, ...).run(shape)`, where `forward` is the
runner's eager paged (flex) forward taking the function that calls each decoder layer. What it decides, and why:
- What is compiled: one decoder layer (`mbd.model.base.call_layer`), not the model, `fullgraph` (a graph break
  would split the fused kernels: it fails loudly instead); the paged FlexAttention inside it is lowered with it to
  inductor's fused kernel. Every layer of a family has the same code and shapes, so one graph serves them all:
  compile time does not grow with depth, and the eager loop around the layers costs nothing once the step is a
  CUDA Graph.
- Shapes: (batch rows, slots, logits window slots), the window all slots or none (`window`): a step is one of
  `decode_shapes(buckets, N_buf)`, each captured as a graph of its own. The layers compile with Dynamo's automatic
  dynamic shapes: the first shape static, then a dimension that differs in a later shape (batch rows, query
  positions) becomes symbolic, so a serve config's 24 (rows, slots) pairs compile into a few graphs per layer kind
  instead of 24 (as vLLM compiles one graph over a symbolic token count and captures a CUDA Graph per size). Weights,
  the page pool and the hidden size stay static. The sdpa path's key span would be a shape of its own, so only the
  flex path is compiled (`EngineConfig` refuses the rest).
- When: every shape at start-up (`warmup`), so no request waits for a compile or a capture; a shape first met
  later is prepared the same way on first use.
- Dynamo's limits: its default of 8 compilations per function would send later shapes back to eager silently;
  they are raised to COMPILED_SHAPES while this module compiles (`torch._dynamo.config.patch`), nowhere else.
- The compile cache (`EngineConfig.compile_cache`): inductor and Triton read their folders only from the
  TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR variables (torch 2.13 has no config field for them; inductor reads
  them at each compile and hands them to its compile workers), so they are set while this module compiles and
  restored after: a restarted replica loads its kernels from there instead of compiling them. The folder given is
  a root: each (torch, device, compiled config) has its own sub-folder (`keyed_cache`), so a cache built by
  `mbd warmup` and copied to another node is read only by a replica that would compile the same kernels.
- Capture (CUDA, `EngineConfig.cuda_graphs`): each shape's forward is a CUDA Graph replayed per step, every graph
  in one memory pool writing one logits buffer (`_capture`). With `compile: off` the captured forward is eager.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch

from mbd.config import ConfigError, EngineConfig, ModelConfig
from mbd.model.base import LayerCall, call_layer
from mbd.progress import ProgressLine

log = logging.getLogger("mbd.engine")

COMPILED_SHAPES = 4096  # compiled (layer kind x input shape) graphs a process may hold

Shape = tuple[int, int, int]  # (batch rows, slots, logits window slots)
Output = tuple[torch.Tensor, torch.Tensor]  # (logits [rows, window * B, V], window positions [rows, window * B])
Forward = Callable[[int, int, int, LayerCall], Output]


class DecodeMode(NamedTuple):
    """How an engine's decode forward runs, "auto" resolved for its device."""

    attention: str  # "flex" (paged FlexAttention) or "sdpa" (dense masks over a key span, the eager reference)
    compile: str  # the torch.compile mode of the decoder layers; "off": eager
    graphs: bool  # every shape captured as a CUDA Graph

    @property
    def static(self) -> bool:
        """Compiled or captured: the forward runs at fixed shapes (`CompiledForward`)."""
        return self.compile != "off" or self.graphs


def decode_mode(engine: EngineConfig, device: torch.device) -> DecodeMode:
    """flex, compiled and captured on CUDA; sdpa, eager on CPU; what `engine` sets otherwise. `attention: auto`
    with a compile mode or graphs asked for by name is flex on any device: only flex honours them, and sdpa would
    run eager without a word."""
    cuda = device.type == "cuda"
    static = engine.compile not in ("auto", "off") or engine.cuda_graphs == "on"
    attention = engine.attention if engine.attention != "auto" else ("flex" if cuda or static else "sdpa")
    if attention == "sdpa":
        return DecodeMode(attention, "off", False)
    compile = engine.compile if engine.compile != "auto" else ("default" if cuda else "off")
    return DecodeMode(attention, compile, engine.cuda_graphs == "on" or (engine.cuda_graphs == "auto" and cuda))


def decode_shapes(buckets: Sequence[int], n_buf: int) -> list[Shape]:
    """Every (batch rows, slots, logits window) a compiled / graph-captured decode forward runs: each bucket, any
    resident slot count, and a window of all slots or none (a forward that only stores). SDAR-8B's serve config
    (6 buckets, N_buf 4): 48 CUDA Graphs over 24 (rows, slots) pairs of layer inputs."""
    return [(b, s, a) for b in buckets for s in range(1, n_buf + 1) for a in (0, s)]


# EngineConfig.compile -> torch.compile's mode. The engine captures each step's CUDA Graph itself (`_capture`), so
# max-autotune (GEMMs autotuned for the 32-64-row decode shapes: a Triton template wins where cuBLAS's choice,
# e.g. a split-K with its extra reduction kernel, is slower) runs without inductor's own graph trees, which would
# capture every layer call inside the engine's capture.
INDUCTOR_MODES = {"default": None, "max-autotune": "max-autotune-no-cudagraphs"}


@functools.cache
def compiled_layer(mode: str) -> LayerCall:
    """`call_layer` compiled with that EngineConfig.compile mode, one per process: Dynamo keeps its graphs on the
    function's code, so every engine of the process shares them (a second engine of the same model and shapes
    compiles nothing). dynamic=None: automatic dynamic shapes (the module's docstring)."""
    return torch.compile(call_layer, fullgraph=True, dynamic=None, mode=INDUCTOR_MODES[mode])


@contextlib.contextmanager
def compile_cache(path: str | None) -> Iterator[None]:
    """Inductor's and Triton's compiled artifacts in `path` (None: torch's default) for the duration."""
    if not path:
        yield
        return
    root = os.path.abspath(path)
    os.makedirs(root, exist_ok=True)
    new = {"TORCHINDUCTOR_CACHE_DIR": root, "TRITON_CACHE_DIR": os.path.join(root, "triton")}
    old = {k: os.environ.get(k) for k in new}
    os.environ.update(new)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def device_tag(device: torch.device) -> str:
    """What compiled kernels are specific to: the GPU's name and compute capability, or the CPU's vector ISA."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm{major}{minor}"
    return f"cpu {torch.backends.cpu.get_cpu_capability()}"


def cache_key(cfg: ModelConfig, dtype: torch.dtype, mode: DecodeMode, tp_world: int, device: torch.device) -> dict:
    """What decides the kernels a compiled decode forward loads: torch, the device, and a hash of the config that
    shapes a decoder layer (the model's, less max_position_embeddings: positions enter the layers as cos/sin
    tensors; the dtype, attention, compile mode and TP degree). Batch buckets and N_buf only add shapes, which the
    compile cache keys itself, so they share the folder."""
    config = {"model": cfg.model_dump(mode="json", exclude={"max_position_embeddings"}),
              "dtype": str(dtype).removeprefix("torch."), "attention": mode.attention, "compile": mode.compile,
              "tp": tp_world}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    return {"torch": torch.__version__, "device": device_tag(device), "config": digest}


def keyed_cache(root: str | None, key: dict) -> str | None:
    """`root`'s folder for `key` (None: torch's default cache), made on first use with the key written in it;
    a folder whose written key differs (copied or renamed by hand) is refused, never read."""
    if not root:
        return None
    name = "-".join(key[k] for k in ("torch", "device", "config"))
    path = os.path.join(os.path.abspath(root), "".join(c if c.isalnum() or c in "+.-_" else "_" for c in name))
    stamp = os.path.join(path, "key.json")
    if os.path.isfile(stamp):
        with open(stamp) as f:
            found = json.load(f)
        if found != key:
            raise ConfigError(f"compile_cache: {path} holds kernels built for {found}, this engine needs {key}; "
                              "refused (remove the folder or point compile_cache elsewhere)")
    else:
        os.makedirs(path, exist_ok=True)
        with open(stamp, "w") as f:
            json.dump(key, f)
    return path


class CompiledForward:
    """The paged decode forward at fixed shapes: its decoder layers compiled (mode "off": eager) and, with
    `graphs`, each shape captured as a CUDA Graph. `forward(rows, slots, window, call)` is the eager forward;
    `out_rows`, `out_q`: the largest forward's rows and buffer positions (the captured logits buffer's size)."""

    def __init__(self, forward: Forward, mode: DecodeMode, cache: str | None, dtype: torch.dtype, out_rows: int,
                 out_q: int):
        if mode.compile != "off" and dtype == torch.float64:
            raise ConfigError(f"compile: {mode.compile} needs float32/bfloat16/float16 weights (inductor's "
                              "FlexAttention rejects float64); use compile: off for the eager kernel")
        self.forward, self.mode, self.cache, self.out_size = forward, mode, cache, (out_rows, out_q)
        self.call = call_layer if mode.compile == "off" else compiled_layer(mode.compile)
        self.prepared: set[Shape] = set()
        self.graphs: dict[Shape, tuple[torch.cuda.CUDAGraph, Output]] = {}
        self._pool = torch.cuda.graph_pool_handle() if mode.graphs else None  # every shape's graph shares it
        self._logits: torch.Tensor | None = None  # and writes its logits into this buffer (`_capture`)

    @staticmethod
    def window(slots: int, active: int) -> int:
        """The logits window a forward of `active` ACTIVE-window slots runs with: all slots, or none."""
        return slots if active else 0

    def run(self, shape: Shape) -> Output:
        """The forward of `shape` (rows, slots, window): the captured graph replayed, or the compiled layers."""
        if shape not in self.prepared:
            self._prepare(shape)
        if not self.mode.graphs:
            return self.forward(*shape, self.call)
        graph, out = self.graphs[shape]
        graph.replay()
        return out

    def warmup(self, shapes: Sequence[Shape], say: Callable[[str], None] = log.info) -> float:
        """Compile every shape and capture its graph before serving, so no request waits for either; a line
        before, one per shape (done / total, elapsed, ETA) and the total. Returns the seconds it took."""
        what = f"{len(shapes)} CUDA Graphs" if self.mode.graphs else f"{len(shapes)} compiled shapes"
        say(f"engine warm-up: {what} (compile: {self.mode.compile}; cache: {self.cache or 'torch default'})")
        progress = ProgressLine("engine warm-up", len(shapes), show=False, every_s=float("inf"))
        t0 = time.perf_counter()
        with torch.inference_mode():
            for rows, slots, window in shapes:
                t = time.perf_counter()
                if (rows, slots, window) not in self.prepared:
                    self._prepare((rows, slots, window))
                progress.update(shape=f"rows {rows}, slots {slots}, window {window}",
                                took=f"{time.perf_counter() - t:.1f} s")
                say(progress.line())
        seconds = time.perf_counter() - t0
        say(f"engine warm-up done: {what} in {seconds:.1f} s")
        return seconds

    def _prepare(self, shape: Shape) -> None:
        """Compile the shape's layers (a first run) or capture its graph, under this module's Dynamo limits and
        compile cache."""
        limits = dict(recompile_limit=COMPILED_SHAPES, accumulated_recompile_limit=COMPILED_SHAPES)
        with torch._dynamo.config.patch(**limits), compile_cache(self.cache):
            if self.mode.graphs:
                self.graphs[shape] = self._capture(shape)
            else:
                self.forward(*shape, self.call)
        self.prepared.add(shape)

    def _capture(self, shape: Shape) -> tuple[torch.cuda.CUDAGraph, Output]:
        # Warm-up runs only rewrite scratch K/V (positions >= lengths), which every forward rewrites anyway.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                logits, _ = self.forward(*shape, self.call)
        torch.cuda.current_stream().wait_stream(side)
        if self._logits is None:  # [rows, Q, V]: every graph's logits land in a view of this one buffer
            self._logits = logits.new_empty(self.out_size + logits.shape[-1:])
        # One memory pool and one logits buffer for every shape, so graphs cost the largest forward plus one batch
        # of logits instead of the sum of every shape's forward and logits. Safe because graphs replay one at a time
        # on one stream and each step consumes its logits (the policy's update, the one device-to-host copy) before
        # the next forward: a later capture may reuse an earlier one's scratch, never memory still referenced (the
        # buffer, each graph's window).
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, idx = self.forward(*shape, self.call)
            out = self._logits[: shape[0], : logits.shape[1]]
            out.copy_(logits)
        return graph, (out, idx)
