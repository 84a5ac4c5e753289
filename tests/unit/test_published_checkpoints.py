"""Every published seed checkpoint format loads from its own files (tests/fixtures/published/*: fetched byte for
byte where a repository holds them, else transcribed, as each SOURCE.md says), refuses what this code cannot honour
by name, accepts the keys that only choose a kernel, a parallel layout, a training switch or a cache, and
round-trips through `to_hf`.

Tiny checkpoints in the published layout: the fixture's config.json with its shapes shrunk (every other key kept),
random weights written under the checkpoint's own tensor names."""

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mbd.checkpoint_files import read_model_config
from mbd.config import REPO_ROOT, ConfigError, DecodeConfig, EngineConfig, ModelConfig
from mbd.decoding import Engine
from mbd.hf_keys import IGNORED, IGNORED_VALUES, PINNED, READ
from mbd.model import CheckpointError, build_model, load_checkpoint
from mbd.model.attention import Masked
from mbd.model.checkpoint import checkpoint_state
from mbd.model.masks import block_causal_dense

FIXTURES = REPO_ROOT / "tests" / "fixtures" / "published"
LLADA2 = ("LLaDA2.0-mini", "LLaDA2.1-mini", "LLaDA2-mini-DMax", "LLaDA2-mini-CAP")
# (family, eos ids, mask, pad, block size, stated) as docs/models.md documents them and the fixtures state them
EXPECTED = {name: ("llada2_moe", [156892], 156895, 156892, 32, False) for name in LLADA2} | {
    "SDAR-8B-Chat": ("sdar", [151645, 151643], 151669, 151643, 4, True),
    "SDAR-8B-Chat-b32": ("sdar", [151645, 151643], 151669, 151643, 32, True),
}
SHRINK = {
    "llada2_moe": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8, rotary_dim=4, moe_intermediate_size=8,
                       moe_shared_expert_intermediate_size=8, num_experts=8, num_experts_per_tok=2, n_group=4,
                       topk_group=2, max_position_embeddings=256),
    "sdar": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8, max_window_layers=2, max_position_embeddings=256),
}
FETCHED = {"SDAR-8B-Chat"}  # the fixture folders whose files are the published bytes (the others: transcribed)
# the authors' launcher and kernel keys that SDAR-8B-Chat's published config.json carries
LAUNCHER = {"attn_implementation", "ep_size", "use_deepep", "fuse_cross_entropy", "micro_forward", "skip_checkpoint",
            "use_cache", "debug"}
DROP = object()


def published(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def changed(hf: dict, **changes) -> dict:
    out = dict(hf) | {k: v for k, v in changes.items() if v is not DROP}
    return {k: v for k, v in out.items() if changes.get(k) is not DROP}


def tiny_published(name: str, d: Path, **changes) -> tuple[Path, torch.nn.Module]:
    """A tiny checkpoint of `name`'s format in `d`: its files, its config shrunk, random weights (expert biases
    too) under the published tensor names."""
    shutil.copytree(FIXTURES / name, d)
    hf = published(name)
    (d / "config.json").write_text(json.dumps(changed(hf, **SHRINK[EXPECTED[name][0]] | changes)))
    cfg = read_model_config(d)
    model = build_model(cfg, seed=1).eval()
    for m in model.modules():
        if hasattr(m, "expert_bias"):
            m.expert_bias.copy_(torch.randn(cfg.num_experts) * 0.1)
    save_file(checkpoint_state(model), str(d / "model.safetensors"), metadata={"format": "pt"})
    return d, model


def logits(model, ids, block):
    pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    full = torch.full((ids.shape[0],), ids.shape[1])
    with torch.no_grad():
        return model(ids, pos, Masked(block_causal_dense(pos, ids.shape[1], full, block)))


@pytest.mark.parametrize("name", EXPECTED)
def test_published_config_reads_as_documented(name):
    cfg = read_model_config(FIXTURES / name)
    got = (cfg.family, cfg.eos_token_ids, cfg.mask_token_id, cfg.pad_token_id, cfg.block_size, cfg.block_size_stated)
    assert got == EXPECTED[name]
    assert cfg.eos_token_id == EXPECTED[name][1][0]


def test_every_fixture_folder_is_loaded():
    assert {d.name for d in FIXTURES.iterdir() if d.is_dir()} == set(EXPECTED)


SOURCE_ROW = re.compile(r"^\| (?P<file>[^|]+?) \| (?P<status>fetched|transcribed) \| (?P<repo>[^|]+?) \| "
                        r"(?P<commit>[^|]+?) \| (?P<path>[^|]+?) \| (?P<blob>[^|]+?) \|$", re.M)


def git_blob(data: bytes) -> str:
    """The git blob id of `data` (what `git hash-object` prints): SOURCE.md's check that a file is the bytes
    published at the repository, commit and path it names, without fetching anything."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.mark.parametrize("name", EXPECTED)
def test_source_md_names_every_file_and_fetched_files_are_the_published_bytes(name):
    d = FIXTURES / name
    rows = {m["file"]: m for m in SOURCE_ROW.finditer((d / "SOURCE.md").read_text())}
    assert set(rows) == {f.name for f in d.iterdir()} - {"SOURCE.md"}
    for f, row in rows.items():
        assert row["status"] == ("fetched" if name in FETCHED else "transcribed")
        if row["status"] == "fetched":
            assert re.fullmatch(r"[\w.-]+/[\w.-]+", row["repo"]) and re.fullmatch(r"[0-9a-f]{40}", row["commit"])
            assert git_blob((d / f).read_bytes()) == row["blob"], f"{name}/{f} is not the published bytes"


def test_the_authors_launcher_and_kernel_keys_are_accepted_and_change_nothing():
    """SDAR-8B-Chat's published config.json names the attention kernel, the expert-parallel layout and training
    switches: accepted, and the model is the one without them, whatever their values."""
    hf = published("SDAR-8B-Chat")
    assert LAUNCHER <= set(hf) and LAUNCHER <= set(IGNORED)
    flipped = hf | {"attn_implementation": "sdpa", "ep_size": 8, "use_deepep": True, "fuse_cross_entropy": False,
                    "micro_forward": True, "skip_checkpoint": True, "use_cache": True, "debug": True}
    bare = {k: v for k, v in hf.items() if k not in LAUNCHER}
    assert ModelConfig.from_hf(hf) == ModelConfig.from_hf(flipped) == ModelConfig.from_hf(bare)


def test_each_key_is_in_one_class_and_each_ignored_key_says_why():
    kinds = {"kernel", "parallel", "training", "cache", "output", "bookkeeping"}
    for key, (kind, why) in IGNORED.items():
        assert kind in kinds and why.strip() and "\n" not in why, key
        for family in READ:
            assert key not in READ[family] and key not in PINNED[family], key
    assert set(IGNORED_VALUES) <= set(IGNORED)


def test_docs_list_every_ignored_key_with_its_kind():
    """docs/models.md's table of accepted-and-ignored keys is the list in mbd.hf_keys, kind for kind."""
    text = (REPO_ROOT / "docs" / "models.md").read_text()
    section = text.split("### Accepted and ignored config.json keys", 1)[1].split("\n#", 1)[0]
    assert dict(re.findall(r"^\| `(\w+)` \| (\w+) \|", section, re.M)) == {k: v.kind for k, v in IGNORED.items()}


@pytest.mark.parametrize("name", EXPECTED)
def test_an_unknown_key_that_changes_the_arithmetic_is_still_refused_by_name(name):
    """Next to the accepted launcher keys, a key this code does not know (Gemma 2's logit soft-capping here) is
    refused with its name and value, never ignored."""
    with pytest.raises(ConfigError, match=r"attn_logit_softcapping=30\.0 is not read by this code"):
        ModelConfig.from_hf(published(name) | {"attn_logit_softcapping": 30.0})


@pytest.mark.parametrize("name", EXPECTED)
def test_tiny_published_checkpoint_loads_decodes_and_trains_with_its_block(name, tmp_path):
    d, model = tiny_published(name, tmp_path / name)
    loaded, cfg = load_checkpoint(d)
    ids = torch.randint(0, 1000, (2, 2 * cfg.block_size))
    assert torch.equal(logits(loaded, ids, cfg.block_size), logits(model, ids, cfg.block_size))
    assert Engine(loaded, None, DecodeConfig(), EngineConfig(device="cpu")).block == EXPECTED[name][4]
    if cfg.block_size_stated:
        assert cfg.training_block_size() == EXPECTED[name][4]
    else:
        with pytest.raises(ConfigError, match="states no block_size.*training"):
            cfg.training_block_size()


@pytest.mark.parametrize("name", ["SDAR-8B-Chat", "SDAR-8B-Chat-b32"])
def test_tiny_published_sdar_equals_qwen3(name, tmp_path):
    """Causal (block 1) logits equal transformers' Qwen3 on the same files' weights. The reference runs eager
    attention whatever kernel the file names (SDAR-8B-Chat's `attn_implementation: flex_attention` is a kernel
    choice, and compiling FlexAttention on CPU takes a minute)."""
    transformers = pytest.importorskip("transformers")
    d, _ = tiny_published(name, tmp_path / name)
    hf = json.loads((d / "config.json").read_text())
    ref_cfg = transformers.Qwen3Config(**{k: v for k, v in hf.items() if k not in ("architectures", "auto_map",
                                                                                     "model_type")}
                                       | {"attn_implementation": "eager"})
    ref = transformers.Qwen3ForCausalLM(ref_cfg).eval()
    missing = ref.load_state_dict(load_file(d / "model.safetensors"), strict=False)
    assert not missing.unexpected_keys and not missing.missing_keys
    loaded, _ = load_checkpoint(d)
    ids = torch.randint(0, 1000, (2, 9))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
    assert (logits(loaded, ids, 1) - want).abs().max().item() < 1e-4


REFUSED = [
    ("llada2_moe", "use_bias", True), ("llada2_moe", "use_qk_norm", False), ("llada2_moe", "score_function", "softmax"),
    ("llada2_moe", "rope_scaling", {"type": "linear", "factor": 2.0}), ("llada2_moe", "router_dtype", "bf16"),
    ("llada2_moe", "norm_head", True), ("llada2_moe", "embedding_dropout", 0.1),
    ("llada2_moe", "moe_router_enable_expert_bias", False), ("llada2_moe", "moe_shared_expert_intermediate_size", 1024),
    ("llada2_moe", "rotary_dim", 128), ("llada2_moe", "num_nextn_predict_layers", 1), ("llada2_moe", "new_knob", 1),
    ("sdar", "hidden_act", "gelu"), ("sdar", "use_sliding_window", True), ("sdar", "rope_scaling", {"factor": 4.0}),
    ("sdar", "layer_types", ["sliding_attention"] * 36), ("sdar", "use_qk_norm", False),
    # unknown keys that would change the arithmetic, and accepted keys at a value whose meaning is not known
    ("sdar", "attn_logit_softcapping", 30.0), ("llada2_moe", "router_aux_loss_coef", 0.001),
    ("sdar", "attn_implementation", "my_sliding_attention"), ("sdar", "ep_size", 0),
    ("llada2_moe", "use_deepep", "auto"),
]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """One tiny checkpoint per family in the published layout, shared by the refusal cases."""
    root = tmp_path_factory.mktemp("published")
    return {fam: tiny_published(name, root / name)[0]
            for fam, name in (("llada2_moe", "LLaDA2.0-mini"), ("sdar", "SDAR-8B-Chat"))}


@pytest.mark.parametrize("family,key,value", REFUSED)
def test_settings_that_change_the_computation_are_refused_by_name(family, key, value, tiny_dirs, tmp_path):
    """The tiny checkpoint with one setting changed: the load fails naming the key and its value."""
    src = tiny_dirs[family]
    for f in src.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(json.loads((src / "config.json").read_text()) | {key: value}))
    with pytest.raises(CheckpointError, match=f"{key}={value!r}".replace("[", r"\[").replace("(", r"\(")):
        load_checkpoint(tmp_path)
    load_checkpoint(src)  # unchanged, it loads


@pytest.mark.parametrize("key,default", [("use_bias", True), ("embedding_dropout", 0.1), ("attention_dropout", 0.1),
                                         ("output_dropout", 0.1)])
def test_an_absent_pinned_key_takes_the_reference_default_and_is_refused(key, default):
    with pytest.raises(ConfigError, match=f"states no '{key}'.*{key}={default!r}"):
        ModelConfig.from_hf(changed(published("LLaDA2.0-mini"), **{key: DROP}))


def test_an_absent_read_key_takes_the_reference_classs_default_not_ours():
    """LLaDA2MoeConfig's defaults (partial RoPE 0.5, eps 1e-5, 16,384 positions) and the authors' SDARConfig's
    (32,768 positions), not ModelConfig's (1.0, 1e-6, 4,096)."""
    hf = changed(published("LLaDA2.0-mini"), partial_rotary_factor=DROP, rms_norm_eps=DROP,
                 max_position_embeddings=DROP)
    hf.pop("rotary_dim", None)
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.partial_rotary_factor, cfg.rms_norm_eps, cfg.max_position_embeddings) == (0.5, 1e-5, 16384)
    assert ModelConfig.from_hf(changed(published("SDAR-8B-Chat"), max_position_embeddings=DROP)) \
        .max_position_embeddings == 32768


def test_rope_parameters_and_dtype_of_newer_transformers():
    """transformers >= 5 writes `dtype` and `rope_parameters`: the same model; a RoPE type other than the
    default, or two dtypes that disagree, is refused."""
    hf = published("SDAR-8B-Chat")
    want = ModelConfig.from_hf(hf)
    newer = changed(hf, torch_dtype=DROP, rope_theta=DROP, dtype="bfloat16",
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000})
    assert ModelConfig.from_hf(newer) == want
    with pytest.raises(ConfigError, match="rope_parameters=.*yarn"):
        ModelConfig.from_hf(changed(newer, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4}))
    with pytest.raises(ConfigError, match="torch_dtype='bfloat16' and dtype='float16'"):
        ModelConfig.from_hf(changed(hf, dtype="float16"))


def test_the_issue_directory_is_refused(tmp_path):
    """use_bias true, use_qk_norm false and an extra bias tensor: refused, not decoded wrongly; an extra tensor
    alone is refused by name, and a tensor present under both of its names as well."""
    d, _ = tiny_published("LLaDA2.0-mini", tmp_path / "a")
    sd = load_file(d / "model.safetensors")
    save_file(sd | {"model.layers.0.attention.dense.bias": torch.zeros(16)}, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"does not describe: \['model.layers.0.attention.dense.bias'\]"):
        load_checkpoint(d)
    hf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(hf | {"use_bias": True, "use_qk_norm": False}))
    with pytest.raises(CheckpointError, match="use_bias=True is not supported"):
        load_checkpoint(d)
    (d / "config.json").write_text(json.dumps(hf))
    bias = "model.layers.1.mlp.gate.expert_bias"
    save_file(sd | {bias.replace("expert_bias", "e_score_correction_bias"): sd[bias].clone()}, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="same parameter"):
        load_checkpoint(d)


def test_router_dtype_fp32_keeps_the_expert_bias_in_float32(tmp_path):
    d, model = tiny_published("LLaDA2.0-mini", tmp_path / "a")
    stored = load_file(d / "model.safetensors")["model.layers.1.mlp.gate.expert_bias"]
    loaded, _ = load_checkpoint(d, dtype=torch.bfloat16)
    gate = loaded.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.bfloat16 and stored.dtype == torch.float32
    assert gate.expert_bias.dtype == torch.float32 and torch.equal(gate.expert_bias, stored)
    loaded.to(torch.float16)
    assert gate.expert_bias.dtype == torch.float32 and torch.equal(gate.expert_bias, stored)
    assert gate.weight.dtype == torch.float16


def test_a_near_tie_is_routed_by_the_fp32_bias(tmp_path):
    """Equal scores (a zero router), biases 1, 1, 1 + 2^-11, 1 + 2^-10 on experts 0-3: in float32 experts 3 and 2
    win; rounded to bfloat16 all four would tie at 1.0."""
    d, _ = tiny_published("LLaDA2.0-mini", tmp_path / "a")
    sd = load_file(d / "model.safetensors")
    gate = "model.layers.1.mlp.gate"
    bias = torch.tensor([1.0, 1.0, 1 + 2 ** -11, 1 + 2 ** -10, 0, 0, 0, 0])
    assert torch.equal(bias.bfloat16()[:4].float(), torch.ones(4))
    sd |= {f"{gate}.expert_bias": bias, f"{gate}.weight": torch.zeros_like(sd[f"{gate}.weight"])}
    save_file(sd, str(d / "model.safetensors"))
    loaded, _ = load_checkpoint(d, dtype=torch.bfloat16)
    idx, _ = loaded.model.layers[1].mlp.gate(torch.randn(5, 16).bfloat16())
    assert sorted(map(sorted, idx.tolist())) == [[2, 3]] * 5


def eos_dir(tmp_path, **files) -> Path:
    """A LLaDA2.0-mini config.json with the other files given (name -> JSON)."""
    d = tmp_path / "eos"
    d.mkdir(parents=True)
    shutil.copy(FIXTURES / "LLaDA2.0-mini" / "config.json", d / "config.json")
    for name, data in files.items():
        (d / f"{name}.json").write_text(json.dumps(data))
    return d


def test_eos_precedence_generation_config_then_config_then_tokenizer_then_family(tmp_path):
    tok = {"eos_token": "<|role_end|>", "added_tokens_decoder": {"156900": {"content": "<|role_end|>"}}}
    assert read_model_config(eos_dir(tmp_path / "0")).eos_token_ids == [156892]  # the family's documented EOS
    assert read_model_config(eos_dir(tmp_path / "1", tokenizer_config=tok)).eos_token_ids == [156900]
    d = eos_dir(tmp_path / "2", tokenizer_config=tok)
    (d / "config.json").write_text(json.dumps(published("LLaDA2.0-mini") | {"eos_token_id": 156893}))
    assert read_model_config(d).eos_token_ids == [156893]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [156894, 156892]}))
    cfg = read_model_config(d)
    assert (cfg.eos_token_id, cfg.eos_token_ids) == (156894, [156894, 156892])
    bad = eos_dir(tmp_path / "3", tokenizer_config={"eos_token": "<|nope|>"})
    with pytest.raises(ConfigError, match="eos_token '<\\|nope\\|>' is not a token"):
        read_model_config(bad)


def test_sdar_without_a_block_size_is_refused():
    with pytest.raises(ConfigError, match="states no block_size"):
        ModelConfig.from_hf(changed(published("SDAR-8B-Chat"), block_size=DROP))


@pytest.mark.parametrize("name", ["LLaDA2.0-mini", "SDAR-8B-Chat-b32"])
def test_to_hf_states_every_pinned_setting_and_round_trips(name):
    cfg = read_model_config(FIXTURES / name)
    out = cfg.to_hf()
    assert {k: out[k] for k in PINNED[cfg.family]} == PINNED[cfg.family]
    if cfg.family == "llada2_moe":
        assert out["use_bias"] is False and out["use_qkv_bias"] is False  # LLaDA2MoeConfig defaults use_bias True
    assert out["eos_token_id"] == (cfg.eos_token_ids if len(cfg.eos_token_ids) > 1 else cfg.eos_token_id)
    back = ModelConfig.from_hf(out)
    assert back == cfg.model_copy(update={"block_size_stated": True})
