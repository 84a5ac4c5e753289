"""Every command the README shows is run somewhere: by CI (`.ci/run` runs the README's test command), by this
file, or by the named test that runs the same command at a reduced size. A command added to the README without
an entry in RUN_BY fails `test_every_readme_command_says_where_it_runs`.

The default suite runs the cheap commands here and checks every `mbd` command's arguments and config files
without starting its job; the Ray jobs of the tour run as written (plus flags that shrink them and keep their
outputs in a temporary directory) in the `slow` test.
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipelines.cli import main as mbd

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PROGRAMS = ("mbd", "python", "python3", "pip", "bash", "ray", "serve", "kubectl", "curl")

CORPUS = "python -c \"from mbd.tiny.task import generate, write_jsonl; write_jsonl('runs/tiny/train.jsonl', " \
         "generate('posttrain', 2000, seed=0))\""
GENERATE = 'mbd generate --config configs/decode/tiny_multibd.yaml "3*4+2*7-5"'
EXPAND = "mbd expand --config configs/expand/tiny.yaml"
TRAIN = "mbd train --config configs/train/tiny_cpu.yaml"
SERVE = "mbd serve --config configs/serve/tiny.yaml"
EVAL = "mbd eval --sweep configs/eval/tiny_sweep.yaml"

CURL = "curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d '{\"model\": \"mbd-tiny\", " \
       "\"prompt\": \"3*4+2*7-5=\", \"max_tokens\": 32}'"
REAL = ("mbd serve --config configs/serve/llada2-mini-tp2.yaml --model inclusionAI/LLaDA2.0-mini",  # a tuple: one
        "mbd serve --config configs/serve/sdar-8b-tp2.yaml --model JetLM/SDAR-8B-Chat",  # order in every xdist worker
        "mbd train --config configs/train/mbd-sdar-8b-chat-b4-math.yaml",
        "mbd eval --sweep configs/eval/paper_main.yaml")

# README command -> where it runs
RUN_BY = {
    "set-up 1": "CI runs its install steps (the test command's, checked here); tests/e2e/test_quickstart.py runs "
                "its `mbd quickstart` at a reduced size",
    "set-up 2": ".ci/run, verbatim (checked here)",
    "python -m pytest -m slow": "the marker and the default suite's exclusion are checked here",
    "mbd quickstart": "tests/e2e/test_quickstart.py (reduced: --steps 2 --problems 6 --corpus 24, a smaller "
                      "TPS timing)",
    "mbd reproduce": "here, slow (reduced: --parts core --steps 2 --problems 4 --claim-problems 8 --corpus 16 "
                     "--seeds 2)",
    CORPUS: "here", GENERATE: "here",
    EXPAND: "here, slow", TRAIN: "here, slow (2 steps)", SERVE: "here, slow (one request)",
    EVAL: "here, slow (--limit 2)",
    CURL: "here, slow: the tour's served model answers a completion like it (a chat request, by urllib)",
    **{c: "arguments and config checked here (running it needs GPUs and the named model's download)" for c in REAL},
}


def strip_comment(line: str) -> str:
    return re.split(r"\s+#\s", line, maxsplit=1)[0].strip()


def setup_commands() -> list[str]:
    """The two set-up commands: the bash blocks of the README's set-up section."""
    section = README.read_text().split("## Set-up", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [strip_comment(ln) for b in blocks for ln in b.splitlines() if ln.strip() and not ln.startswith("#")]


def readme_commands() -> list[str]:
    """Every command line of the README's bash blocks (continuations joined, comments dropped) and every inline
    code span that starts with a program; the set-up commands are named `set-up 1` and `set-up 2`."""
    text = README.read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = [strip_comment(ln) for b in blocks for ln in b.replace("\\\n", " ").splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    lines += [span for span in re.findall(r"`([^`\n]+)`", prose) if span.split()[0] in PROGRAMS]
    names = dict(zip(setup_commands(), ("set-up 1", "set-up 2")))
    return [names.get(c, c) for c in lines]


def test_every_readme_command_says_where_it_runs():
    assert sorted(set(readme_commands())) == sorted(RUN_BY)


def test_ci_runs_the_readme_test_command_and_the_quickstart_command_installs_alike():
    quickstart, tests = setup_commands()
    assert (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1] == tests
    assert quickstart == tests.replace("-e '.[dev]'", "-e .").replace("python -m pytest -q", "mbd quickstart")
    assert "pip install -q torch==2.13.0 uv" in tests  # pip: the local CPU build where pip's config names one
    # every uv install writes the .pyc files: with PYTHONDONTWRITEBYTECODE set Python never does, and every process
    # would compile torch, ray and transformers from source again
    uv_installs = [c for c in tests.split(" && ") if c.startswith("uv pip install")]
    assert len(uv_installs) == 2 and all("--compile-bytecode" in c for c in uv_installs)


def test_slow_tests_are_left_out_of_the_default_suite():
    import tomllib

    pytest_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "-m 'not slow'" in pytest_cfg["addopts"] and any(m.startswith("slow:") for m in pytest_cfg["markers"])


# ---------------------------------------------------------------- arguments and configs of every `mbd` command

def check_expand(argv):
    from pipelines.expand_layouts import config_from_args
    return config_from_args(argv)


def check_train(argv):
    from mbd.config import load_yaml
    from mbd.train_config import TrainConfig
    args = dict(zip(argv[::2], argv[1::2]))
    return load_yaml(ROOT / args["--config"], TrainConfig)


def check_serve(argv):
    from serve_app.config import load_serve_config
    from pipelines.serve import parse_args
    return load_serve_config(ROOT / parse_args(argv).config)


def check_eval(argv):
    from pipelines.eval_sweep import load_with_flags, parser
    return load_with_flags(parser().parse_args(argv))


def check_quickstart(argv):
    from pipelines.quickstart import parser
    from pipelines.stages import load_config
    return load_config(parser().parse_args(argv).config)


def check_reproduce(argv):
    from pipelines.reproduce import parser, parts_of
    from pipelines.stages import load_config
    args = parser().parse_args(argv)
    assert parts_of(args.parts)
    return load_config(args.config)


def check_pretrain(argv):
    from pipelines.pretrain_tiny import DEFAULT_CONFIG, load_pretrain_config
    assert argv == []
    return load_pretrain_config(DEFAULT_CONFIG, [], None, None)


CHECKS = {"expand": check_expand, "train": check_train, "serve": check_serve, "eval": check_eval,
          "quickstart": check_quickstart, "reproduce": check_reproduce, "pretrain-tiny": check_pretrain}


@pytest.mark.parametrize("command", [c for c in RUN_BY if c.startswith("mbd ") and c != GENERATE])
def test_the_jobs_arguments_and_configs_load(command, monkeypatch):
    """What each Ray job would read, loaded and validated without starting the job."""
    monkeypatch.chdir(ROOT)
    sub, *argv = shlex.split(command)[1:]
    assert CHECKS[sub](argv) is not None


ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def write_corpus() -> None:
    """The tour's first line, in the working directory, by this interpreter."""
    subprocess.run([sys.executable, *shlex.split(CORPUS)[1:]], check=True, env=ENV)


def test_cheap_commands_run_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_corpus()
    lines = (tmp_path / "runs/tiny/train.jsonl").read_text().splitlines()
    assert len(lines) == 2000 and {"prompt", "response"} <= set(json.loads(lines[0]))
    monkeypatch.chdir(ROOT)
    assert mbd(shlex.split(GENERATE)[1:]) == 0
    out = capsys.readouterr().out  # the prompt, the completion (the tiny task's answer format), its statistics
    assert "### 3*4+2*7-5" in out and re.search(r"#### \d+", out) and re.search(r"tokens=\d+ nfe=\d+", out)


# ---------------------------------------------------------------- the tour's Ray jobs, as written

def free_port() -> int:
    from actors.tp_worker import free_port as pick
    return pick()


@pytest.mark.slow
def test_the_tour_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_corpus()
    corpus = tmp_path / "runs/tiny/train.jsonl"
    monkeypatch.chdir(ROOT)
    cfg = lambda c: ["--config", str(ROOT / c)]  # noqa: E731 - the tour's paths, read from the repository
    assert mbd(["expand", *cfg("configs/expand/tiny.yaml"), "--input", str(corpus),
                "--output-dir", str(tmp_path / "expand")]) == 0
    assert list((tmp_path / "expand").rglob("*.parquet"))
    assert mbd(["train", *cfg("configs/train/tiny_cpu.yaml"), "--no-progress", "--set", "steps=2",
                "--set", "checkpoint_every=2", "--set", f"data.jsonl={corpus}",
                "--set", f"run.storage_path={tmp_path / 'train'}"]) == 0
    assert mbd(["eval", "--sweep", str(ROOT / "configs/eval/tiny_sweep.yaml"), "--limit", "2", "--no-progress",
                "--output-dir", str(tmp_path / "eval")]) == 0
    assert (tmp_path / "eval" / "report.md").is_file()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "pipelines.cli", *shlex.split(SERVE)[1:], "--port", str(port),
                               "--metrics-port", str(free_port())], cwd=ROOT, env=ENV)
    try:
        body = json.dumps({"model": "mbd-tiny", "messages": [{"role": "user", "content": "3*4+2*7-5"}],
                           "max_tokens": 16}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        deadline, reply = time.monotonic() + 300, None
        while reply is None and time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    reply = json.loads(r.read())
            except OSError:
                time.sleep(2)
        assert reply is not None and reply["usage"]["completion_tokens"] >= 1
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)


@pytest.mark.slow
def test_reproduce_and_pretrain_tiny_run_reduced(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert mbd(["reproduce", "--parts", "core", "--steps", "2", "--problems", "4", "--claim-problems", "8",
                "--corpus", "16", "--seeds", "2", "--run-dir", str(tmp_path / "reproduce"), "--no-progress"]) == 0
    (report,) = [p.read_text() for p in (tmp_path / "reproduce").glob("a2-c2-d2-e2-*/reproduce.md")]  # its folder
    assert "over 2 seeds" in report and "n=8" in report  # claim (a) over both seeds, on the claim problems
    assert "training seeds per claim (a) 2, (c) 2, (d) 2, (e) 2" in report  # the counts registered up front
    work = tmp_path / "pretrain"
    assert mbd(["pretrain-tiny", "--steps", "2", "--out", str(work / "out"), "--eval-problems", "2", "--no-progress",
                "--set", "corpus.problems=64", "--set", f"train.run.storage_path={work}",
                "--set", f"train.model_path={work / 'init'}", "--set", f"train.data.jsonl={work / 'train.jsonl'}"]) == 0
    assert (work / "out" / "config.json").is_file()
