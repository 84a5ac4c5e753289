"""Service metrics through `ray.serve.metrics`, under the names Ray Serve LLM users chart (vLLM's, with the `mbd_`
prefix) plus the Block Buffer's own. Ray's exporter prefixes `ray_` and Serve adds the deployment, replica and
application tags; every metric here also carries `model_name`. Created inside replicas: metric objects need a
running Ray worker. Each replica records 0 on its counters and gauges as it starts (`declare`), so that a dashboard
shows 0, not "no data", before the first event (a Ray series is exported once it has a value), and the decoder
records its gauges again while they do not change (Ray drops a gauge that is not). docs/serving.md lists the names
as the scrape shows them."""

from __future__ import annotations

import functools
import re
import threading
import time
import types
from typing import Annotated, Any, Iterable, Iterator, Union, get_args, get_origin

from pydantic import BaseModel
from ray.serve.metrics import Counter, Gauge, Histogram

from pipelines.ray_private import zero
from serve_app.protocol import ChatCompletionRequest, CompletionRequest

LATENCY_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]
TOKEN_LATENCY_S = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5]
TPF = [0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128]
NFE = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
MODEL = ("model_name",)
ABORT_REASONS = ("client_disconnect", "deadline")
# Ray's metrics agent drops a gauge series its worker did not record again within 2 export intervals (20 s at Ray's
# default 10 s; Ray 2.60), so the decoder records its gauges again this often: at most every export interval >= 2 s
GAUGE_REFRESH_S = 2.0


def _named(metric: Any, model: str) -> Any:
    metric.set_default_tags({"model_name": model})
    return metric


def _inc(counter: Counter, n: float, tags: dict[str, str] | None = None) -> None:
    if n > 0:  # Ray counters refuse inc(0)
        counter.inc(n, tags=tags)


def _paths(tp: Any, path: str) -> Iterator[str]:
    """`path` and the field paths below it that a value of type `tp` has (list items as `[]`)."""
    yield path
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        yield from _paths(args[0], path)
    elif origin in (Union, types.UnionType):
        for a in args:
            yield from _paths(a, path)
    elif origin in (list, tuple):
        for a in args:
            if a is not Ellipsis:
                yield from _paths(a, f"{path}[]")
    elif isinstance(tp, type) and issubclass(tp, BaseModel):
        for name, f in tp.model_fields.items():
            for key in {name, f.alias or name}:
                yield from _paths(f.annotation, f"{path}.{key}" if path else key)


@functools.cache
def known_fields() -> frozenset[str]:
    """Every field path of the request bodies (indices as `[]`), and "body": the only refusal tags there are."""
    return frozenset(p for m in (CompletionRequest, ChatCompletionRequest) for p in _paths(m, "") if p) | {"body"}


def field_tag(param: str | None) -> str:
    """The refused field as a bounded tag value: indices dropped (`messages[3].role` -> `messages[].role`), and a
    path the request models do not have (a client's own unknown key) as "unsupported_field", so that clients
    cannot grow the metric's series without bound."""
    if not param:
        return "none"
    path = re.sub(r"\[\d+\]", "[]", param)
    return path if path in known_fields() else "unsupported_field"


class IngressMetrics:
    """Per HTTP request: status by endpoint, refusals by field, and per completed request its tokens (vLLM's
    `prompt_tokens` / `generation_tokens`), latencies and the diffusion side (TPF, NFE)."""

    def __init__(self, model: str) -> None:
        def counter(name: str, doc: str, tags: tuple[str, ...] = ()) -> Counter:
            return _named(Counter(name, doc, tag_keys=MODEL + tags), model)

        def histogram(name: str, doc: str, bounds: list[float]) -> Histogram:
            return _named(Histogram(name, doc, boundaries=bounds, tag_keys=MODEL), model)

        self.requests = counter("mbd_http_requests", "HTTP requests by endpoint and status code",
                                ("endpoint", "status"))
        self.refused = counter("mbd_requests_refused", "4xx answers by status and the request field they name",
                               ("status", "field"))
        self.prompt_tokens = counter("mbd_prompt_tokens", "prompt tokens of completed requests")
        self.generation_tokens = counter("mbd_generation_tokens", "generated tokens of completed requests")
        self.ttft = histogram("mbd_time_to_first_token_seconds", "arrival to the first committed tokens reaching "
                              "the ingress (a non-streamed request gets them all at once)", LATENCY_S)
        self.itl = histogram("mbd_inter_token_latency_seconds", "per choice: time from its first tokens to its "
                             "last / the tokens that followed the first", TOKEN_LATENCY_S)
        self.e2e = histogram("mbd_e2e_request_latency_seconds", "arrival to the last token", LATENCY_S)
        self.tpf = histogram("mbd_tokens_per_forward", "tokens per forward (TPF) of a request", TPF)
        self.nfe = histogram("mbd_forwards_per_request", "model forwards (NFE) of a request", NFE)
        self.aborted = counter("mbd_requests_aborted", "engine requests (choices) ended before they finished, by "
                               "reason: client_disconnect (the client went away) or deadline (its `timeout` passed)",
                               ("reason",))

    def declare(self, endpoints: Iterable[str]) -> None:
        """Every counter at 0: the plain ones, `http_requests` per endpoint with status 200 (what the dashboard's
        `model` variable lists models from) and `requests_refused` as status 400 naming no field."""
        for c in (self.prompt_tokens, self.generation_tokens):
            zero(c)
        for e in endpoints:
            zero(self.requests, {"endpoint": e, "status": "200"})
        zero(self.refused, {"status": "400", "field": "none"})
        for reason in ABORT_REASONS:
            zero(self.aborted, {"reason": reason})

    def abort(self, reason: str, n: int = 1) -> None:
        _inc(self.aborted, n, {"reason": reason})

    def request(self, endpoint: str, status: int) -> None:
        self.requests.inc(tags={"endpoint": endpoint, "status": str(status)})

    def refusal(self, status: int, param: str | None) -> None:
        if 400 <= status < 500:
            self.refused.inc(tags={"status": str(status), "field": field_tag(param)})

    def finished(self, prompt_tokens: int, generation_tokens: int, nfe: int, ttft_s: float, e2e_s: float,
                 itl_s: list[float]) -> None:
        """One completed request (all its choices): its TTFT and e2e latency, and each choice's inter-token
        latency (`choices.latencies`)."""
        _inc(self.prompt_tokens, prompt_tokens)
        _inc(self.generation_tokens, generation_tokens)
        self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        for x in itl_s:
            self.itl.observe(x)
        if nfe:
            self.tpf.observe(generation_tokens / nfe)
            self.nfe.observe(nfe)


class DecoderMetrics:
    """Per replica, from `actors.engine_process.engine_stats` as the engine steps (at most every ON_STEP_S) and
    the host's restart and quarantine counts as they happen (`count`): vLLM's running / waiting / KV use /
    preemptions / prefix-cache counters, and the Block Buffer's active blocks per forward, buffer occupancy and the
    structured-output share of a step, each over the interval since the previous report."""

    GAUGES = ("running", "waiting", "kv_usage", "active", "occupancy", "guided")
    COUNTED = {"preemptions": "preemptions", "prefix_query_tokens": "prefix_queries",
               "prefix_hit_tokens": "prefix_hits"}

    def __init__(self, model: str) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return _named(Gauge(name, doc, tag_keys=MODEL), model)

        def counter(name: str, doc: str) -> Counter:
            return _named(Counter(name, doc, tag_keys=MODEL), model)

        self.running = gauge("mbd_num_requests_running", "requests holding a batch row (prefilling or decoding)")
        self.waiting = gauge("mbd_num_requests_waiting", "requests queued in the engine for a batch row")
        self.kv_usage = gauge("mbd_kv_cache_usage_perc", "share of the KV page pool held by requests (0..1)")
        self.active = gauge("mbd_active_blocks_per_forward", "ACTIVE blocks a decode forward predicts, summed "
                            "over its rows")
        self.occupancy = gauge("mbd_block_buffer_occupancy", "resident blocks / Block Buffer slots of the "
                               "decoding rows (0..1)")
        self.guided = gauge("mbd_structured_output_step_share", "share of decode-step time spent in grammar "
                            "matchers (0..1)")
        self.preemptions = counter("mbd_num_preemptions", "requests preempted because the KV page pool ran out")
        self.prefix_queries = counter("mbd_prefix_cache_queries", "prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("mbd_prefix_cache_hits", "of those, tokens served from cached pages")
        self.restarts = counter("mbd_engine_restarts", "engine processes restarted after an exit")
        self.quarantined = counter("mbd_requests_quarantined", "requests failed as suspects of engine exits")
        self._last: dict[str, float] = {}
        self._gauges: dict[str, float] = {}  # each gauge's last value, recorded again by `_keep`
        self._gauges_lock = threading.Lock()

    def declare(self) -> None:
        """Every gauge and counter at 0, as an idle engine that never restarted reports them; from now on the gauges
        are recorded again every GAUGE_REFRESH_S by a thread of their own, so that an idle engine's 0 running
        requests stay on the scrape (Ray drops a gauge not recorded again) instead of turning into "no data"."""
        for name in self.GAUGES:
            self._set(name, 0.0)
        for c in (self.preemptions, self.prefix_queries, self.prefix_hits, self.restarts, self.quarantined):
            zero(c)
        threading.Thread(target=self._keep, name="mbd-metrics-gauges", daemon=True).start()

    def _set(self, gauge: str, value: float) -> None:
        with self._gauges_lock:
            self._gauges[gauge] = value
            getattr(self, gauge).set(value)

    def _keep(self) -> None:
        while True:
            time.sleep(GAUGE_REFRESH_S)
            with self._gauges_lock:
                for gauge, value in self._gauges.items():
                    getattr(self, gauge).set(value)

    def update(self, stats: dict[str, float]) -> None:
        self._set("running", stats["running"])
        self._set("waiting", stats["waiting"])
        self._set("kv_usage", stats["kv_pages_used"] / max(stats["kv_pages"], 1))
        d = {k: v - self._last.get(k, 0.0) for k, v in stats.items()}
        if self._last.get("engine_pid") != stats["engine_pid"]:  # a new engine process counts from zero again
            d.update({k: stats[k] for k in ("steps", "step_s", "grammar_s", "decode_rows", "active_blocks",
                                            "resident_blocks", "preemptions", "prefix_query_tokens",
                                            "prefix_hit_tokens")})
        if d["steps"] > 0:
            self._set("active", d["active_blocks"] / d["steps"])
            self._set("occupancy", d["resident_blocks"] / max(d["decode_rows"] * stats["buffer_size"], 1))
            self._set("guided", d["grammar_s"] / d["step_s"] if d["step_s"] > 0 else 0.0)
        for key, attr in self.COUNTED.items():
            _inc(getattr(self, attr), d[key])
        self._last = dict(stats)

    def count(self, what: str, n: int) -> None:
        """The host's supervision counts as they happen (`EngineHost` on_count): "restarts", "quarantined"."""
        _inc({"restarts": self.restarts, "quarantined": self.quarantined}[what], n)
