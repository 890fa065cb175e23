"""One local Ray instance for the whole module: runs reuse it instead of starting their own."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_local():
    import ray

    from relax.runner.plan import LOCAL_RAY_SYSTEM_CONFIG

    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
             _system_config=LOCAL_RAY_SYSTEM_CONFIG)  # as a run starts it
    yield ray
    ray.shutdown()
