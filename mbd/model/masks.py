"""Block-causal attention masks built from small per-token index tensors.

A query at absolute position p may see a key at position s iff s lies in the visible region of its
row (s < visible[b]) and block(s) <= block(p); every token also sees itself so that no softmax row is
empty (an empty row would turn into NaN and NaN * 0 still poisons other rows). `block_causal` is that rule, the
one definition: the dense boolean form (`block_causal_dense`, SDPA, the reference) evaluates it on index tensors,
`PagedDecodeMask` inside a FlexAttention mask_mod over the KV page pool itself, never materialising an L x L tensor
or gathering a row's keys.
"""

from __future__ import annotations

import torch


def block_causal(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor, block_size: int) -> torch.Tensor:
    """May the query at position q see the key at position k (broadcasting tensors)? k visible and in q's block
    or an earlier one, or k is q itself."""
    return ((k < visible) & (k // block_size <= q // block_size)) | (k == q)


def block_causal_dense(q_pos: torch.Tensor, kv_len: int, visible: torch.Tensor, block_size: int) -> torch.Tensor:
    """Dense mask [b, 1, n, kv_len] for queries at `q_pos` [b, n] against keys at positions 0..kv_len-1."""
    kv = torch.arange(kv_len, device=q_pos.device)
    return block_causal(q_pos.unsqueeze(-1), kv, visible.view(-1, 1, 1), block_size).unsqueeze(1)


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the additive one SDPA applies (0 where allowed, -inf elsewhere), in the queries' dtype: SDPA
    on CPU converts a bool mask on every call, i.e. every layer; a mask reused over a forward's layers (and over
    steps) is converted once. The softmax sees the same values, so the result is the same."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


class PagedDecodeMask:
    """`block_causal_dense` for Block Buffer queries, as FlexAttention BlockMasks over the whole KV page pool.

    Keys are the pool itself ([1, kvh, num_pages * page, d] per layer), one KV block per page, so a row reads its
    pages where they lie: its BlockMask row lists the physical pages of its table, those wholly inside the committed
    prefix as full blocks (every query sees them, no mask_mod) and the pages from there to the end of its visible
    region (or its own last position) as partial ones. The mask_mod is the whole truth on its own (eager flex
    evaluates it everywhere): it maps a physical key to the row's logical position through `logical`, the inverse
    of the row's page table (-1 where the row has not mapped the page, the scratch page always), and applies
    `block_causal`. A free row maps nothing and sees nothing (flex gives such a row zeros, not NaN).

    Every tensor is allocated once for all rows and rewritten in place by `update` (from the committed lengths,
    the slot states and the page table), so the masks of every (batch rows, slots) shape are views that a
    compiled forward and a CUDA Graph read at fixed addresses: the key span is no shape at all.
    """

    def __init__(self, rows: int, n_buf: int, block: int, page: int, num_pages: int, table_width: int,
                 device: torch.device):
        self.block, self.page, self.num_pages, self.width = block, page, num_pages, table_width
        self.q_max = n_buf * block
        i32 = dict(dtype=torch.int32, device=device)
        self.q_pos = torch.zeros(rows, self.q_max, dtype=torch.long, device=device)
        self.visible = torch.zeros(rows, dtype=torch.long, device=device)
        self.logical = torch.full((rows, num_pages), -1, **i32)
        # flex wants an index column per KV block of the keys (every page of the pool), the table a column per logical
        # page; only the first counts of a row's columns are read
        cols = max(num_pages, table_width)
        self.full_n, self.part_n = torch.zeros(rows, 1, 1, **i32), torch.zeros(rows, 1, 1, **i32)
        self.full_idx, self.part_idx = torch.zeros(rows, 1, 1, cols, **i32), torch.zeros(rows, 1, 1, cols, **i32)
        self._columns = torch.arange(table_width, device=device)
        self._masks: dict[tuple[int, int], object] = {}
        # what the mask_mod reads keeps the engine's sizes in a compiled layer (a layer compiled for another engine's
        # sizes recompiles instead of going symbolic): inductor's CPU flex template cannot compile a mask_mod that
        # indexes a tensor of symbolic size (torch 2.13), and these are constants of the engine anyway
        for t in (self.q_pos, self.visible, self.logical):
            torch._dynamo.mark_static(t)

    def update(self, lengths: torch.Tensor, resident: torch.Tensor, page_table: torch.Tensor) -> None:
        """Rewrite every row's tensors from its committed length, resident slot count and page table (all
        rows of the engine, on the device)."""
        B, P, W = self.block, self.page, self.width
        self.q_pos.copy_(lengths[:, None] + torch.arange(self.q_max, device=lengths.device))
        self.visible.copy_(lengths + resident * B)
        self.logical.fill_(-1)
        self.logical.scatter_(1, page_table, self._columns.to(torch.int32).expand_as(page_table).contiguous())
        self.logical[:, 0] = -1  # the scratch page (mbd.model.cache.SCRATCH) holds nobody's keys
        end = torch.maximum(self.visible, lengths + self.q_max)
        n_full = lengths // P
        self.full_n.view(-1).copy_(n_full)
        self.part_n.view(-1).copy_(torch.clamp(-(-end // P), max=W) - n_full)
        self.full_idx[:, 0, 0, :W].copy_(page_table)
        shifted = torch.clamp(n_full[:, None] + self._columns, max=W - 1)
        self.part_idx[:, 0, 0, :W].copy_(page_table.gather(1, shifted))

    @staticmethod
    def q_block(q: int) -> int:
        """A query block for a buffer of q positions: one block per row (>= q), a power of two of at least 16 so
        that GPU kernels' query tiles divide it. The BlockMask's is the engine's largest buffer's, whatever a step's
        slots: a compiled layer then sees the same block size at every slot count (a Python constant that would
        otherwise compile a graph per size)."""
        return max(16, 1 << (q - 1).bit_length())

    def block_mask(self, rows: int, slots: int):
        """The BlockMask of a forward over rows [0, rows) x `slots` slots (views of the shared tensors)."""
        key = (rows, slots)
        if key not in self._masks:
            self._masks[key] = self._build(rows, slots * self.block)
        return self._masks[key]

    def _build(self, rows: int, q: int):
        from torch.nn.attention.flex_attention import BlockMask

        B, P, logical, q_pos, visible = self.block, self.page, self.logical, self.q_pos, self.visible

        def mask_mod(b, h, qi, ki):
            lp = logical[b, ki // P]
            return (lp >= 0) & block_causal(q_pos[b, qi], lp * P + ki % P, visible[b], B)

        return BlockMask.from_kv_blocks(self.part_n[:rows], self.part_idx[:rows], self.full_n[:rows],
                                        self.full_idx[:rows], BLOCK_SIZE=(self.q_block(self.q_max), P),
                                        mask_mod=mask_mod, seq_lengths=(q, self.num_pages * P), compute_q_blocks=False)
