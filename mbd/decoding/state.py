"""Block Buffer state: slot states, the batch-wide device buffers, and the host-side request record.

The device buffers are allocated once and only ever written in place, because the CUDA Graph of the step
forward reads them by address (`tokens` is the graph's input, `state` decides which slots are visible).
A row of the buffers is one batch row, i.e. one request's Block Buffer of `n_buf` block slots.
Invariant: resident slots (ACTIVE / TO_CACHE) form a prefix of the row, TO_CACHE slots a prefix of those,
and DUMMY slots hold mask tokens, so activating a slot only flips its state.
The host `Request` owns each request's state (committed length, resident and TO_CACHE counts); the device's
slot states and committed lengths are derived from it (`RowLayout`, uploaded by the runner before a forward).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

from typing import TYPE_CHECKING

import torch

from mbd.decoding.validate import RequestParams

if TYPE_CHECKING:
    from mbd.decoding.constraints import Matcher


class SlotState(IntEnum):
    """sec:appendix_block_states. IN_CACHE blocks have left the buffer (popped); the value names them in traces."""

    DUMMY = 0
    ACTIVE = 1
    TO_CACHE = 2
    IN_CACHE = 3


class RowLayout(NamedTuple):
    """What the device must hold for one batch row: its slot states follow from the TO_CACHE and resident
    counts, its KV cache's committed length is the request's. A free row is (0, 0, 0)."""

    n_tc: int
    n_res: int
    committed: int


FREE_ROW = RowLayout(0, 0, 0)


class BatchBuffers:
    """Device tensors for `rows` Block Buffers of `n_buf` slots of `block` tokens each.

    The host knows every row's slot states exactly (they follow from its TO_CACHE / resident counts), so
    `upload` writes `state` and the cache lengths with one small copy instead of many index ops; nothing else
    writes them."""

    def __init__(self, rows: int, n_buf: int, block: int, mask_id: int, device: torch.device):
        self.n_buf, self.block, self.mask_id = n_buf, block, mask_id
        q = n_buf * block
        self.tokens = torch.full((rows, q), mask_id, dtype=torch.long, device=device)
        self.state = torch.zeros(rows, n_buf, dtype=torch.long, device=device)
        self.prompt_len = torch.zeros(rows, dtype=torch.long, device=device)
        self.tau_m2t = torch.ones(rows, 1, 1, device=device)  # broadcasts over [rows, slots, block]
        self.semi_max_masked = torch.full((rows, 1), -1, dtype=torch.long, device=device)
        self.tau_t2t = torch.full((rows, 1), 2.0, device=device)  # > 1: never revises
        # DMax token merge (`merge_embeddings`): weight of each position's token against the mask embedding in
        # the next forward; 1 = the token itself. Only the DMax policy writes it.
        self.token_conf = torch.ones(rows, q, device=device)

    def load_row(self, row: int, first_block: list[int], prompt_len: int, p: RequestParams, semi_max_masked: int) -> None:
        """Start a request: slot 0 (ACTIVE once uploaded) holds the prompt tail (fixed) followed by masks."""
        self.tokens[row] = self.mask_id
        if first_block:
            self.tokens[row, : len(first_block)] = torch.tensor(first_block, device=self.tokens.device)
        self.prompt_len[row] = prompt_len
        self.tau_m2t[row] = p.tau_m2t
        self.semi_max_masked[row] = semi_max_masked
        self.tau_t2t[row] = 2.0 if p.tau_t2t is None else p.tau_t2t
        self.token_conf[row] = 1.0

    def restore_row(self, row: int, tokens: list[int], conf: list[float]) -> None:
        """Put back a preempted request's resident tokens and DMax's merge weights of them (after `load_row` set
        its params)."""
        self.tokens[row, : len(tokens)] = torch.tensor(tokens, device=self.tokens.device)
        self.token_conf[row, : len(conf)] = torch.tensor(conf, device=self.token_conf.device)

    def clear_row(self, row: int) -> None:
        """A free batch row: masked (and all DUMMY once uploaded), inert while the static forward still runs it."""
        self.tokens[row] = self.mask_id
        self.token_conf[row] = 1.0

    def store_tokens(self, new: torch.Tensor, n_pop: list[int], conf: torch.Tensor | None = None) -> None:
        """Write the updated tokens [b, q] of the first q positions (the slots that were run; the rest are
        masked DUMMY slots) of the first b rows, popping n_pop[r] front slots of row r and appending as many
        (masked) DUMMY slots (two slice ops per popping row). `conf` [b, q]: DMax's merge weights, moved alike."""
        for dst, src, fill in ((self.tokens, new, self.mask_id), (self.token_conf, conf, 1.0)):
            if src is None:
                continue
            b, q = src.shape
            dst[:b, :q].copy_(src)
            for r, k in enumerate(n_pop):
                if k:
                    cut = k * self.block
                    dst[r, : q - cut].copy_(src[r, cut:].clone())  # src may be a view of dst (a step with no update)
                    dst[r, q - cut:].fill_(fill)

    @staticmethod
    def slot_states(n_tc: int, n_res: int, n_buf: int) -> list[int]:
        return [SlotState.TO_CACHE] * n_tc + [SlotState.ACTIVE] * (n_res - n_tc) + [SlotState.DUMMY] * (n_buf - n_res)

    def upload(self, layout: list[RowLayout], lengths: torch.Tensor) -> None:
        """Slot states of rows [0, len(layout)) and their committed cache lengths (one host -> device copy)."""
        rows = [self.slot_states(r.n_tc, r.n_res, self.n_buf) + [r.committed] for r in layout]
        t = torch.tensor(rows, device=self.state.device)
        self.state[: len(rows)].copy_(t[:, :-1])
        lengths[: len(rows)].copy_(t[:, -1])


@dataclass
class Request:
    """Host-side record of one request: what the step loop needs per row, in plain Python ints."""

    id: str
    prompt_ids: list[int]
    params: RequestParams
    block: int
    row: int = -1
    known: list[int] = field(default_factory=list)  # tokens final from position 0: the prompt, then final blocks
    aligned_len: int = 0  # block-aligned known tokens prefilled on admission (the prompt's; after a preemption, all
    # committed ones), prefix-cache hits included
    # after a preemption: (resident buffer tokens, their DMax merge weights, n_res, n_tc)
    resume: tuple[list[int], list[float], int, int] | None = None
    committed: int = 0  # committed prefix length (the cache's is uploaded from it); < aligned_len while prefilling
    semi_max_masked: int = -1  # most masks a semi-complete block may hold (`Policy.semi_max_masked`)
    decoding: bool = False  # the aligned prompt is committed and the Block Buffer runs
    n_res: int = 0  # resident (ACTIVE + TO_CACHE) slots
    n_tc: int = 0  # TO_CACHE slots (a prefix of the resident ones)
    nfe: int = 0
    output: list[int] = field(default_factory=list)
    eos: bool = False  # a stop token was emitted (the output is cut there)
    finish_reason: str | None = None
    aborted: bool = False
    t_added: float = field(default_factory=time.perf_counter)
    t_finished: float = 0.0
    step_time_s: float = 0.0
    trace: list[dict] | None = None
    generator: torch.Generator | None = None
    logprobs: dict[int, float] | None = None  # absolute position -> log-probability of its current token
    top_logprobs: dict[int, list[tuple[int, float]]] | None = None  # absolute position -> top (id, logprob)
    grammar: Matcher | None = None  # structured output: the matcher of what may be committed (kept on preemption)
    frontier: int = 0  # with a grammar: the first absolute position its matcher has not accepted
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission

    def __post_init__(self) -> None:
        self.known, self.aligned_len = list(self.prompt_ids), len(self.prompt_ids) // self.block * self.block

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def layout(self) -> RowLayout:
        """The device state of this request's row (all DUMMY while its prompt is prefilled)."""
        return RowLayout(self.n_tc, self.n_res, self.committed)

    @property
    def num_generated(self) -> int:
        """TPF's numerator: the tokens returned, i.e. decoded before the first stop token (the stop token is left
        out, as the authors' engine counts its truncated response)."""
        return len(self.output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
