"""Service metrics through `ray.serve.metrics` (exported by Ray's Prometheus endpoint with the deployment,
replica and application tags Serve adds). Created inside replicas: metric objects need a running Ray worker."""

from __future__ import annotations

from ray.serve.metrics import Counter, Gauge, Histogram

LATENCY_MS = [5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000]
TPF = [0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128]


class IngressMetrics:
    """Per HTTP request: outcome, tokens, NFE, TPF, time to first committed block, end-to-end latency."""

    def __init__(self) -> None:
        self.requests = Counter("mbd_requests", "HTTP requests by endpoint and status code",
                                tag_keys=("endpoint", "status"))
        self.prompt_tokens = Counter("mbd_prompt_tokens", "prompt tokens of completed requests")
        self.completion_tokens = Counter("mbd_completion_tokens", "generated tokens of completed requests")
        self.nfe = Counter("mbd_nfe", "model forward passes (NFE) spent on completed requests")
        self.tpf = Histogram("mbd_tpf", "tokens per forward (TPF) per request", boundaries=TPF)
        self.ttfb = Histogram("mbd_time_to_first_block_ms", "request arrival to first committed block",
                              boundaries=LATENCY_MS)
        self.e2e = Histogram("mbd_e2e_latency_ms", "request arrival to last byte", boundaries=LATENCY_MS)

    def request(self, endpoint: str, status: int) -> None:
        self.requests.inc(tags={"endpoint": endpoint, "status": str(status)})

    def finished(self, prompt_tokens: int, completion_tokens: int, nfe: int, e2e_ms: float) -> None:
        for counter, n in ((self.prompt_tokens, prompt_tokens), (self.completion_tokens, completion_tokens),
                           (self.nfe, nfe)):
            if n > 0:  # Ray counters refuse inc(0)
                counter.inc(n)
        if nfe:
            self.tpf.observe(completion_tokens / nfe)
        self.e2e.observe(e2e_ms)


class DecoderMetrics:
    """Per replica: requests inside the engine (decoding or waiting for a slot), the KV page pool, the prefix
    cache and preemptions (from `actors.engine_process.engine_stats`, refreshed as the engine steps)."""

    def __init__(self) -> None:
        self.queue_length = Gauge("mbd_engine_requests", "requests in this replica's engine (running + waiting)")
        self.pages_used = Gauge("mbd_kv_pages_used", "KV cache pages held by requests")
        self.pages_free = Gauge("mbd_kv_pages_free", "KV cache pages free or holding an evictable cached prefix")
        self.hit_rate = Gauge("mbd_prefix_cache_hit_rate", "share of admitted prompt tokens served from cached pages")
        self.preemptions = Counter("mbd_preemptions", "requests preempted because the KV page pool ran out")
        self._preempted = 0

    def update(self, stats: dict[str, float]) -> None:
        self.queue_length.set(stats["in_engine"])
        self.pages_used.set(stats["kv_pages_used"])
        self.pages_free.set(stats["kv_pages_free"])
        self.hit_rate.set(stats["prefix_hit_rate"])
        if stats["preemptions"] > self._preempted:  # Ray counters refuse inc(0)
            self.preemptions.inc(stats["preemptions"] - self._preempted)
            self._preempted = int(stats["preemptions"])
