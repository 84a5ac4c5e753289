"""Serving pieces without Ray Serve: detokenization with stop strings, serve configs, error field names, and
the engine host (rank 0's loop thread) driven in-process against the real engine."""

import asyncio
import logging
from contextlib import aclosing
from pathlib import Path

import pytest
import torch

from actors.engine_host import EngineHost
from actors.messages import EngineDead
from actors.supervision_policy import EngineRestarts
from mbd.decoding.model_spec import ModelSpec
from mbd.decoding.validate import RequestParams, validate_request
from mbd.config import ConfigError, DecodeConfig, ModelConfig
from mbd.decoding import Engine, EngineConfig
from mbd.model import build_model, load_checkpoint, save_checkpoint
from mbd.tiny.vocab import save_tokenizer, special_token_ids, vocab
from mbd.tokenizer import Tokenizer
from serve_app.protocol import field_path
from serve_app.config import load_serve_config

REPO = Path(__file__).resolve().parents[2]
DECODE = DecodeConfig(buffer_size=2, tau_add=0.1, tau_semi=0.9, tau_m2t=0.9, max_length=1024, max_new_tokens=1000)


def make_checkpoint(d: Path, seed: int = 0) -> Path:
    """A random tiny SDAR model with the char tokenizer that never emits a stop token: the head rows of EOS,
    <|im_end|> and the mask are zero while the others are scaled up, so some other logit always wins. The large
    logit gaps also keep argmax decisions immune to TP float noise."""
    ids = special_token_ids()
    cfg = ModelConfig(family="sdar", vocab_size=len(vocab()), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      mask_token_id=ids["mask_token_id"], eos_token_id=ids["eos_token_id"],
                      pad_token_id=ids["pad_token_id"], block_size=4, max_position_embeddings=1024)
    model = build_model(cfg, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(100.0)
        model.lm_head.weight[[ids["eos_token_id"], ids["im_end_id"], ids["mask_token_id"]]] = 0
    save_checkpoint(model, cfg, d)
    save_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("serve_units") / "ck")


@pytest.fixture(scope="module")
def tok(ckpt) -> Tokenizer:
    return Tokenizer.from_dir(ckpt, load_checkpoint(ckpt)[1])


# ---- configs and error names ----


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "serve").glob("*.yaml")), ids=lambda p: p.name)
def test_serve_configs_load(path):
    cfg = load_serve_config(path)
    assert cfg.http.host == "127.0.0.1"  # loopback unless the operator opts out
    assert cfg.decode.buffer_size >= 1
    if cfg.model.tensor_parallel_size > 1:
        assert cfg.engine.device == "cuda" and cfg.model.num_gpus_per_rank == 1


def test_bad_serve_config_names_the_field(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model: {path: x, tensor_parallel_size: 0}\n")
    with pytest.raises(ConfigError, match="model.tensor_parallel_size"):
        load_serve_config(p)
    # a replica that accepts fewer requests than it has batch rows would leave rows empty
    p.write_text("model: {path: x}\nengine: {max_batch_rows: 8}\ndecoder: {max_ongoing_requests: 4}\n")
    with pytest.raises(ConfigError, match="decoder.max_ongoing_requests=4 leaves batch rows empty"):
        load_serve_config(p)


@pytest.mark.parametrize("loc, want", [
    (("body", "max_tokens"), "max_tokens"),
    (("body", "prompt", "str"), "prompt"),
    (("body", "prompt", "list[int]", 1), "prompt[1]"),
    (("body", "messages", 0, "role"), "messages[0].role"),
    (("body",), None),
])
def test_field_path(loc, want):
    assert field_path(loc) == want


# ---- EngineHost in-process (TP=1: no Ray needed) ----


def checked(host: EngineHost, ids: list[int], params: DecodeConfig) -> RequestParams:
    """What the ingress hands the replica: the request checked against the limits the replica reports."""
    return validate_request(ids, params, DECODE, host.limits())[1]


async def _collect(host: EngineHost, ids: list[int], params: DecodeConfig, n: int | None = None,
                   per_block: bool = True, constraint=None) -> list:
    out = []
    async with aclosing(host.generate(ids, checked(host, ids, params), per_block=per_block,
                                      constraint=constraint)) as gen:
        async for d in gen:
            out.append(d)
            if n is not None and len(out) == n:
                break
    return out


def test_engine_host_matches_engine_and_aborts_on_early_exit(ckpt, tok):
    model, _ = load_checkpoint(ckpt)
    ids = tok.encode("12+7=")
    params = DECODE.model_copy(update={"max_new_tokens": 24})
    want = Engine(model, tok, DECODE, EngineConfig(max_batch_rows=2)).generate([ids], params)[0]
    host = EngineHost(ModelSpec(path=str(ckpt)), DECODE, EngineConfig(max_batch_rows=2))
    try:
        deltas = asyncio.run(_collect(host, ids, params))
        assert [t for d in deltas for t in d.new_token_ids] == want.token_ids
        assert deltas[-1].finished and deltas[-1].nfe == want.nfe and deltas[-1].finish_reason == want.finish_reason
        # per_block=False: the reader thread merges the blocks and hands over the whole generation once
        (whole,) = asyncio.run(_collect(host, ids, params, per_block=False))
        assert (whole.new_token_ids, whole.finished, whole.nfe) == (want.token_ids, True, want.nfe)
        # leaving after the first block aborts the request inside the engine and frees its slot
        asyncio.run(_collect(host, ids, DECODE.model_copy(update={"tau_m2t": 1.0}), n=1))
        for _ in range(200):
            if host.stats()["in_engine"] == 0 and host.stats()["free_slots"] == 2:
                break
            asyncio.run(asyncio.sleep(0.01))
        s = host.stats()
        assert (s["streams"], s["aborted"], s["in_engine"], s["free_slots"]) == (0, 1, 0, 2)
    finally:
        host.shutdown()


def test_engine_host_refuses_what_only_the_engine_checks_without_dying(ckpt, tok):
    """A checked request reaches the engine unchanged; what only the engine can check (a constraint against the
    model's vocabulary) is refused naming its field, and the request fails alone: the loop keeps serving."""
    from mbd.decoding.constraints import ConstraintSpec

    host = EngineHost(ModelSpec(path=str(ckpt)), DECODE, EngineConfig(max_batch_rows=2))
    try:
        with pytest.raises(ValueError, match="refused by the engine.*cannot be compiled") as e:
            asyncio.run(_collect(host, tok.encode("1+1="), DECODE,
                                 constraint=ConstraintSpec("grammar", "start: /[0-9/", "guided_grammar")))
        assert e.value.field == "guided_grammar"
        host.check()
        assert asyncio.run(_collect(host, tok.encode("1+1="), DECODE.model_copy(update={"max_new_tokens": 4})))
        assert host.stats()["streams"] == 0
    finally:
        host.shutdown()


class _Log(logging.Handler):
    """The engine host's log lines (Serve's logger does not propagate to pytest's capture)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> "_Log":
        logging.getLogger("ray.serve").addHandler(self)
        return self

    def __exit__(self, *_) -> None:
        logging.getLogger("ray.serve").removeHandler(self)


def _engine_pids() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children() if "actors.engine_process" in " ".join(p.cmdline())}


def test_a_killed_engine_process_is_restarted_and_every_stream_resumed(ckpt, tok):
    """SIGKILL the engine process with three requests in it (two batch rows): the stream that had produced output
    resumes on the new engine process from the tokens its client has, and its whole stream equals the
    uninterrupted run; the non-streaming one decoding beside it and the one waiting for a row complete with the
    tokens the engine gives them alone; the host stays healthy, logs the exit once, and serves new requests."""
    import os
    import signal

    model, _ = load_checkpoint(ckpt)
    long = DECODE.model_copy(update={"max_new_tokens": 600, "tau_m2t": 1.0, "ignore_eos": True})
    short = DECODE.model_copy(update={"max_new_tokens": 24})
    ids_a, ids_b, ids_c = tok.encode("1+1="), tok.encode("12+7="), tok.encode("3*4=")
    ref = Engine(model, tok, DECODE, EngineConfig(max_batch_rows=2))
    want_a, want_b, want_c = (ref.generate([ids], p)[0] for ids, p in ((ids_a, long), (ids_b, long), (ids_c, short)))
    host = EngineHost(ModelSpec(path=str(ckpt)), DECODE, EngineConfig(max_batch_rows=2),
                      EngineRestarts(limit=2, backoff_s=0.1))
    first_pid = host._proc.pid

    async def scenario() -> tuple[list, list, list]:
        async with aclosing(host.generate(ids_a, checked(host, ids_a, long))) as a:
            got_a = [await a.__anext__()]  # A streams
            b = asyncio.create_task(_collect(host, ids_b, long, per_block=False))  # decodes beside A, sends nothing
            c = asyncio.create_task(_collect(host, ids_c, short))  # waits for a row
            while (await asyncio.to_thread(host.stats)).get("in_engine") != 3:
                await asyncio.sleep(0.01)
            os.kill(first_pid, signal.SIGKILL)
            got_a += [o async for o in a]
            return got_a, await b, await c

    try:
        with _Log() as logged:
            got_a, got_b, got_c = asyncio.run(scenario())
        assert [t for o in got_a for t in o.new_token_ids] == want_a.token_ids
        assert got_a[-1].finish_reason == want_a.finish_reason and got_a[-1].nfe == want_a.nfe
        assert [t for o in got_b for t in o.new_token_ids] == want_b.token_ids and len(got_b) == 1
        assert [t for o in got_c for t in o.new_token_ids] == want_c.token_ids
        host.check()
        s = host.stats()
        assert (s["engine_restarts"], s["readmitted"], s["quarantined"]) == (1, 3, 0) and s["resumed"] >= 1
        assert host.engine_state() == "ok" and _engine_pids() == {host._proc.pid} != {first_pid}
        exits = [line for line in logged.lines if "exited (" in line]
        assert len(exits) == 1 and f"engine process {first_pid} exited (killed by SIGKILL" in exits[0]
        assert "not by itself): nobody convicted; 0 suspect group(s) to try; 3 request(s) kept" in exits[0]
        assert asyncio.run(_collect(host, tok.encode("5+5="), short))[-1].finished
    finally:
        host.shutdown()


def test_a_crash_loop_stops_and_fails_the_health_check(ckpt, tok, tmp_path):
    """An engine that cannot start again (its weights gone after the first start): restarted `limit` times with
    back-off, then the host gives up, says why in the log, fails a request that waited for it and fails its
    health check; no engine process is left."""
    import os
    import shutil
    import signal

    model_dir = shutil.copytree(ckpt, tmp_path / "ck")
    host = EngineHost(ModelSpec(path=str(model_dir)), DECODE, EngineConfig(max_batch_rows=2),
                      EngineRestarts(limit=2, backoff_s=0.1))
    (model_dir / "model.safetensors").unlink()

    async def waiting() -> None:
        while host.engine_state() == "ok":
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDead, match="gave up"):  # it arrived while the engine restarts, and waited
            await _collect(host, tok.encode("1+1="), DECODE)

    try:
        with _Log() as logged:
            os.kill(host._proc.pid, signal.SIGKILL)
            asyncio.run(waiting())
        assert host.engine_state() == "failed"
        with pytest.raises(EngineDead, match="exited 3 times within 60 s"):
            host.check()
        assert sum(line.startswith("engine process restart failed") for line in logged.lines) == 2
        assert sum("giving up" in line and "no *.safetensors" in line for line in logged.lines) == 1
        assert host.stats()["engine_restarts"] == 0 and _engine_pids() == set()
    finally:
        host.shutdown()


def test_engine_process_ends_with_its_replica(ckpt, tok):
    """The engine process never outlives the replica process that started it (killed, it cannot say stop)."""
    import subprocess
    import sys
    import textwrap

    import psutil

    script = textwrap.dedent(f"""
        from actors.engine_host import EngineHost
        from mbd.decoding.model_spec import ModelSpec
        from mbd.config import EngineConfig
        from tests.integration.test_serve_units import DECODE
        host = EngineHost(ModelSpec(path={str(ckpt)!r}), DECODE, EngineConfig(max_batch_rows=2))
        print(host._proc.pid, flush=True)
        import time; time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    engine = psutil.Process(int(parent.stdout.readline()))
    assert engine.is_running() and engine.ppid() == parent.pid
    parent.kill()
    parent.wait()
    engine.wait(timeout=30)  # psutil.TimeoutExpired if it stayed


# ---- request fields that reach the engine ----


def test_sampler_top_k_top_p_restrict_the_distribution():
    """top_k keeps the k most likely tokens; top_p then keeps the smallest prefix (by probability) whose mass
    reaches top_p; the rest is renormalised. Reference written out by hand for one row."""
    from mbd.decoding.policy import Sampler

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]])
    gen = torch.Generator().manual_seed(0)
    p = logits.softmax(-1)[0]
    order = [4, 0, 1, 2, 3]  # descending probability
    for top_k, top_p in [(0, 1.0), (2, 1.0), (0, 0.7), (3, 0.95), (1, 0.5)]:
        keep = order[:top_k] if top_k else order
        q = torch.zeros(5)
        q[keep] = p[keep] / p[keep].sum()
        mass, kept = 0.0, []
        for i in keep:
            if mass >= top_p:
                break
            kept.append(i)
            mass += float(q[i])
        want = torch.zeros(5)
        want[kept] = q[kept] / q[kept].sum()
        got = Sampler(0, 1.0, gen, top_p, top_k).probs(logits)[0]
        assert torch.allclose(got, want, atol=1e-6), (top_k, top_p, got, want)


def test_ignore_eos_decodes_past_eos(tmp_path):
    """On a model that always predicts EOS: without ignore_eos nothing is generated; with it, max_new_tokens
    tokens (all EOS, invisible in the text) and finish_reason 'length'."""
    ck = make_checkpoint(tmp_path / "eos")
    model, cfg = load_checkpoint(ck)
    eos = torch.tensor([cfg.eos_token_id])
    model.lm_head.register_forward_hook(lambda _m, _i, out: out.index_fill(-1, eos, 1e4))
    engine = Engine(model, Tokenizer.from_dir(ck, cfg), DECODE, EngineConfig(max_batch_rows=2))
    ids = engine.tokenizer.encode("1+1=")
    plain = engine.generate([ids], {"max_new_tokens": 12})[0]
    forced = engine.generate([ids], {"max_new_tokens": 12, "ignore_eos": True})[0]
    assert (plain.token_ids, plain.finish_reason) == ([], "eos")
    assert forced.token_ids == [cfg.eos_token_id] * 12 and forced.finish_reason == "length" and forced.text == ""


# ---- structured output and cached tokens, without Ray ----


def test_request_constraints_name_their_fields(ckpt, tok):
    """Which request field a constraint came from (the ingress), and refusals that name it (and the schema
    feature): two constraints at once by the ingress, what the vocabulary cannot honour by the engine's check,
    which compiles it."""
    from mbd.decoding.constraints import ConstraintError
    from serve_app.config import ServeConfig
    from serve_app.convert import RequestConverter
    from serve_app.protocol import APIError, ChatCompletionRequest, CompletionRequest

    cfg = ServeConfig.model_validate({"model": {"path": str(ckpt), "name": "m"}, "decode": DECODE.model_dump()})
    conv = RequestConverter(cfg, tok)
    engine = Engine(load_checkpoint(ckpt)[0], tok, DECODE, EngineConfig(max_batch_rows=2))
    base = {"model": "m", "prompt": "1+1="}
    spec = conv.constraint(CompletionRequest.model_validate(base | {"structured_outputs": {"regex": "[0-9]+"}}))
    assert (spec.kind, spec.text, spec.field) == ("regex", "[0-9]+", "structured_outputs.regex")
    spec = conv.constraint(ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "guided_choice": ["a", "b"]}))
    assert (spec.kind, spec.field) == ("choice", "guided_choice")
    assert conv.constraint(CompletionRequest.model_validate(base | {"response_format": {"type": "text"}})) is None
    cases = [
        ({"response_format": {"type": "json_object"}}, "response_format", "vocabulary cannot express"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
            "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema", "uniqueItems"),
        ({"guided_regex": "a", "structured_outputs": {"choice": ["a"]}}, "guided_regex", "send one"),
        ({"guided_grammar": "start: /[0-9/"}, "guided_grammar", "cannot be compiled"),
    ]
    for extra, param, words in cases:
        with pytest.raises((APIError, ConstraintError)) as e:
            spec = conv.constraint(CompletionRequest.model_validate(base | extra))
            engine.check_request(tok.encode("1+1="), None, spec)
        field, message = (e.value.param, e.value.message) if isinstance(e.value, APIError) else \
            (e.value.field, str(e.value))
        assert field == param and words in message, (extra, message)


def test_engine_host_constrains_and_reports_cached_tokens(ckpt, tok):
    """A constraint travels with its request to the engine process; a repeated prompt reports its cached
    tokens (whole 16-token pages of its block-aligned part)."""
    import re

    from mbd.decoding.constraints import ConstraintSpec

    host = EngineHost(ModelSpec(path=str(ckpt)), DECODE, EngineConfig(max_batch_rows=2))
    try:
        ids = tok.encode("7*8+9*6-4;" * 4)  # 40 tokens: two full pages
        params = DECODE.model_copy(update={"max_new_tokens": 24})
        spec = ConstraintSpec("regex", "[0-9]{2,5}=[a-z]{3}", "regex")
        first = asyncio.run(_collect(host, ids, params, constraint=spec))
        text = tok.decode([t for d in first for t in d.new_token_ids])
        assert re.fullmatch("[0-9]{2,5}=[a-z]{3}", text) and first[-1].finish_reason == "eos"
        assert first[-1].cached_tokens == 0
        again = asyncio.run(_collect(host, ids, params))
        assert again[-1].cached_tokens == 32
        with pytest.raises(ValueError, match="refused.*uniqueItems"):  # compiled, and refused, by the engine
            asyncio.run(_collect(host, ids, params, constraint=ConstraintSpec.json_schema(
                {"type": "array", "uniqueItems": True})))
        assert asyncio.run(_collect(host, ids, params))[-1].finished  # and it goes on serving
    finally:
        host.shutdown()


def test_engine_host_streams_provisional_blocks(ckpt, tok):
    """provisional=True: deltas also carry the not-yet-final blocks (masks included, at most one block each),
    and the committed tokens are those of a request without it."""
    host = EngineHost(ModelSpec(path=str(ckpt)), DECODE, EngineConfig(max_batch_rows=2))
    try:
        ids = tok.encode("12+7=")
        params = DECODE.model_copy(update={"max_new_tokens": 24})
        plain = asyncio.run(_collect(host, ids, params))
        prov = asyncio.run(_collect(host, ids, params.model_copy(update={"provisional": True})))
        assert [t for d in prov for t in d.new_token_ids] == [t for d in plain for t in d.new_token_ids]
        blocks = [b for d in prov if d.provisional for b in d.provisional]
        mask = special_token_ids()["mask_token_id"]
        assert blocks and all(len(b) <= 4 for b in blocks) and any(mask in b for b in blocks)
        assert all(d.provisional is None for d in plain)
    finally:
        host.shutdown()
