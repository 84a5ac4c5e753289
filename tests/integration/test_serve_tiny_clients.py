"""The shipped trained tiny model (configs/serve/tiny.yaml) behind Ray Serve over real HTTP, against the tools real
clients use: lm-evaluation-harness scores it as our scorer does, and structured output constrains it on both
endpoints in the three request shapes clients send. The field-by-field OpenAI compatibility on a random model is
in test_serve_openai."""

import json

import openai
import pytest

from mbd.eval.math_scoring import score_gsm8k
from mbd.tiny.task import generate as tiny_problems
from serve_app.config import load_serve_config
from tests.integration.conftest import serve_apps
from tests.integration.test_serve_units import REPO


@pytest.fixture(scope="module")
def base(serve_url):
    """The tiny app's URL prefix (the served model name is the config's)."""
    tiny = load_serve_config(REPO / "configs" / "serve" / "tiny.yaml")
    tiny = tiny.model_copy(update={"model": tiny.model.model_copy(update={"path": str(tiny.model.resolved_path()),
                                                                          "num_cpus_per_rank": 0.1})})
    for url in serve_apps(serve_url, tiny=tiny):  # the app deleted after the module
        yield f"{url}/tiny"


# ---------------------------------------------------------------- lm-evaluation-harness against the tiny model

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{text}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 64
  do_sample: false
filter_list:
  - name: strict
    filter:
      - function: regex
        regex_pattern: "#### (\\\\-?[0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.mark.parametrize("model_type", ["local-completions", "local-chat-completions"])
def test_lm_eval_harness_score_matches_our_scorer(base, tmp_path, model_type, monkeypatch):
    """lm-eval (tokenizer_backend=None, a local JSON task, no network) against the served embedded tiny model:
    its exact-match score equals our GSM8K scorer's on the completions it logged. local-completions sends the
    chat-rendered prompt as raw text (special tokens allowed there), local-chat-completions sends messages."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    problems = tiny_problems("heldout", 12, seed=5)
    data = tmp_path / "tinymath.jsonl"
    data.write_text("".join(json.dumps({"question": p["question"], "answer": p["answer"]}) + "\n" for p in problems))
    chat = model_type == "local-chat-completions"
    text = "{{question}}" if chat else "<|im_start|>user\\n{{question}}<|im_end|>\\n<|im_start|>assistant\\n"
    name = "tinymath_chat" if chat else "tinymath_raw"
    (tmp_path / f"{name}.yaml").write_text(TASK.format(name=name, data=data, text=text))
    url = base + ("/v1/chat/completions" if chat else "/v1/completions")
    out = lm_eval.simple_evaluate(
        model=model_type, model_args={"model": "mbd-tiny", "base_url": url, "tokenizer_backend": None,
                                      "num_concurrent": 4, "max_retries": 1, "batch_size": 1 if chat else 4},
        tasks=[name], task_manager=TaskManager(include_path=str(tmp_path)), apply_chat_template=chat,
        log_samples=True)
    samples = out["samples"][name]
    assert len(samples) == len(problems)
    completions = [s["resps"][0][0] for s in samples]
    ours = sum(score_gsm8k(c, str(s["doc"]["answer"])).correct for c, s in zip(completions, samples)) / len(samples)
    theirs = out["results"][name]["exact_match,strict"]
    assert theirs == pytest.approx(ours) and ours > 0  # the trained tiny model solves some: a real comparison



# ---------------------------------------------------------------- structured output

TINY_REGEX = r"([0-9]{1,3}[*+-][0-9]{1,3}=[0-9]{1,3};){4}#### [0-9]{1,3}"


def test_structured_output_on_both_endpoints(base):
    """The trained tiny model constrained to its answer format (regex) and to a choice, on both endpoints and in
    the three request shapes (vLLM's structured_outputs, its older guided_*, OpenAI's response_format)."""
    import re

    tiny = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    name = tiny.models.list().data[0].id
    got = tiny.completions.create(model=name, prompt="3*4+2*7-5", max_tokens=64,
                                  extra_body={"structured_outputs": {"regex": TINY_REGEX}})
    assert re.fullmatch(TINY_REGEX, got.choices[0].text) and got.choices[0].finish_reason == "stop"
    chat = tiny.chat.completions.create(model=name, messages=[{"role": "user", "content": "5*6+2*3-1"}],
                                        max_tokens=64, extra_body={"guided_choice": ["yes", "no"]})
    assert chat.choices[0].message.content in ("yes", "no")
    stream = tiny.chat.completions.create(model=name, messages=[{"role": "user", "content": "5*6+2*3-1"}],
                                          max_tokens=64, stream=True, extra_body={"guided_regex": TINY_REGEX})
    assert re.fullmatch(TINY_REGEX, "".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    # the tiny alphabet has no '{': a JSON schema is refused as inexpressible, naming the field
    with pytest.raises(openai.BadRequestError) as e:
        tiny.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                     response_format={"type": "json_schema", "json_schema": {
                                         "name": "x", "schema": {"type": "object"}, "strict": True}})
    assert e.value.body["param"] == "response_format.json_schema.schema"
    assert "vocabulary cannot express" in e.value.body["message"]


# ---------------------------------------------------------------- the README's serve command answers correctly

SERVED = 24  # held-out problems asked over HTTP


def test_the_served_default_is_the_mbd_model_and_answers_as_documented(base):
    """`mbd serve --config configs/serve/tiny.yaml` serves the embedded MBD model at the tiny MultiBD operating point:
    over real HTTP its greedy answers to held-out problems are the engine's own on the same weights and config, and
    they score within three binomial standard errors of its documented held-out accuracy."""
    import math

    from mbd.decoding import EngineConfig, build_engine
    from mbd.tiny.benchmark import TinyMath

    cfg = load_serve_config(REPO / "configs" / "serve" / "tiny.yaml")
    doc = json.loads((cfg.model.resolved_path() / "provenance.json").read_text())["eval"]["first_1000"]
    assert cfg.model.path == "mbd/assets/mbd-tiny" and cfg.decode.buffer_size > 1
    problems = TinyMath().load(limit=SERVED)
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    decode = cfg.decode.model_copy(update={"max_new_tokens": 128})  # what the documented evaluation gave each problem
    served = [client.chat.completions.create(model=cfg.model.name, max_tokens=decode.max_new_tokens,
                                             messages=[{"role": "user", "content": p.prompt_text}])
              .choices[0].message.content for p in problems]
    engine = build_engine(cfg.model.resolved_path(), decode, EngineConfig(device="cpu", dtype="float32"))
    assert served == [r.text for r in engine.generate([p.prompt_text for p in problems])]
    correct = sum(score_gsm8k(text, p.reference).correct for text, p in zip(served, problems))
    p = doc["accuracy"]
    assert correct / SERVED >= p - 3 * math.sqrt(p * (1 - p) / SERVED)
