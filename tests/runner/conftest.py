"""One local Ray instance for the whole module: runs reuse it instead of starting their own."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_local():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def small_run(tmp_path):
    """Overrides of a fast run on the tiny model, tracked in a store inside tmp_path."""

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
