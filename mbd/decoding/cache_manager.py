"""KV cache manager: the page pool, each row's page table, and prefix reuse across requests.

The paper asks that "committed prefix blocks should produce stable KV cache that remains reusable by the standard
BD-LM prefix cache" (sec:decoding). Committed (IN_CACHE) blocks are immutable, so a page whose tokens are all
committed can serve any later request whose sequence starts with the same tokens. Such a page is registered under
a chained hash (its predecessor's hash and its own tokens, as vLLM does), and a hit compares the tokens too, so a
hash collision is a miss, never a wrong page. Only full, committed pages are ever registered or shared: a row
never writes below its committed length, so shared pages are read-only.

A pool with room for every row at full size (the default) gives each row home pages that it reads in place; there a
hit is copied into the row's home pages once at admission (the prefill is still skipped) rather than shared, which
would make every decode step gather the shared pages. A pool sized by a memory budget shares hit pages by reference.
A page is held by every row whose table maps it (reference count). At count zero a registered page stays cached
(evicted least recently used when the pool needs a page; a sequence's tail pages go first), an unregistered one is
free. The manager keeps host lists and writes a row's table to the device (`cache.page_table`) whenever it
changes, before the next forward reads it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from mbd.model.cache import SCRATCH, KVCache


def page_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
    """Chained page key: equal keys for equal token prefixes (tuples of ints hash the same in every process)."""
    return hash((prev, tokens))


class CacheManager:
    def __init__(self, cache: KVCache, prefix_caching: bool = True):
        self.cache, self.page, self.prefix_caching = cache, cache.page_size, prefix_caching
        self.ref = [0] * cache.num_pages
        self.free: dict[int, None] = dict.fromkeys(p for p in range(cache.num_pages) if p != SCRATCH)  # ordered set
        self.cached: OrderedDict[int, None] = OrderedDict()  # registered pages no row holds, least recent first
        self.key: dict[int, tuple[int, tuple[int, ...]]] = {}  # registered page -> (hash, tokens)
        self.by_hash: dict[int, int] = {}
        self.tables: list[list[int]] = [[] for _ in range(cache.rows)]  # row -> physical pages, logical order
        self.hashes: list[list[int]] = [[] for _ in range(cache.rows)]  # row -> chained hashes of its first pages
        self.inflight: dict[int, int] = {}  # hash -> row, of prompt pages mapped but not yet committed
        self.home = [cache.homes] * cache.rows  # row -> it maps only its home pages (`at_home`)

    # ----------------------------------------------------------------- accounting
    @property
    def capacity(self) -> int:
        return self.cache.num_pages - 1

    def available(self) -> int:
        """Pages a row could be given now: free ones and cached ones no row holds."""
        return len(self.free) + len(self.cached)

    def used(self) -> int:
        """Pages some row holds."""
        return self.capacity - self.available()

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page)

    # ----------------------------------------------------------------- mapping
    def match(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """(page, hash) of the cached pages holding the longest full-page prefix of `ids`."""
        return list(self._walk(ids))[:-1]

    def _walk(self, ids: Sequence[int]):
        """Cached (page, hash) of ids' leading full pages, then (None, hash of the first uncached full page, or
        None when every full page is cached)."""
        h = None
        for j in range(len(ids) // self.page if self.prefix_caching else 0):
            tokens = tuple(ids[j * self.page: (j + 1) * self.page])
            h = page_hash(h, tokens)
            page = self.by_hash.get(h)
            if page is None or self.key[page][1] != tokens:
                yield None, h
                return
            yield page, h
        yield None, None

    def admit(self, row: int, ids: Sequence[int], need: int, reserve: int = 0) -> int | None:
        """Map pages covering positions [0, need) of an empty row, reusing cached pages for the longest
        full-page prefix of `ids` (committed tokens). Returns how many leading tokens were cached (their
        prefill is skipped), or None, changing nothing, when that would leave fewer than `reserve` pages, or
        when the next page of `ids` is being prefilled by another row: waiting a step for it to be committed
        beats computing the same prefix twice (requests sharing a system prompt often arrive together)."""
        *hits, (_, pending) = self._walk(ids)
        if pending is not None and pending in self.inflight:
            return None
        # A pool with homes reserves every row's room anyway: a hit is copied into the row's home page (one copy
        # per admission instead of a gather of the shared pages in every decode step). Without homes, hit pages
        # are mapped and shared by reference.
        copy = self.cache.homes
        kept = sum(1 for j, (p, _) in enumerate(hits) if not copy or p == self.cache.home(row, j))  # mapped as is
        fresh = max(0, self.pages_for(need) - kept)
        idle_hits = sum(1 for p, _ in hits if self.ref[p] == 0)  # held from here on: no longer available
        if self.available() - idle_hits - fresh < reserve:
            return None
        for p, _ in hits:  # held while the row's pages are allocated, so none of them is evicted meanwhile
            if self.ref[p] == 0:
                del self.cached[p]
            self.ref[p] += 1
        if copy:
            table = self.tables[row] = []
            for j in range(self.pages_for(need)):
                src = hits[j][0] if j < len(hits) else None
                if src is not None and src == self.cache.home(row, j):  # already home (this row's earlier request)
                    self.ref[src] += 1
                    table.append(src)
                    continue
                table.append(self._alloc(row, j))
                if src is not None:
                    self.cache.copy_page(src, table[-1])
            for p, _ in hits:
                self._unref(p)
        else:
            self.tables[row] = [p for p, _ in hits]
            self.tables[row] += [self._alloc(row, kept + i) for i in range(fresh)]
        self.hashes[row] = [h for _, h in hits]
        self._upload(row)
        h = hits[-1][1] if hits else None
        for j in range(len(hits), len(ids) // self.page if self.prefix_caching else 0):
            h = page_hash(h, tuple(ids[j * self.page: (j + 1) * self.page]))
            if h not in self.by_hash:
                self.inflight.setdefault(h, row)
        return len(hits) * self.page

    def ensure(self, row: int, need: int) -> bool:
        """Map pages so that the row covers positions [0, need); False (nothing changed) if the pool is short."""
        n = self.pages_for(need) - len(self.tables[row])
        if n <= 0:
            return True
        if n > self.available():
            return False
        have = len(self.tables[row])
        self.tables[row] += [self._alloc(row, have + i) for i in range(n)]
        self._upload(row)
        return True

    def register(self, row: int, ids: Sequence[int], committed: int) -> None:
        """Make the row's full pages below `committed` (tokens `ids[:committed]`) reusable by later requests.
        A page whose content is already registered under another page stays private."""
        if not self.prefix_caching:
            return
        hs, table = self.hashes[row], self.tables[row]
        for j in range(len(hs), committed // self.page):
            tokens = tuple(ids[j * self.page: (j + 1) * self.page])
            h = page_hash(hs[-1] if hs else None, tokens)
            hs.append(h)
            if self.inflight.get(h) == row:
                del self.inflight[h]
            page = table[j]
            if h not in self.by_hash and page not in self.key:
                self.key[page], self.by_hash[h] = (h, tokens), page

    def release(self, row: int) -> None:
        """Unmap all of a row's pages (tail first, so cached tails are evicted before the heads they extend)."""
        for p in reversed(self.tables[row]):
            self._unref(p)
        self.tables[row], self.hashes[row] = [], []
        for h in [h for h, r in self.inflight.items() if r == row]:
            del self.inflight[h]
        self._upload(row)

    def _unref(self, p: int) -> None:
        self.ref[p] -= 1
        if self.ref[p] == 0:
            if p in self.key:
                self.cached[p] = None
            else:
                self.free[p] = None

    def at_home(self, rows: int) -> bool:
        """Whether rows [0, rows) map only their home pages (the cache then reads them without a gather)."""
        return all(self.home[:rows])

    def _alloc(self, row: int, j: int) -> int:
        """A page for logical page j of `row`: its home page if no row holds it (evicting what it caches: in-place
        reads are worth more than an old prefix), else the first free page, else the least recently released
        cached one (evicted)."""
        home = self.cache.home(row, j) if self.cache.homes else None
        if home in self.free:
            p = home
            del self.free[p]
        elif home in self.cached:
            p = home
            del self.cached[p]
            self._forget(p)
        elif self.free:
            p = next(iter(self.free))
            del self.free[p]
        else:
            p, _ = self.cached.popitem(last=False)
            self._forget(p)
        self.ref[p] = 1
        return p

    def _forget(self, page: int) -> None:
        h, _ = self.key.pop(page)
        del self.by_hash[h]

    def _upload(self, row: int) -> None:
        t, c = self.tables[row], self.cache
        self.home[row] = c.homes and all(p == c.home(row, j) for j, p in enumerate(t))
        c.map_row(row, t)
