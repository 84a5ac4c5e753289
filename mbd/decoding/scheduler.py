"""Continuous batching: which requests run in which batch rows, with which KV pages, in what batch.

A FIFO of waiting requests and a fixed set of batch rows. `schedule()` drops aborted requests, admits waiting
ones into the lowest free rows (so occupied rows stay packed at the front and the runner can use the smallest
batch bucket) while their KV pages fit, reusing cached prefix pages (`cache_manager`), maps pages up to every
decoding row's last resident slot, and preempts the youngest running request when the pool is short: back to
the front of the queue, its Block Buffer kept, its committed tokens prefilled again on readmission. Then
`decode_batch()` says what the step's forward runs: the decoding rows, their shapes, and the prompt chunks of
prefilling rows that ride along. The scheduler owns each request's lifecycle (waiting -> prefilling ->
decoding -> finished); the engine's postprocess owns its tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from mbd.decoding.batch import DecodeBatch, PrefillChunk
from mbd.decoding.cache_manager import CacheManager
from mbd.decoding.outputs import EngineStats
from mbd.decoding.policy import Sampler
from mbd.decoding.state import FREE_ROW, BatchBuffers, Request


def power_of_two_buckets(rows: int) -> tuple[int, ...]:
    """The default batch buckets (`EngineConfig.batch_buckets` None): powers of two below `rows`, then `rows`. The
    memory plan (mbd/plan.py) sizes the CUDA-Graph pools from the same function."""
    out, b = [], 1
    while b < rows:
        out.append(b)
        b *= 2
    return (*out, rows)


@dataclass(frozen=True)
class Schedule:
    """The step's request-set changes: aborted requests to report, and rows whose prompts are prefilled on their
    own before the decode forward (only when no row is decoding, so that nobody waits for them)."""

    aborted: list[Request]
    prefill: list[Request]


class Scheduler:
    def __init__(self, kv: CacheManager, buf: BatchBuffers, buckets: Sequence[int] | None, prefill_budget: int,
                 stats: EngineStats):
        """buckets: batch sizes a forward may run (`EngineConfig.batch_buckets`, validated there; default: powers
        of two); prefill_budget: prompt tokens a decode step may carry, rounded down to whole blocks (at least one)."""
        self.kv, self.buf, self.block, self.stats = kv, buf, buf.block, stats
        self.rows = buf.tokens.shape[0]
        self.buckets = tuple(sorted(set(buckets or power_of_two_buckets(self.rows))))
        self._bucket_of = [next(b for b in self.buckets if b >= n) for n in range(self.rows + 1)]
        self.prefill_budget = max(self.block, prefill_budget // self.block * self.block)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # row -> request, in admission order
        self.by_id: dict[str, Request] = {}
        self._aborted: list[Request] = []

    # ----------------------------------------------------------------- the request set
    def add(self, req: Request) -> None:
        if req.id in self.by_id:
            raise ValueError(f"request_id {req.id!r} is already in use; pass a unique request_id")
        self.waiting.append(req)
        self.by_id[req.id] = req

    def abort(self, request_id: str) -> bool:
        """Mark a request aborted; the next `schedule()` frees it. False if it is unknown or done."""
        req = self.by_id.get(request_id)
        if req is None or req.finished:
            return False
        if not req.aborted:
            req.aborted = True
            self._aborted.append(req)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_free_rows(self) -> int:
        return max(0, self.rows - len(self.running) - len(self.waiting))

    def finish(self, req: Request) -> None:
        """Forget a finished request; its row and pages are freed by `release`."""
        if self.running.get(req.row) is req:
            del self.running[req.row]
        self.by_id.pop(req.id, None)

    def release(self, row: int) -> None:
        """Free a batch row and its pages (its committed length becomes 0 on the next upload)."""
        self.kv.release(row)
        self.buf.clear_row(row)

    # ----------------------------------------------------------------- scheduling
    def schedule(self) -> Schedule:
        """Drop aborted requests, admit waiting ones, map pages for every decoding row (preempting when short);
        with no row decoding, every admitted prompt is prefilled on its own this step."""
        aborted = self._take_aborted()
        self._admit()
        self._ensure_pages()
        decoding = any(r.decoding for r in self.running.values())
        return Schedule(aborted, [] if decoding else list(self.running.values()))

    def _take_aborted(self) -> list[Request]:
        gone, self._aborted = self._aborted, []
        for req in gone:
            if self.running.get(req.row) is req:
                del self.running[req.row]
                self.release(req.row)
        if gone:
            self.waiting = deque(r for r in self.waiting if not r.aborted)
        return gone

    def _admit(self) -> None:
        """First come first served into the lowest free rows while their pages fit; a request with nothing to
        prefill (all cached, or a prompt inside its first block) starts decoding at once."""
        admitted = []
        for row in [r for r in range(self.rows) if r not in self.running]:
            if not self.waiting or not self._map_pages(self.waiting[0], row):
                break
            req = self.waiting.popleft()
            req.row = row
            self.running[row] = req
            admitted.append(req)
        for req in admitted:  # after the loop: the page reserve counts rows decoding before this admission
            if req.committed == req.aligned_len:
                self.activate(req)

    def _map_pages(self, req: Request, row: int) -> bool:
        """Map pages for the request's known tokens and a full Block Buffer into `row`, reusing cached prefix
        pages (their prefill is skipped), and keeping one page per decoding row in reserve so that admitting
        does not force a preemption at once. False: it does not fit yet."""
        need = req.aligned_len + req.params.buffer_size * self.block
        reserve = sum(r.decoding for r in self.running.values())
        hit = self.kv.admit(row, req.known[: req.aligned_len], need, reserve)
        if hit is None:
            return False
        req.committed = hit
        if req.cached_tokens is None:  # readmissions after a preemption re-find their own pages: not the prompt's
            req.cached_tokens = min(hit, req.prompt_len)
        self.stats.prefix_query_tokens += req.aligned_len
        self.stats.prefix_hit_tokens += hit
        return True

    def _ensure_pages(self) -> None:
        """Every decoding row needs pages up to its last resident slot. Oldest first; when the pool is short, the
        youngest request is preempted (possibly the one asking), which always lets the oldest go on: a request
        whose worst case exceeds the pool is refused by the request check."""
        for req in list(self.running.values()):
            while req.row >= 0 and req.decoding and not self.kv.ensure(req.row, req.committed + req.n_res * self.block):
                self._preempt(next(reversed(self.running.values())))

    def _preempt(self, req: Request) -> None:
        """Free the request's row and pages and queue it first, keeping its Block Buffer (resident tokens, DMax's
        merge weights and slot counts) on the host. On readmission its committed tokens are prefilled again (or
        found in the prefix cache) and the buffer is put back as it was, so the request decodes exactly as if never
        preempted (a MultiBD buffer's later blocks depend on the earlier ones' partial state)."""
        if req.decoding:
            q = req.n_res * self.block
            req.resume = (self.buf.tokens[req.row, :q].tolist(), self.buf.token_conf[req.row, :q].tolist(), req.n_res,
                          req.n_tc)
            req.aligned_len = req.committed
        self.release(req.row)
        del self.running[req.row]
        req.row = -1
        self.waiting.appendleft(req)
        req.decoding, req.committed, req.n_res, req.n_tc = False, 0, 0, 0
        self.stats.preemptions += 1

    # ----------------------------------------------------------------- state changes the step reports
    def activate(self, req: Request) -> None:
        """The block-aligned known tokens are committed (their full pages become reusable): the row starts
        decoding its first block, which holds the prompt's tail (fixed) then masks, or, after a preemption,
        gets its Block Buffer back."""
        self.buf.load_row(req.row, req.prompt_ids[req.aligned_len:], req.prompt_len, req.params, req.semi_max_masked)
        req.committed, req.n_res, req.n_tc, req.decoding = req.aligned_len, 1, 0, True
        if req.resume is not None:
            tokens, conf, req.n_res, req.n_tc = req.resume
            self.buf.restore_row(req.row, tokens, conf)
            req.resume = None
        self.kv.register(req.row, req.known, req.committed)

    def commit(self, req: Request, n: int) -> None:
        """n more tokens of the request are committed (their K/V are in its pages): register its full pages."""
        req.committed += n
        self.kv.register(req.row, req.known, req.committed)

    def commit_chunks(self, batch: DecodeBatch) -> None:
        """The batch's prompt chunks are in the cache; a request whose whole aligned prompt is in starts decoding."""
        for req, c in zip(batch.chunk_requests, batch.chunks):
            req.committed += len(c.ids)
            self.stats.prefill_tokens += len(c.ids)
            if req.committed == req.aligned_len:
                self.activate(req)
        self.stats.chunked_steps += bool(batch.chunks)

    # ----------------------------------------------------------------- the step's forward
    def decode_batch(self) -> DecodeBatch:
        """The decode forward: decoding rows in the smallest batch bucket covering them, the resident prefix of
        the fullest row (trailing DUMMY slots of every row are skipped), logits for a window of the most ACTIVE
        slots of any row (all slots when a row samples: its draws must not depend on the batch), and up to
        `prefill_budget` prompt tokens of prefilling rows."""
        reqs = [r for r in self.running.values() if r.decoding]
        b = self._bucket_of[max(r.row for r in reqs) + 1]
        S = max(r.n_res for r in reqs)
        A = S if any(r.generator is not None for r in reqs) else max(r.n_res - r.n_tc for r in reqs)
        layout = [FREE_ROW] * b
        for row, req in self.running.items():
            if row < b:
                layout[row] = req.layout
        chunks = self._chunks()
        return DecodeBatch(
            reqs, b, S, A, layout, [c for _, c in chunks], [r for r, _ in chunks], self.kv.at_home(b),
            [Sampler(r.row, r.params.temperature, r.generator, r.params.top_p, r.params.top_k)
             for r in reqs if r.generator is not None],
            any(r.committed < r.prompt_len for r in reqs), any(r.params.tau_t2t is not None for r in reqs),
            any(r.logprobs is not None for r in reqs), any(r.trace is not None for r in reqs),
            any(r.grammar is not None for r in reqs))

    def _chunks(self) -> list[tuple[Request, PrefillChunk]]:
        """Prompt chunks for this step: prefilling rows in admission order, `prefill_budget` tokens in all."""
        out, left = [], self.prefill_budget
        for req in self.running.values():
            if left == 0:
                break
            if not req.decoding:
                n = min(left, req.aligned_len - req.committed)
                out.append((req, PrefillChunk(req.row, req.committed, req.known[req.committed: req.committed + n])))
                left -= n
        return out
