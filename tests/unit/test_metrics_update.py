"""How a decoder replica turns the engine's cumulative stats into metrics: counters grow by what happened since
the last report (also across an engine process restart, whose stats count from zero again), and the Block
Buffer gauges are averages over the steps since the last report. Ray's metric classes are replaced by
recorders: what is checked is the arithmetic, not Ray's export (tests/integration/test_serve_metrics.py)."""

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from serve_app import metrics
from serve_app.protocol import ChatCompletionRequest, from_validation_error


class Recorder:
    def __init__(self, name, description="", boundaries=None, tag_keys=()):
        self.name, self.value, self.tags = name, 0.0, {}

    def set_default_tags(self, tags):
        self.tags = tags

    def inc(self, n=1.0, tags=None):
        assert n > 0  # Ray counters refuse inc(0)
        self.value += n

    def set(self, v, tags=None):
        self.value = v

    observe = set


@pytest.fixture
def decoder(monkeypatch):
    for cls in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics, cls, Recorder)
    return metrics.DecoderMetrics("m")


def stats(**kw):
    base = dict(running=1, waiting=0, kv_pages_used=0, kv_pages=10, steps=0, step_s=0.0, grammar_s=0.0,
                decode_rows=0, active_blocks=0, resident_blocks=0, buffer_size=2, preemptions=0,
                prefix_query_tokens=0, prefix_hit_tokens=0, engine_pid=7)
    return base | kw


def test_counters_grow_by_deltas_and_survive_an_engine_restart(decoder):
    decoder.update(stats(preemptions=2, prefix_query_tokens=64, prefix_hit_tokens=32))
    decoder.update(stats(preemptions=3, prefix_query_tokens=96, prefix_hit_tokens=32))
    assert (decoder.preemptions.value, decoder.prefix_queries.value, decoder.prefix_hits.value) == (3, 96, 32)
    # the engine process restarted: the host counts it at once (the new engine may never step); its counts
    # start again at 0
    decoder.count("restarts", 1)
    decoder.count("quarantined", 2)
    assert (decoder.restarts.value, decoder.quarantined.value) == (1, 2)
    decoder.update(stats(preemptions=1, prefix_query_tokens=16, engine_pid=8))
    assert (decoder.preemptions.value, decoder.prefix_queries.value, decoder.restarts.value) == (4, 112, 1)
    assert decoder.running.tags == {"model_name": "m"}


def test_block_buffer_gauges_average_the_steps_since_the_last_report(decoder):
    decoder.update(stats(steps=10, step_s=1.0, grammar_s=0.5, decode_rows=20, active_blocks=20,
                         resident_blocks=30, kv_pages_used=4))
    assert (decoder.active.value, decoder.occupancy.value, decoder.guided.value) == (2.0, 0.75, 0.5)
    assert decoder.kv_usage.value == 0.4
    decoder.update(stats(steps=14, step_s=2.0, grammar_s=0.6, decode_rows=24, active_blocks=32,
                         resident_blocks=34))  # 4 steps: 4 rows, 12 active, 4 resident blocks, 0.1 of 1.0 s
    assert (decoder.active.value, decoder.occupancy.value) == (3.0, 0.5)
    assert decoder.guided.value == pytest.approx(0.1)
    decoder.update(stats(steps=14, step_s=2.0))  # no step since: the gauges keep their values
    assert decoder.active.value == 3.0


def test_refusals_are_tagged_by_field_without_indices():
    assert [metrics.field_tag(p) for p in ("messages[3].content[0].type", "prompt[12]", "max_tokens", None)] == \
        ["messages[].content[].type", "prompt[]", "max_tokens", "none"]


def test_a_clients_unknown_keys_share_one_refusal_tag():
    """100 distinct unknown keys, top-level and inside a message, are refused naming each key, but the metric's
    `field` tag takes one value for all of them (a client cannot grow the series without bound)."""
    params = []
    for i in range(100):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"} | ({f"k{i}": 1} if i % 2 else {})]}
        body |= {} if i % 2 else {f"key_{i}": 1}
        with pytest.raises(ValidationError) as e:
            ChatCompletionRequest.model_validate(body)
        err = from_validation_error(RequestValidationError([{**x, "loc": ("body", *x["loc"])}
                                                            for x in e.value.errors()]))
        assert err.status == 400 and err.param in (f"key_{i}", f"messages[0].k{i}")
        params.append(err.param)
    assert len(set(params)) == 100
    assert {metrics.field_tag(p) for p in params} == {"unsupported_field"}
    assert metrics.field_tag("response_format.json_schema.schema") == "response_format.json_schema.schema"
