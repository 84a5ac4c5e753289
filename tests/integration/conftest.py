"""Shared fixtures for Ray integration tests: one small local Ray cluster per test session."""

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, object_store_memory=300 * 1024**2, include_dashboard=False)
    yield ray
    ray.shutdown()
