"""The `tracking` check before Ray (`relax.runner.preflight`, `relax.tracking.mlflow_run.sqlite_store_problem`): a
sqlite tracking.uri whose database cannot be created or written is named before anything starts, by a dry run and by
the real start alike, exit 2. Before, the dry run passed ("every check a start runs before Ray passed") and the real
start found the problem only when it opened the MLflow run, after Ray had started.

Each verdict of the check is compared with the real MLflow sqlite store: `Tracker.start` on the same URI fails
exactly where the check names a problem (and succeeds where it names none: the negative control of each case)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

import pytest
from relax_train_inprocess import relax_train

from relax.config.schema import TrackingConfig
from relax.tracking.mlflow_run import Tracker, TrackingUnavailable
from relax.tracking.run_options import RunOptions

SMALL = ["train.num_rollout=1", "tracking.progress=false", "tracking.system_metrics=false"]


def _layout(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "a_file").write_text("not a directory")
    (tmp_path / "db_is_dir.db").mkdir()
    existing = tmp_path / "existing"
    existing.mkdir()
    return {
        "new file, existing directory": f"sqlite:///{tmp_path}/mlflow.db",
        "directories to create": f"sqlite:///{tmp_path}/x/y/mlflow.db",
        "a directory under /proc": "sqlite:////proc/nope/mlflow.db",
        "a file where a directory must be": f"sqlite:///{tmp_path}/a_file/mlflow.db",
        "the database path is a directory": f"sqlite:///{tmp_path}/db_is_dir.db",
    }


def _opens(uri: str, with_mlflow: bool) -> tuple[bool, str]:
    """Whether a run can be recorded in store `uri`: by MLflow itself (`Tracker.start`), or where MLflow retries for
    minutes before it gives up (a directory in place of the database file) as it does it: the directories made, the
    database opened by sqlite and written."""
    if with_mlflow:
        try:
            Tracker.start(TrackingConfig(uri=uri, experiment="probe"),
                          RunOptions(background=False, announce=False)).finish()
        except TrackingUnavailable as exc:
            return False, str(exc)
        return True, ""
    path = uri[len("sqlite:///"):]
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with contextlib.closing(sqlite3.connect(path)) as db:
            db.execute("create table t (x)")
    except (OSError, sqlite3.Error) as exc:
        return False, str(exc)
    return True, ""


@pytest.mark.parametrize("case", ["new file, existing directory", "directories to create", "a directory under /proc",
                                  "a file where a directory must be", "the database path is a directory"])
def test_the_check_agrees_with_the_real_store(tmp_path: Path, case: str):
    uri = _layout(tmp_path)[case]
    from relax.tracking.mlflow_run import sqlite_store_problem  # here: the module's other tests run without it

    before = sorted(os.listdir(tmp_path))
    problem = sqlite_store_problem(uri)
    assert sorted(os.listdir(tmp_path)) == before  # the check changed nothing
    opened, why = _opens(uri, with_mlflow=case != "the database path is a directory")
    assert (problem is None) == opened, (problem, why)
    if problem is not None:
        assert problem.startswith(f"tracking.uri={uri}: the MLflow store ") and "tracking.enabled=false" in problem


def test_an_existing_store_passes(tmp_path: Path):
    from relax.tracking.mlflow_run import sqlite_store_problem

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    Tracker.start(TrackingConfig(uri=uri, experiment="probe"), RunOptions(background=False, announce=False)).finish()
    assert sqlite_store_problem(uri) is None
    assert sqlite_store_problem("http://127.0.0.1:5000") is None  # a server: the endpoints check's


def test_dry_run_and_the_real_start_stop_before_ray_with_the_same_error(tmp_path: Path, monkeypatch, capfd):
    import ray

    monkeypatch.chdir(tmp_path)
    inits = []  # ray.init's calls (ray.is_initialized() may be true from an earlier test on this xdist worker)
    monkeypatch.setattr(ray, "init", lambda *a, **k: inits.append(k) or pytest.fail("ray.init was called"))
    bad = "tracking.uri=sqlite:////proc/nope/mlflow.db"
    code, out, err = relax_train([bad, "dry_run=true", *SMALL], capfd)
    assert code == 2, out + err
    (line,) = [x for x in out.splitlines() if " tracking " in x]
    assert line.split()[:2] == ["failed", "tracking"], line
    expected = ("tracking.uri=sqlite:////proc/nope/mlflow.db: the MLflow store /proc/nope/mlflow.db cannot be "
                "created (/proc/nope does not exist): nothing can be created in /proc")
    assert f"relax-train: error: dry run: a start would stop before Ray: {expected}" in err
    assert "every check a start runs before Ray passed" not in out
    code, out, err = relax_train([bad, *SMALL], capfd)  # the real start
    assert code == 2, out + err
    assert f"relax-train: error: {expected}" in err and "Traceback" not in err
    assert inits == []  # stopped before Ray
    # control: a writable store passes the dry run
    code, out, err = relax_train([f"tracking.uri=sqlite:///{tmp_path}/ok/mlflow.db", "dry_run=true", *SMALL], capfd)
    assert code == 0, out + err
    assert [x.split()[:2] for x in out.splitlines() if " tracking " in x] == [["ok", "tracking"]]
    assert not (tmp_path / "ok").exists()  # a dry run creates nothing


@pytest.mark.parametrize("form", ["file:", "path"])
def test_a_file_store_mlflow_refuses_stops_the_dry_run_and_the_start_before_ray(tmp_path: Path, monkeypatch, capfd,
                                                                               form: str):
    """A `file:` or plain-path tracking.uri is MLflow's file store, which MLflow 3 refuses unless
    MLFLOW_ALLOW_FILE_STORE=true. Before, the `tracking` check passed it (it looked at sqlite stores only) and the
    start stopped when it opened the run, once Ray was up; now the dry run and the real start stop before Ray with
    the message the store's opening gives (`Tracker.start`, MLflow's own refusal: the independent side), exit 2, and
    create nothing. Control: with MLflow's opt-in the same dry run passes."""
    import ray

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    inits = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: inits.append(k) or pytest.fail("ray.init was called"))
    store = tmp_path / "mlruns"
    uri = f"file:{store}" if form == "file:" else str(store)
    with pytest.raises(TrackingUnavailable) as opened:
        Tracker.start(TrackingConfig(uri=uri, experiment="probe"), RunOptions(background=False, announce=False))
    expected = str(opened.value)
    assert expected.startswith(f"tracking.uri={uri}: the MLflow store ") and "MLFLOW_ALLOW_FILE_STORE=true" in expected
    code, out, err = relax_train([f"tracking.uri={uri}", "dry_run=true", *SMALL], capfd)
    assert code == 2, out + err
    (line,) = [x for x in out.splitlines() if " tracking " in x]
    assert line.split()[:2] == ["failed", "tracking"], line
    assert f"relax-train: error: dry run: a start would stop before Ray: {expected}" in err
    code, out, err = relax_train([f"tracking.uri={uri}", *SMALL], capfd)  # the real start
    assert code == 2, out + err
    assert f"relax-train: error: {expected}" in err and "Traceback" not in err
    assert inits == [] and not store.exists()  # stopped before Ray; nothing created
    # control: MLflow's opt-in makes it a store MLflow accepts, and the check says nothing against it
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    code, out, err = relax_train([f"tracking.uri={uri}", "dry_run=true", *SMALL], capfd)
    assert code == 0, out + err
    assert "tracking" not in err and not store.exists()
