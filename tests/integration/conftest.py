"""Shared fixtures for Ray integration tests: one small local Ray cluster per test session, and the tiny random
serving checkpoint with its directly-called reference engine (the Serve app tests compare against it)."""

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from pipelines.ray_session import dashboard_port

    # dashboard_port: see pipelines/ray_session.py (another cluster's dashboard must not answer our State API)
    ray.init(num_cpus=2, object_store_memory=300 * 1024**2, include_dashboard=False, dashboard_port=dashboard_port())
    yield ray
    ray.shutdown()


SERVE_SLOTS = 8  # batch slots of the served decoder and of the reference engine


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    from tests.integration.test_serve_units import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("serve") / "ck")


@pytest.fixture(scope="session")
def ref(ckpt):
    """The engine called directly, with the deployment's decode config and slots."""
    from mbd.decoding import Engine, EngineConfig
    from mbd.model import load_checkpoint
    from mbd.tokenizer import Tokenizer
    from tests.integration.test_serve_units import DECODE

    model, cfg = load_checkpoint(ckpt)
    tok = Tokenizer.from_dir(ckpt, cfg)
    return Engine(model, tok, DECODE, EngineConfig(max_batch_rows=SERVE_SLOTS)), tok
