"""Fixtures shared by the test directories (a module per directory cannot be imported from another: every
directory's `conftest` has the same module name)."""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest


def small_overrides(tmp_path: Path, *extra: str, steps: int = 2) -> list[str]:
    """Overrides of a fast run on the tiny model, tracked in a store inside `tmp_path`, checkpoints in tmp_path/ckpt."""
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


@pytest.fixture
def small_run(tmp_path) -> Callable[..., list[str]]:
    """`small_overrides` in this test's tmp_path: `small_run(*extra, steps=2)`."""

    def make(*extra: str, steps: int = 2) -> list[str]:
        return small_overrides(tmp_path, *extra, steps=steps)

    return make


@pytest.fixture(scope="session")
def run_overrides() -> Callable[..., list[str]]:
    """`small_overrides` itself, for module-scoped fixtures: `run_overrides(directory, *extra, steps=2)`."""
    return small_overrides


@pytest.fixture(scope="session")
def mlflow_template(request, tmp_path_factory) -> Path:
    """A migrated, empty MLflow sqlite store, built once per MLflow version (creating a store runs every schema
    migration: seconds), kept in pytest's cache between sessions."""
    import mlflow
    from mlflow import MlflowClient

    try:
        cache_dir = Path(request.config.cache.mkdir("relax-mlflow-template"))
    except Exception:  # cache disabled
        cache_dir = tmp_path_factory.mktemp("mlflow-template")
    template = cache_dir / f"mlflow-{mlflow.__version__}.db"
    if not template.exists():
        tmp = cache_dir / f"building-{os.getpid()}.db"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments()
        os.replace(tmp, template)
    return template


@pytest.fixture
def fresh_store(mlflow_template) -> Callable[[Path], Path]:
    """`fresh_store(directory)`: `directory/mlflow.db`, an empty migrated store copied from the template."""

    def make(directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        db = directory / "mlflow.db"
        shutil.copyfile(mlflow_template, db)
        return db

    return make


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray for this module (or the one a module of another directory already started)."""
    import ray

    from relax.runner.plan import LOCAL_RAY_SYSTEM_CONFIG

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
                 _system_config=LOCAL_RAY_SYSTEM_CONFIG)  # as a run starts it
    yield ray
    if started:
        ray.shutdown()
