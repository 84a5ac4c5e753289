"""Paged KV cache: a pool of fixed-size pages, addressed per request row through a page table.

Rows see a logical cache of `size` positions (`max_len + margin`, so that a full Block Buffer past the last
committed token always fits); logical page j of row r lives in physical page `page_table[r, j]`. Shapes never
change after allocation (the pool, the table), so a decode step can be captured as a CUDA Graph; only the table's
contents change, in place, when pages are mapped. Physical page 0 is scratch: every unmapped logical page (and the
one extra column past the last, where out-of-range positions go) points there, so the static forward's writes for
DUMMY slots and free rows land somewhere no real token ever reads (the caller's mask hides them).

Without a page count the pool gives every row its own `size` positions (the identity table; the reference decoders
and tests use it). The engine's page manager (`mbd.decoding.cache_manager`) maps pages on demand instead, and
shares committed prefix pages between rows. Every forward given the cache scatters the K/V of its tokens into their
absolute positions; positions at or past `lengths[row]` are scratch. `commit(rows, n)` makes the next n positions of
a row part of the immutable prefix: their K/V were written by the forward in which those tokens were final (the
TO_CACHE step), which is the paper's decode-store overlap. A view may cap the key span that `read` returns
(`view(..., span=L)`): attention then costs what the live prefix needs, not what a row could hold.
"""

from __future__ import annotations

import torch

from mbd.config import ModelConfig
from mbd.model.tp import SINGLE, TPGroup

SCRATCH = 0  # physical page that unmapped logical pages point to


def default_page_size(block: int) -> int:
    """Pages of at least 16 tokens (vLLM's default), always a whole number of BD-LM blocks."""
    return block * max(1, 16 // block)


class KVCache:
    def __init__(self, cfg: ModelConfig, rows: int, max_len: int, margin: int = 0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", tp: TPGroup = SINGLE,
                 page_size: int | None = None, num_pages: int | None = None):
        """num_pages: the pool (scratch page included); None: room for every row at full size, identity-mapped."""
        heads = tp.split(cfg.num_key_value_heads, "num_key_value_heads")
        self.size = max_len + margin
        self.span = self.size  # keys [0, span) are what `read` returns
        self.max_len = max_len
        self.page_size = page_size or default_page_size(cfg.block_size)
        if self.page_size % cfg.block_size:
            raise ValueError(f"page_size={self.page_size} must be a multiple of block_size={cfg.block_size}")
        self.pages_per_row = -(-self.size // self.page_size)
        identity = num_pages is None
        self.num_pages = 1 + rows * self.pages_per_row if identity else num_pages
        if self.num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one is scratch), got {self.num_pages}")
        # head-major pool: a row's keys of one head are contiguous within a page, as attention reads them
        shape = (cfg.num_hidden_layers, heads, self.num_pages, self.page_size, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.page_table = torch.full((rows, self.pages_per_row + 1), SCRATCH, dtype=torch.long, device=device)
        # a pool with room for every row at full size gives row r "home" pages 1 + r * pages_per_row + j: while
        # the rows a forward reads map only home pages, `read` is a strided view instead of a gather
        self.homes = self.num_pages >= 1 + rows * self.pages_per_row
        self.row0, self.at_home = 0, False
        self.table_version = 0  # page table changes so far (`map_row`)
        if self.homes:  # [layers, rows, kvh, pages_per_row * page_size, d]: every row's home pages, in place
            self.home_k, self.home_v = (
                x[:, :, 1: 1 + rows * self.pages_per_row].unflatten(2, (rows, -1)).flatten(3, 4).transpose(1, 2)
                for x in (self.k, self.v))
        if identity:
            self.page_table[:, :-1] = 1 + torch.arange(rows * self.pages_per_row, device=device).view(rows, -1)

    @staticmethod
    def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype, tp: TPGroup = SINGLE) -> int:
        """Bytes of K and V of one page over all layers (what a memory budget is divided by)."""
        heads = tp.split(cfg.num_key_value_heads, "num_key_value_heads")
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_hidden_layers * page_size * heads * cfg.head_dim * elem

    def home(self, row: int, j: int) -> int:
        """Row `row`'s home page for logical page j (pools with `homes` only)."""
        return 1 + row * self.pages_per_row + j

    def view(self, start: int, stop: int, span: int | None = None, at_home: bool = False) -> "KVCache":
        """A cache over rows [start, stop) sharing storage and page table (writes and commits land in this
        cache) whose `read` returns keys [0, span) only: a smaller batch bucket runs against the front rows,
        and a short live prefix against a short key range, without copying the table. at_home: the caller
        knows every page these rows have mapped is their home page, so reads need no gather."""
        span = self.size if span is None else span
        if not 0 < span <= self.size:
            raise ValueError(f"span={span} must be in (0, {self.size}]")
        if at_home and not self.homes:
            raise ValueError("at_home needs a pool with a home for every row")
        v = KVCache.__new__(KVCache)
        v.__dict__.update(self.__dict__)
        v.lengths, v.page_table, v.span = self.lengths[start:stop], self.page_table[start:stop], span
        v.row0, v.at_home = self.row0 + start, at_home
        return v

    @property
    def rows(self) -> int:
        return self.lengths.shape[0]

    def address(self, pos: torch.Tensor) -> torch.Tensor:
        """Pool kv_at [b * n] of absolute positions pos [b, n] of every row (in order), through the page table;
        computed once per forward, used by every layer's `write`."""
        page = self.page_table.gather(1, (pos // self.page_size).clamp(max=self.pages_per_row))
        return (page * self.page_size + pos % self.page_size).flatten()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, kv_at: torch.Tensor) -> None:
        """Store k/v [b, kvh, n, d] of every row (in order) at `kv_at` (`address(pos)`)."""
        for pool, x in ((self.k, k), (self.v, v)):
            pool[layer].flatten(1, 2).index_copy_(1, kv_at, x.transpose(0, 1).flatten(1, 2))

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [b, kvh, span, d] of every row, gathered page by page through the table (or, at home, viewed in
        place: a position a row has not mapped then shows whatever its home page holds, which the caller's
        mask hides just as it hides the scratch page): the key range a mask over `span` keys addresses."""
        if self.at_home:
            rows = slice(self.row0, self.row0 + self.rows)
            return self.home_k[layer, rows, :, : self.span], self.home_v[layer, rows, :, : self.span]
        pages = self.page_table[:, : -(-self.span // self.page_size)]
        b, n = pages.shape
        flat = pages.flatten()  # index_select copies whole pages: several times faster than advanced indexing on CPU
        k, v = (x[layer].index_select(1, flat).unflatten(1, (b, n)).flatten(2, 3)[:, :, : self.span].transpose(0, 1)
                for x in (self.k, self.v))
        return k, v

    def copy_page(self, src: int, dst: int) -> None:
        """Copy one page's K/V (all layers) to another page."""
        for x in (self.k, self.v):
            x[:, :, dst] = x[:, :, src]

    def nbytes(self) -> int:
        """Bytes allocated for K and V (the whole pool)."""
        return self.k.nbytes + self.v.nbytes

    def commit(self, rows: torch.Tensor | int, n: torch.Tensor | int) -> None:
        """Extend the committed prefix of `rows` by n tokens (their K/V are already in place)."""
        self.lengths[rows] += n

    def map_row(self, row: int, pages: list[int]) -> None:
        """Row `row`'s logical pages 0, 1, ... live in physical `pages`; the rest of its table is scratch. Counted
        in `table_version`, so that what is derived from the table (a paged BlockMask) knows to follow."""
        full = pages + [SCRATCH] * (self.page_table.shape[1] - len(pages))
        self.page_table[row].copy_(torch.tensor(full, dtype=torch.long))
        self.table_version += 1
