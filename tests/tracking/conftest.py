"""One sqlite MLflow store for the whole tracking test session; each test gets its own experiment.

Creating an MLflow sqlite schema runs ~60 alembic migrations (5-10 s on a small CPU), so a freshly
migrated database is kept in pytest's cache (keyed by the MLflow version) and copied into tmp dirs.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path

import pytest

from relax.config.schema import TrackingConfig


def _template_db(cache_dir: Path) -> Path:
    import mlflow
    from mlflow import MlflowClient

    from relax.tracking.mlflow_run import quiet_mlflow_logging

    template = cache_dir / f"mlflow-{mlflow.__version__}.db"
    if not template.exists():
        quiet_mlflow_logging()
        tmp = cache_dir / f"building-{os.getpid()}.db"
        with warnings.catch_warnings():  # SQLAlchemy deprecation noise from MLflow's models
            warnings.simplefilter("ignore", DeprecationWarning)
            MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments()  # creates the schema
        os.replace(tmp, template)
    return template


@pytest.fixture(scope="session")
def mlflow_db(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An absolute path to a migrated, empty-ish sqlite MLflow store in a session tmp dir."""
    try:
        cache_dir = Path(request.config.cache.mkdir("relax-mlflow-template"))
    except Exception:  # cache disabled (-p no:cacheprovider)
        cache_dir = tmp_path_factory.mktemp("mlflow-template")
    db = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    shutil.copyfile(_template_db(cache_dir), db)
    return db


@pytest.fixture
def tracking_cfg(mlflow_db: Path, request: pytest.FixtureRequest) -> TrackingConfig:
    """`sqlite:///{tmp}/mlflow.db` with an experiment named after the test, so tests do not see each other."""
    experiment = re.sub(r"[^\w.-]+", "_", request.node.name)
    return TrackingConfig(uri=f"sqlite:///{mlflow_db}", experiment=experiment)
