"""The HTTP ingress loads no torch and no engine: it reads the request types (actors/messages.py,
mbd/decoding/validate.py, outputs.py, constraint_spec.py, model_spec.py), never the engine host. The decoder
replica, the engine host, loads no torch either: only its engine process and TP ranks do (actors/launch.py). The
engine process loads no Ray (half a second of every engine start). Checked in a fresh interpreter, where nothing
was imported before."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "mbd.decoding.engine", "actors.engine_host", "actors.engine_process")


@pytest.mark.parametrize("module", ["serve_app.ingress", "serve_app.config", "actors.messages", "actors.supervisor"])
def test_module_imports_no_torch(module):
    assert loaded(module, HEAVY) == []


@pytest.mark.parametrize("module", ["serve_app.app", "serve_app.decoder_replica", "actors.launch"])
def test_the_replica_host_imports_no_torch(module):
    assert loaded(module, ("torch", "mbd.decoding.engine", "actors.engine_process", "actors.tp_worker")) == []


def test_the_engine_process_imports_no_ray():
    assert loaded("actors.engine_process", ("ray",)) == []


def loaded(module: str, heavy: tuple[str, ...]) -> list[str]:
    """Which of `heavy` a fresh interpreter has loaded after importing `module`."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_the_decoding_package_still_exports_the_engine():
    """`from mbd.decoding import Engine` loads it on first use (the package's names are lazy)."""
    from mbd.decoding import Engine
    from mbd.decoding.engine import Engine as Home

    assert Engine is Home
