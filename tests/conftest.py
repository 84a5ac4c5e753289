import ast
import functools
import os
import threading
from pathlib import Path

import pytest
import torch

# CPython 3.11.7 keeps the AST constructor's recursion counter per interpreter, not per thread (a race that later
# releases fixed by giving each parse its own state; see gh-106905): two threads building ASTs at once fail one of
# them with "SystemError: AST constructor recursion depth mismatch". In this process they do: pytest's assertion
# rewrite and our source-reading tests call ast.parse while Ray's background threads log exceptions, and 3.11's
# traceback formatting calls ast.parse for its carets (seen in CI: test_import_rules beside a Ray Data thread logging
# a failed Prometheus query; before that, hypothesis' and schemathesis' lazy imports). One lock around ast.parse
# serialises every such caller in the test process.
_parse_lock = threading.RLock()
_unlocked_parse = ast.parse


@functools.wraps(_unlocked_parse)
def _serialised_parse(*args, **kwargs):
    with _parse_lock:
        return _unlocked_parse(*args, **kwargs)


ast.parse = _serialised_parse

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

# Ray Train's controller polls its worker group every 2 s (its default), so the end of each run and each failure
# wait up to 2 s more before the controller acts; the runs here last half a minute. Measured on 2 quiet cores, two
# 2-step runs each way: 0.5 s took 3-7 s off a run (most of it between the loop's end and `run_train` returning).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")

# Inductor checks which vector ISAs the C++ compiler can build by compiling and dlopen-ing a probe program per ISA
# (AVX512-VNNI, AVX512, AVX2) in every process that compiles: ~11 s of CPU in the first such process of a run (the
# probes' compiles) and ~2 s in each later one (a Python child per ISA for the dlopen). The suite takes the CPU's
# flags as the answer instead, as inductor does in fbcode: the sdar warm-up test alone, 55 -> 42 s on 2 cores.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

# One intra-op thread: on a shared 2-core machine every parallel region otherwise waits for a scheduler tick
# (measured: the decoding tests ran 45x slower with 2 threads under load).
torch.set_num_threads(1)


@pytest.hookimpl(trylast=True)  # after pytest's own tmp_path plugin has configured
def pytest_configure(config):
    """Without kernel isolation (no bubblewrap), the scoring tests still run with the hook-only sandbox,
    as a user would with --unsafe-code-exec; the escape tests skip and say why.

    Inductor's on-disk cache (/tmp/torchinductor_<user> by default) outlives a run: a second run on the same
    machine would compile nothing and time a warm suite that a fresh CI machine never sees (measured: the compiled
    forward's tests 196 s cold, 119 s warm). Each run compiles into a cache of its own in the run's temporary
    directory (pytest keeps the last three); set here, before any test module imports inductor (which fixes the
    default on import). Under xdist the controller sets it before it starts the workers, which inherit it with every
    process they start."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(config._tmp_path_factory.getbasetemp() / "inductor")
    from mbd.eval.isolation import UNSAFE_ENV, isolation_available

    if not isolation_available():
        os.environ[UNSAFE_ENV] = "1"
        print(f"bubblewrap unavailable: code-execution tests run hook-only ({UNSAFE_ENV}=1); escape tests skip")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Two xdist workers (pyproject's addopts): every test on the session's Ray cluster (tests/e2e, tests/integration)
    is one work unit, run in collection order by one worker that owns the cluster, while the other worker takes the
    unit tests and the Ray modules off the session's cluster (OFF_SESSION_CLUSTER) a module at a time (a module's
    fixtures built once). The Ray tests leave about a quarter of the two cores idle while processes start and
    requests wait; the unit tests, one thread each, fill it instead of running after them. (xdist's own `loadgroup`
    marks do nothing under pytest 9, whose test ids no longer take its suffix.)

    Work units are handed out in collection order (`collection_order`), not xdist's default order by number of
    tests, which put the one-test multi-node modules, the longest units after the Ray unit, at the very end."""
    from xdist.scheduler import LoadScopeScheduling

    class RayTestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False
    return RayTestsTogether(config, log)


# Modules under tests/e2e and tests/integration that never use the session's cluster: their tests start clusters of
# their own (the `multinode` fixture, or a command that starts one: its own ports and processes) or use no Ray at
# all (the engine process's supervision and quarantine, the README's commands, the shipped checkpoint). They run on
# the other worker, beside the session cluster's tests instead of after them (measured in CI on 2 quiet cores: the
# multi-node modules, pytest 1,197 -> 1,081 s; the no-Ray ones, 124 s of the Ray unit's 882 s). A test in one of
# them that asks for the session's cluster is refused at collection (the other worker would start a second one);
# tests/unit/test_suite_scheduling.py checks that every module left in the "ray" unit asks for it.
OFF_SESSION_CLUSTER = frozenset(f"tests/{name}.py" for name in (
    "integration/test_multinode_expand", "integration/test_multinode_train", "integration/test_serve_node_loss",
    "integration/test_serve_sigterm", "integration/test_sweep_multinode", "integration/test_serve_units",
    "integration/test_serve_quarantine", "e2e/test_readme_commands", "e2e/test_tiny_checkpoint"))
SESSION_CLUSTER_FIXTURES = frozenset({"ray_cluster", "serve_url"})


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: "ray" for every test on the session's cluster, else its module's path."""
    path = nodeid.split("::", 1)[0]
    on_session_cluster = path.startswith(("tests/e2e/", "tests/integration/")) and path not in OFF_SESSION_CLUSTER
    return "ray" if on_session_cluster else path


# Work units that took 30 s or more in CI (2 quiet cores, cold compile cache), longest first: they start right after
# the Ray unit, so the suite never ends waiting on one of them while the other worker is idle.
LONG_UNITS = tuple(f"tests/{name}.py" for name in (
    "integration/test_multinode_train", "unit/test_compiled_forward", "integration/test_serve_node_loss",
    "integration/test_serve_sigterm", "integration/test_serve_units", "integration/test_sweep_multinode",
    "integration/test_multinode_expand", "unit/test_gpu_acceptance_quick", "integration/test_serve_quarantine"))


def collection_order(nodeid: str) -> int:
    """The rank of a test's work unit in the order the units are handed out: the Ray unit, LONG_UNITS in their
    order, then everything else (a stable sort keeps the order within each)."""
    unit = work_unit(nodeid)
    if unit == "ray":
        return 0
    return 1 + LONG_UNITS.index(unit) if unit in LONG_UNITS else 1 + len(LONG_UNITS)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: collection_order(item.nodeid))
    check_work_units(items)


def check_work_units(items) -> None:
    """The collection guard, before `-m 'not slow'` deselects (this hook runs ahead of pytest's own): a test outside
    the "ray" work unit that asks for the session's cluster is refused (the other worker would start a second
    one). When every module under tests/e2e and tests/integration is collected (the whole suite), so is a module in
    the "ray" unit none of whose tests asks for it (it only lengthens the suite's longest unit: list it in
    OFF_SESSION_CLUSTER), and a name in OFF_SESSION_CLUSTER that is no module."""
    uses: dict[str, bool] = {}
    for item in items:
        asked = SESSION_CLUSTER_FIXTURES.intersection(item.fixturenames)
        if asked and work_unit(item.nodeid) != "ray":
            raise pytest.UsageError(f"{item.nodeid} asks for the session's Ray cluster ({', '.join(sorted(asked))}) "
                                    "outside its xdist work unit: take its module out of OFF_SESSION_CLUSTER")
        module = item.nodeid.split("::", 1)[0]
        uses[module] = uses.get(module, False) or bool(asked)
    on_disk = {p.relative_to(ROOT).as_posix() for d in ("e2e", "integration") for p in (TESTS / d).glob("test_*.py")}
    if not on_disk <= set(uses):
        return
    idle = sorted(m for m in on_disk if work_unit(m) == "ray" and not uses[m])
    if idle or not OFF_SESSION_CLUSTER <= on_disk:
        raise pytest.UsageError(f"modules in the session cluster's work unit that never use it: {idle}; "
                                f"OFF_SESSION_CLUSTER names that are no module: {sorted(OFF_SESSION_CLUSTER - on_disk)}")


def tiny_cfg(family: str = "sdar", **kw):
    from mbd.config import ModelConfig

    base = dict(family=family, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, mask_token_id=63, eos_token_id=62,
                pad_token_id=61, block_size=4, max_position_embeddings=256, rope_theta=10000.0)
    if family == "llada2_moe":
        base.update(num_experts=8, num_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
                    moe_intermediate_size=16, first_k_dense_replace=1, partial_rotary_factor=0.5,
                    routed_scaling_factor=2.5, num_hidden_layers=3)
    base.update(kw)
    return ModelConfig(**base)


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's one small local Ray cluster (2 CPUs), started by the first test that asks and shared by every
    integration and e2e test after it: each cluster start costs tens of seconds on 2 cores. It runs as processes
    of its own (tests/integration/multinode.py), so a multi-node test can disconnect from it and reconnect."""
    import ray

    from tests.integration.multinode import LocalCluster

    cluster = LocalCluster(head_cpus=2, object_store_mb=300).start()
    cluster.connect()
    yield ray
    cluster.shutdown()


@pytest.fixture(params=["sdar", "llada2_moe"])
def family(request):
    return request.param


def _data_dir():
    from mbd.eval.benchmarks import resolve_data_dir

    try:
        return resolve_data_dir()
    except FileNotFoundError:
        return None


DATA = _data_dir()
needs_data = pytest.mark.skipif(DATA is None, reason="benchmark data directory not available")
