"""What a fresh interpreter loads. The HTTP ingress loads no torch and no engine: it reads the request types
(actors/messages.py, mbd/decoding/validate.py, outputs.py, constraint_spec.py, model_spec.py), never the engine
host. The decoder replica, the engine host, loads no torch either: only its engine process and TP ranks do
(actors/launch.py). The engine process loads no Ray (half a second of every engine start), and loading a checkpoint
loads no torch._dynamo (1.5-3 s of every engine and evaluation process, none of which compiles on CPU).

One interpreter per group imports the group's modules one after another and reports, after each, which of the
heavy modules it has loaded so far: the first module that loads one is named, and the ones after it fail too."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INGRESS_SIDE = ["serve_app.ingress", "serve_app.config", "actors.messages", "actors.supervision_policy"]
REPLICA_HOST = ["serve_app.app", "serve_app.decoder_replica", "actors.launch"]
HEAVY = {"ingress": ("torch", "mbd.decoding.engine", "actors.engine_host", "actors.engine_process"),
         "replica": ("torch", "mbd.decoding.engine", "actors.engine_process", "actors.tp_worker")}


def loaded_after_each(steps: list[str], heavy: tuple[str, ...]) -> dict[str, list[str]]:
    """step (a module to import, or a call) -> which of `heavy` one fresh interpreter has loaded after it
    and every step before it."""
    code = ("import json, sys\nout = {}\n" + "".join(
        f"{s if '(' in s else 'import ' + s}\nout[{s!r}] = sorted(m for m in {heavy!r} if m in sys.modules)\n"
        for s in steps) + "print(json.dumps(out))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def ingress_side() -> dict[str, list[str]]:
    return loaded_after_each(INGRESS_SIDE, HEAVY["ingress"])


@pytest.fixture(scope="module")
def replica_host() -> dict[str, list[str]]:
    return loaded_after_each(REPLICA_HOST, HEAVY["replica"])


@pytest.mark.parametrize("module", INGRESS_SIDE)
def test_module_imports_no_torch(module, ingress_side):
    assert ingress_side[module] == []


@pytest.mark.parametrize("module", REPLICA_HOST)
def test_the_replica_host_imports_no_torch(module, replica_host):
    assert replica_host[module] == []


def test_the_engine_process_imports_no_ray_and_a_checkpoint_load_no_dynamo():
    load = "mbd.model.load_checkpoint('mbd/assets/tiny')"
    got = loaded_after_each(["actors.engine_process", "mbd.model", load], ("ray", "torch._dynamo"))
    assert got["actors.engine_process"] == [] and got["mbd.model"] == []
    assert got[load] == []


def test_the_decoding_package_still_exports_the_engine():
    """`from mbd.decoding import Engine` loads it on first use (the package's names are lazy)."""
    from mbd.decoding import Engine
    from mbd.decoding.engine import Engine as Home

    assert Engine is Home
