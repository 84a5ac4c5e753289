"""The service's Prometheus metrics as an operator scrapes them: N requests over HTTP to a real local cluster,
then Ray's metrics export endpoint must count exactly those N, their tokens exactly as the responses' usage,
the refusals by the field they name, and the engine gauges back at idle."""

import json

import httpx
import pytest

from serve_app.metrics import NFE
from tests.integration.scrape import export_ports, poll, total
from tests.integration.conftest import SERVE_SLOTS as SLOTS, serve_apps, tiny_serve_config
from tests.integration.test_serve_units import DECODE

MODEL = "mbd-metrics"
N_PLAIN, N_STREAM, N_REFUSED = 5, 3, 2


@pytest.fixture(scope="module")
def base(serve_url, ckpt):
    for url in serve_apps(serve_url, metrics=tiny_serve_config(ckpt, MODEL)):  # the app deleted after the module
        yield f"{url}/metrics"


def _streamed(c: httpx.Client, url: str, body: dict) -> dict:
    """The last event of a streamed request before [DONE]: it carries the usage and the NFE."""
    last = {}
    with c.stream("POST", url, json=body | {"stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                last = json.loads(line[6:])
    return last


def test_counters_equal_what_was_served(base):
    url = f"{base}/v1/completions"
    prompts = ["1 + 1 =", "2 + 3 =", "the same prefix, the same prefix, again:", "4 * 4 =", "7 - 2 ="]
    usages, nfe = [], []
    with httpx.Client(timeout=120) as c:
        for i in range(N_PLAIN):
            r = c.post(url, json={"model": MODEL, "prompt": prompts[i % len(prompts)], "max_tokens": 8 + i})
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
            nfe.append(r.json()["mbd"]["nfe"])
        for i in range(N_STREAM):
            tail = _streamed(c, url, {"model": MODEL, "prompt": prompts[i], "max_tokens": 12})
            usages.append(tail["usage"])
            nfe.append(tail["mbd"]["nfe"])
        for _ in range(N_REFUSED):
            r = c.post(url, json={"model": MODEL, "prompt": "x", "max_tokens": -1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    n = N_PLAIN + N_STREAM
    prompt_tokens, generated = sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages)
    m = {"model_name": MODEL}

    def settled(s) -> bool:
        return (total(s, "ray_mbd_e2e_request_latency_seconds_count", **m) == n
                and total(s, "ray_mbd_requests_refused_total", **m) == N_REFUSED
                and total(s, "ray_mbd_generation_tokens_total", **m) == generated
                and total(s, "ray_mbd_num_requests_running", **m) == 0
                and total(s, "ray_mbd_prefix_cache_queries_total", **m) > 0)

    s = poll(export_ports(), settled, timeout_s=90)
    ok = {"endpoint": "/v1/completions", "status": "200", **m}
    assert total(s, "ray_mbd_http_requests_total", **ok) == n
    assert total(s, "ray_mbd_http_requests_total", endpoint="/v1/completions", status="400", **m) == N_REFUSED
    assert total(s, "ray_mbd_requests_refused_total", status="400", field="max_tokens", **m) == N_REFUSED
    assert total(s, "ray_mbd_prompt_tokens_total", **m) == prompt_tokens
    assert total(s, "ray_mbd_generation_tokens_total", **m) == generated
    for h in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "tokens_per_forward",
              "forwards_per_request"):
        assert total(s, f"ray_mbd_{h}_count", **m) == n, h
    # each request's NFE in its bucket (Ray exports a histogram's _sum from bucket midpoints: not exact)
    for le in NFE:
        assert total(s, "ray_mbd_forwards_per_request_bucket", le=str(float(le)), **m) == \
            sum(x <= le for x in nfe), le
    # the engine at idle, its pool freed; every series carries the model and Serve's replica tag
    assert total(s, "ray_mbd_num_requests_running", **m) == 0
    assert total(s, "ray_mbd_num_requests_waiting", **m) == 0
    assert total(s, "ray_mbd_kv_cache_usage_perc", **m) == 0
    assert 0 < total(s, "ray_mbd_active_blocks_per_forward", **m) <= SLOTS * DECODE.buffer_size
    assert 0 < total(s, "ray_mbd_block_buffer_occupancy", **m) <= 1
    assert total(s, "ray_mbd_engine_restarts_total", **m) == 0
    ours = [lab for _, lab, _ in s if lab.get("model_name") == MODEL]
    assert ours and all("replica" in lab for lab in ours)
    assert {lab["deployment"] for _, lab, _ in s if lab.get("model_name") == MODEL} == {"OpenAIIngress", "Decoder"}
