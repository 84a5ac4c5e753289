"""Shared fixtures for Ray integration tests: multi-node clusters for the tests that need them, and the tiny random
serving checkpoint with its directly-called reference engine (the Serve app tests compare against it). The
session's one Ray cluster (`ray_cluster`) is in tests/conftest.py: the e2e tests join it too.

A process is the driver of one Ray cluster at a time. The session's cluster therefore runs as processes of its own
(not started by `ray.init`), so that a multi-node test can disconnect the driver from it, use its own cluster, and
reconnect the driver afterwards without restarting it."""

import pytest

from tests.integration.multinode import LocalCluster


@pytest.fixture
def multinode():
    """multinode(workers=(1, 1), head_cpus=1, ...) -> a started LocalCluster with a worker node per entry of
    `workers` (its logical CPUs), this process its driver. The driver's previous cluster is reconnected after the
    test, and every process of the multi-node cluster ended."""
    import ray

    previous = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    started: list[LocalCluster] = []

    def start(workers=(1, 1), head_cpus: float = 1, **kwargs) -> LocalCluster:
        if ray.is_initialized():
            ray.shutdown()
        cluster = LocalCluster(head_cpus=head_cpus, **kwargs)
        started.append(cluster)
        cluster.start()
        for cpus in workers:
            cluster.add_node(num_cpus=cpus)
        cluster.connect()
        return cluster

    yield start
    for cluster in started:
        cluster.shutdown()
    if previous is not None and not ray.is_initialized():
        ray.init(address=previous)


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


def tiny_serve_config(ckpt, name: str, **sections: dict):
    """The serve config of the tiny random checkpoint as the Serve tests run it (one engine thread, SERVE_SLOTS rows,
    the reference engine's decode config, 16 tokens unless asked); `sections` replace whole top-level sections."""
    from serve_app.config import ServeConfig
    from tests.integration.test_serve_units import DECODE

    return ServeConfig.model_validate({
        "model": {"path": str(ckpt), "name": name, "num_cpus_per_rank": 0.1},
        "engine": {"max_batch_rows": SERVE_SLOTS, "threads": 1},
        "decode": DECODE.model_dump(),
        "limits": {"default_max_tokens": 16},
    } | sections)


@pytest.fixture(scope="session")
def serve_url(ray_cluster):
    """The session's one Ray Serve instance (controller and HAProxy, on a free port) on the session's cluster,
    shared by the Serve test modules: each deploys its apps and deletes them after (`serve_apps`). A Serve start
    and shutdown per module cost tens of seconds on 2 cores."""
    from ray import serve

    from actors.tp_worker import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def decoder_stats(app: str) -> dict:
    """The `Decoder` deployment's stats of `app`, asked from a Ray task: a deployment handle used in this driver
    would keep Serve's router threads here, and when a multi-node test disconnects the driver, those threads
    reconnect it to the session's cluster (Ray's auto-init) before the test can connect to its own."""
    import ray

    @ray.remote(num_cpus=0)
    def ask(app: str) -> dict:
        from ray import serve

        return serve.get_deployment_handle("Decoder", app_name=app).stats.remote().result()

    return ray.get(ask.remote(app))


def serve_apps(url: str, **apps):
    """Each app of `apps` (name -> ServeConfig, or a built Serve application) at /name on the session's Serve at
    `url`; yields `url` once and deletes the apps when resumed (a module fixture iterates it)."""
    from ray import serve

    from serve_app.app import build_app

    serve.run_many([serve.RunTarget(app if isinstance(app, serve.Application) else build_app({"serve_config": app}),
                                    name=name, route_prefix=f"/{name}") for name, app in apps.items()])
    yield url
    for name in apps:
        serve.delete(name)
