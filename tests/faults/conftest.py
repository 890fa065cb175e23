"""Fixtures of the fault tests: a local Ray and a fast run's overrides."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray for this module (or the one a module of another directory already started)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture
def small_run(tmp_path):
    """Overrides of a fast run on the tiny model, tracked in a store inside tmp_path (as tests/runner's)."""

    def make(*extra: str, steps: int = 2) -> list[str]:
        return [
            f"train.num_rollout={steps}",
            "rollout.rollout_batch_size=4",
            "rollout.n_samples_per_prompt=4",
            "train.micro_batch_size=8",
            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
            "tracking.progress=false",
            f"train.save_dir={tmp_path}/ckpt",
            *extra,
        ]

    return make
