"""Tensor parallelism: column/row-parallel linears and a vocab-parallel head over torch.distributed.

Weights are stored full-size in checkpoints; each parallel layer knows how to cut its own shard
(`shard_(full)`), so loading is the same code for TP=1 and TP=N. Works with NCCL on GPU and gloo on CPU.
A parameter packed from several checkpoint tensors (fused q|k|v, gate|up, stacked experts) says which
(`checkpoint_parts`), how they join into the full tensor (`join`) and how it splits back (`split`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class TPGroup:
    """Rank and size of this process inside its tensor-parallel group (group=None: default group)."""

    rank: int = 0
    world: int = 1
    group: object | None = None

    def split(self, n: int, what: str) -> int:
        if n % self.world:
            raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={self.world}")
        return n // self.world

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()


class ColumnParallelLinear(nn.Linear):
    """y_local = x W_local^T: the output features are split across ranks.

    `splits` lists the sizes of stacked sub-matrices (e.g. fused q|k|v) so that each is cut separately. `parts`
    names them when the checkpoint keeps them as separate linears (SDAR's q_proj, k_proj, v_proj; gate_proj and
    up_proj): one GEMM instead of several at run time, their own names in checkpoints (`checkpoint_parts`).
    """

    def __init__(self, d_in: int, d_out: int, bias: bool, tp: TPGroup = SINGLE, splits: tuple[int, ...] | None = None,
                 parts: tuple[str, ...] = ()):
        self.tp = tp
        self.splits = splits or (d_out,)
        self.parts = parts
        local = sum(tp.split(s, "output features") for s in self.splits)
        super().__init__(d_in, local, bias=bias)

    def checkpoint_parts(self, name: str) -> list[str]:
        """The checkpoint tensors parameter `name` (this module's weight or bias) is the concatenation of."""
        if not self.parts:
            return [name]
        module, _, leaf = name.rpartition(".")
        parent = module.rpartition(".")[0]
        return [f"{parent}.{p}.{leaf}" for p in self.parts]

    def join(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts)

    def split(self, name: str, full: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(full, list(self.splits)))

    def shard_(self, name: str, full: torch.Tensor) -> torch.Tensor:
        parts = torch.split(full, list(self.splits), dim=0)
        return torch.cat([p.chunk(self.tp.world, dim=0)[self.tp.rank] for p in parts], dim=0)


class RowParallelLinear(nn.Linear):
    """y = sum_ranks x_local W_local^T: the input features are split; `reduce=False` leaves the sum
    to the caller (MoE sums all experts first and reduces once)."""

    def __init__(self, d_in: int, d_out: int, bias: bool, tp: TPGroup = SINGLE, reduce: bool = True):
        self.tp = tp
        self.reduce = reduce
        super().__init__(tp.split(d_in, "input features"), d_out, bias=bias)

    def shard_(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name.endswith("bias"):
            return full if self.tp.rank == 0 else torch.zeros_like(full)
        return full.chunk(self.tp.world, dim=1)[self.tp.rank]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return self.tp.all_reduce(y) if self.reduce else y


class VocabParallelHead(nn.Linear):
    """LM head whose vocabulary rows are split; logits are all-gathered so every rank sees all of them."""

    def __init__(self, d_in: int, vocab: int, tp: TPGroup = SINGLE):
        self.tp = tp
        super().__init__(d_in, tp.split(vocab, "vocab_size"), bias=False)

    def shard_(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return full.chunk(self.tp.world, dim=0)[self.tp.rank]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(super().forward(x))
