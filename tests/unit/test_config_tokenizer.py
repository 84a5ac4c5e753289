"""Config validation names the field and the allowed range; chat rendering matches each family's format."""

import pytest
from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers, decoders

from mbd.config import ConfigError, DecodeConfig, ModelConfig, load_yaml
from mbd.chat_template import BUILTIN, ChatTemplate
from mbd.tokenizer import Tokenizer, TokenizerError
from tests.conftest import tiny_cfg


def test_yaml_errors_name_field_and_range(tmp_path):
    p = tmp_path / "d.yaml"
    p.write_text("decode:\n  buffer_size: 2\n  tau_add: 0.1\n  tau_m2t: 1.5\n")
    with pytest.raises(ConfigError, match=r"field 'tau_m2t'.*less than or equal to 1.*1\.5"):
        load_yaml(p, DecodeConfig, section="decode")
    p.write_text("buffer_size: 2\n")
    with pytest.raises(ConfigError, match="tau_add is required"):
        load_yaml(p, DecodeConfig)
    p.write_text("buffer_size: 2\ntau_add: 0.1\nbogus: 1\n")
    with pytest.raises(ConfigError, match="field 'bogus'.*Extra inputs"):
        load_yaml(p, DecodeConfig)
    p.write_text("buffer_size: 4\ntau_add: 0.1\ntau_semi: 0.25\n")
    assert load_yaml(p, DecodeConfig).buffer_size == 4
    with pytest.raises(ConfigError, match="not found"):
        load_yaml(tmp_path / "nope.yaml", DecodeConfig)


def test_model_config_hf_round_trip_and_errors():
    for fam in ("sdar", "llada2_moe"):
        cfg = tiny_cfg(fam)
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    with pytest.raises(ConfigError, match="unknown architecture"):
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"]})
    bad = tiny_cfg("sdar").to_hf() | {"num_key_value_heads": 3}
    with pytest.raises(ConfigError, match="multiple of num_key_value_heads"):
        ModelConfig.from_hf(bad)


def test_chat_formats():
    """The built-in templates (for checkpoints that ship none): ChatML for sdar; LLaDA2's with the authors'
    system turn, a system message before `detailed thinking off`."""
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    sdar, llada2 = ChatTemplate(BUILTIN["sdar"]), ChatTemplate(BUILTIN["llada2_moe"])
    assert sdar.render(msgs) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    assert llada2.render(msgs) == ("<role>SYSTEM</role>S\ndetailed thinking off<|role_end|><role>HUMAN</role>Q"
                                   "<|role_end|><role>ASSISTANT</role>")
    assert llada2.render(msgs[1:]) == ("<role>SYSTEM</role>detailed thinking off<|role_end|><role>HUMAN</role>Q"
                                       "<|role_end|><role>ASSISTANT</role>")
    with pytest.raises(TokenizerError, match=r"messages\[0\].role"):
        sdar.render([{"role": "tool", "content": "x"}])


def test_tokenizer_from_dir(tmp_path):
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789 \n+=")
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(specials)
    tok.decoder = decoders.Fuse()
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = tiny_cfg("sdar", vocab_size=len(vocab), mask_token_id=3, eos_token_id=0, pad_token_id=0)
    t = Tokenizer.from_dir(tmp_path, cfg)
    ids = t.encode_chat([{"role": "user", "content": "1+2"}])
    assert ids[0] == vocab["<|im_start|>"] and t.decode(ids) == "user\n1+2\nassistant\n"
    assert t.stop_token_ids == sorted({0, vocab["<|im_end|>"]})
    with pytest.raises(TokenizerError, match="missing tokenizer.json"):
        Tokenizer.from_dir(tmp_path / "none", cfg)
