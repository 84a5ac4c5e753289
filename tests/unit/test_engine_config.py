"""One EngineConfig for every engine knob: shipped YAMLs carry an `engine:` section, `--set engine.x=...` reaches
it through the one config loader, the knobs reach the parts of the engine they configure, and the one request
check names the field it refuses."""

from pathlib import Path

import pytest
import torch

from mbd.config import ConfigError, DecodeConfig, EngineConfig, load_decode, validate
from mbd.decoding import Engine, RequestError, validate_request
from mbd.eval.sweep import SweepConfig
from mbd.model import KVCache, build_model
from serve_app.config import ServeConfig, load_serve_config
from tests.conftest import tiny_cfg

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
YAMLS = sorted((CONFIGS / "decode").glob("*.yaml")) + sorted((CONFIGS / "eval").glob("*.yaml")) + \
    sorted((CONFIGS / "serve").glob("*.yaml"))


def engine_section(path: Path) -> EngineConfig:
    """The validated `engine:` section of a shipped decode, eval or serve YAML (which must have one)."""
    if path.parent.name == "decode":
        return load_decode(path)[1]
    if path.parent.name == "eval":
        from mbd.config import read_yaml

        return validate(SweepConfig, read_yaml(path), str(path)).engine
    return load_serve_config(path).engine


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_decode_eval_and_serve_yaml_has_an_engine_section(path):
    assert "\nengine:" in path.read_text()
    assert isinstance(engine_section(path), EngineConfig)


def test_every_knob_is_set_in_some_shipped_config():
    import yaml

    set_somewhere: set[str] = set()
    for path in YAMLS:
        set_somewhere |= set(yaml.safe_load(path.read_text())["engine"])
    assert set(EngineConfig.model_fields) - set_somewhere == {"trace"}  # trace: `mbd generate --trace`, sweeps
    gpu = load_serve_config(CONFIGS / "serve" / "llada2-mini-tp2.yaml").engine
    assert (gpu.device, gpu.dtype, gpu.attention, gpu.cuda_graphs) == ("cuda", "bfloat16", "flex", "auto")


def test_sets_reach_the_engine_section(tmp_path):
    decode, engine = load_decode(CONFIGS / "decode" / "tiny_multibd.yaml",
                                 ["engine.attention=flex", "engine.batch_buckets=[2, 8]", "tau_add=0.25"])
    assert (engine.attention, engine.batch_buckets, decode.tau_add) == ("flex", [2, 8], 0.25)
    serve = load_serve_config(CONFIGS / "serve" / "tiny.yaml", ["engine.attention=flex", "engine.compile=off"])
    assert (serve.engine.attention, serve.engine.compile) == ("flex", "off")
    with pytest.raises(ConfigError, match="engine.*field 'attention'"):
        load_decode(CONFIGS / "decode" / "tiny_multibd.yaml", ["engine.attention=paged"])
    nested = tmp_path / "d.yaml"
    nested.write_text("decode: {buffer_size: 2, tau_add: 0.1}\nengine: {max_batch_rows: 3, batch_buckets: [3]}\n")
    decode, engine = load_decode(nested)
    assert (decode.buffer_size, engine.max_batch_rows) == (2, 3)


@pytest.mark.parametrize("bad, match", [
    (dict(max_batch_rows=4, batch_buckets=[1, 2]), "include max_batch_rows"),
    (dict(max_batch_rows=4, batch_buckets=[4, 8]), r"lie in \[1, max_batch_rows=4\]"),
    (dict(kv_cache_bytes=1 << 20, kv_cache_fraction=0.5), "not both"),
    (dict(device="cpu", cuda_graphs="on"), "cuda_graphs: on needs device cuda"),
    (dict(attention="sdpa", compile="default"), "need attention: flex"),
    (dict(compile="fast"), "field 'compile'"),
    (dict(max_batch_slots=4), "field 'max_batch_slots'.*Extra inputs"),
])
def test_bad_engine_configs_name_the_field(bad, match):
    with pytest.raises(ConfigError, match=match):
        validate(EngineConfig, bad, "engine")


def test_serve_config_checks_the_device_against_the_replica_resources():
    with pytest.raises(Exception, match="num_gpus_per_rank"):
        ServeConfig.model_validate({"model": {"path": "x"}, "engine": {"device": "cuda"}})


def test_knobs_reach_the_engine():
    model = build_model(tiny_cfg("sdar"), seed=0).eval()
    dc = DecodeConfig(buffer_size=2, tau_add=0.5, max_length=96, max_new_tokens=12, tau_m2t=0.2)
    page_bytes = KVCache.page_bytes(model.cfg, 8, torch.float32)
    eng = Engine(model, None, dc, EngineConfig(
        max_batch_rows=3, batch_buckets=[3], attention="flex", compile="off", prefill_budget=9, prefill_chunk=8,
        page_size=8, kv_cache_bytes=40 * page_bytes, prefix_caching=False, trace=True, cuda_graphs="off"))
    assert (eng.runner.attention, eng.runner.compiled) == ("flex", None)
    assert (eng.scheduler.buckets, eng.scheduler.prefill_budget, eng.runner.prefill_chunk) == ((3,), 8, 8)
    assert (eng.runner.cache.page_size, eng.runner.cache.num_pages, eng.kv.prefix_caching) == (8, 40, False)
    res = eng.generate([list(range(3, 20)), [5, 6]])
    assert {b for b, _, _ in eng.runner.shapes} == {3} and all(r.trace for r in res)
    half = Engine(build_model(tiny_cfg("sdar"), seed=0), None, dc, EngineConfig(dtype="bfloat16", device="cpu"))
    assert next(half.model.parameters()).dtype == torch.bfloat16 and half.runner.cache.k.dtype == torch.bfloat16


def test_build_engine_sets_threads_and_loads_in_the_configured_dtype():
    from mbd.decoding import build_engine

    before = torch.get_num_threads()
    try:
        eng = build_engine("mbd/assets/tiny", DecodeConfig(max_length=64, max_new_tokens=4),
                           EngineConfig(device="cpu", dtype="float32", threads=1, max_batch_rows=2))
        assert torch.get_num_threads() == 1 and eng.engine_cfg.device == "cpu"
        assert next(eng.model.parameters()).dtype == torch.float32
    finally:
        torch.set_num_threads(before)


def test_the_one_request_check_names_the_field():
    model = build_model(tiny_cfg("sdar"), seed=0).eval()
    dc = DecodeConfig(buffer_size=2, tau_add=0.5, max_length=64, max_new_tokens=16)
    eng = Engine(model, None, dc, EngineConfig(max_batch_rows=1))
    api = {"prompt_ids": "prompt", "max_new_tokens": "max_tokens"}  # how an HTTP API names them
    cases = [([], None, "prompt"), ([1, model.cfg.mask_token_id], None, "prompt"), ([1, 10**6], None, "prompt"),
             ([1, 2], {"buffer_size": 3}, "buffer_size"), ([1, 2], {"max_new_tokens": 0}, "max_tokens"),
             ([1, 2], {"tau_m2t": 2.0}, "tau_m2t"), ([3] * 64, None, "prompt")]
    for ids, params, field in cases:
        with pytest.raises(RequestError) as e:
            validate_request(ids, params, dc, eng.limits, api)
        assert e.value.field == field and field in str(e.value), (ids, params, str(e.value))
    with pytest.raises(RequestError, match="prompt_ids is empty"):  # the engine's own names by default
        eng.check_request([])
    ids, p = eng.check_request([1, 2, 3], {"max_new_tokens": 5})
    assert ids == [1, 2, 3] and p.gen_end == 8


def test_compiled_flex_refuses_float64_weights():
    """Inductor's CPU FlexAttention takes float32 / bfloat16 / float16 only: refused at construction, not at the
    first forward."""
    model = build_model(tiny_cfg("sdar"), seed=0).double()
    with pytest.raises(ConfigError, match="float64"):
        Engine(model, None, DecodeConfig(), EngineConfig(attention="flex", compile="default"))
    Engine(model, None, DecodeConfig(), EngineConfig(attention="flex", compile="off"))


@pytest.mark.parametrize("name, graphs", [("sdar-8b-tp2", 48), ("llada2-mini-tp2", 24)])
def test_paper_serve_configs_capture_few_graphs(name, graphs):
    """A graph is keyed by (batch bucket, slots, logits window of all slots or none): no key span, no home flag,
    so SDAR-8B's serve config (6 buckets, N_buf 4) captures 48 graphs and compiles 24 layer shapes, LLaDA2-Mini's
    (N_buf 2) 24 and 12 (for each of its two layer kinds); the memory plan counts the same graphs, all captured
    at start-up."""
    from mbd.decoding.compiled import decode_mode, decode_shapes
    from mbd.decoding.scheduler import power_of_two_buckets
    from mbd.plan import H100_80GB, serve_plan
    from mbd.plan_check import model_config, serve_shape

    serve = load_serve_config(CONFIGS / "serve" / f"{name}.yaml")
    engine, decode = serve.engine, serve.decode
    shapes = decode_shapes(engine.batch_buckets or power_of_two_buckets(engine.max_batch_rows), decode.buffer_size)
    assert len(shapes) == graphs <= 64 and len({(b, s) for b, s, _ in shapes}) == graphs // 2
    assert decode_mode(engine, torch.device("cuda")) == ("flex", "default", True)
    mcfg, _ = model_config(serve.model.path)
    plan = serve_plan(mcfg, decode, serve_shape(engine, serve.model.tensor_parallel_size), H100_80GB)
    note = next(i.note for i in plan.items if i.name == "CUDA-Graph pools")
    assert note.startswith(f"{graphs} graphs") and plan.fits


def test_auto_attention_honours_a_compile_mode_or_graphs_asked_for_on_any_device():
    """Only flex compiles and captures: `attention: auto` with `compile` or `cuda_graphs` set by name resolves to
    flex on CPU too (it was sdpa there, which ran eager and ignored them); auto everywhere stays eager sdpa on CPU."""
    from mbd.decoding.compiled import decode_mode

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert decode_mode(EngineConfig(), cpu) == ("sdpa", "off", False)
    assert decode_mode(EngineConfig(compile="off"), cpu) == ("sdpa", "off", False)
    assert decode_mode(EngineConfig(compile="default"), cpu) == ("flex", "default", False)
    assert decode_mode(EngineConfig(compile="max-autotune"), cpu) == ("flex", "max-autotune", False)
    assert decode_mode(EngineConfig(cuda_graphs="on"), cuda) == ("flex", "default", True)
    assert decode_mode(EngineConfig(compile="off", cuda_graphs="on"), cuda) == ("flex", "off", True)


def test_max_autotune_leaves_graph_capture_to_the_engine():
    """The engine captures each step as one CUDA Graph; inductor's own graph trees inside that capture would
    record every layer call. max-autotune therefore compiles with autotuned GEMMs and without them."""
    from torch._inductor import list_mode_options

    from mbd.decoding.compiled import INDUCTOR_MODES

    options = list_mode_options(INDUCTOR_MODES["max-autotune"])
    assert options["max_autotune"] is True and not options.get("triton.cudagraphs")
    assert INDUCTOR_MODES["default"] is None  # torch.compile's default: no inductor graphs either
