"""The MLflow run of the last job in a checkpoint directory (`<save_dir>/run.json`) is closed in the store it was
recorded in, not in the next job's: `train.save_dir`'s default is shared by the runs of every `tracking.uri`, so
the last job's run is often in another store. Before, the next job asked its own store for the run, was told "not
found" and printed `could not close the earlier run <id>: Run with id=<id> not found` (review-vmr #5), and a killed
job's run in the other store stayed RUNNING. Checked on the `Session` that opens the run, without Ray, with two real
sqlite MLflow stores in one working directory."""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import logging
import shutil
from pathlib import Path

import pytest

from relax.config import load_config
from relax.runner.checkpoint import RUN_FILE, Checkpoints


def _job(cwd: Path, db: Path):
    """A fresh job's checkpoint directory (the default train.save_dir, under `cwd`) and its Session, tracked in `db`."""
    from relax.runner.plan import build_plan
    from relax.runner.session import Session

    cfg = load_config([f"tracking.uri=sqlite:///{db}", "tracking.progress=false"])
    ckpts = Checkpoints(cfg, cwd)
    return ckpts, Session(cfg, build_plan(cfg), cwd / "out", checkpoints=ckpts)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_last_jobs_run_is_closed_in_its_own_store_and_a_finished_one_is_left_in_silence(tmp_path, mlflow_template,
                                                                                          caplog):
    from mlflow import MlflowClient

    a, b = tmp_path / "a.db", tmp_path / "b.db"
    for db in (a, b):
        shutil.copyfile(mlflow_template, db)
    store_a, store_b = MlflowClient(f"sqlite:///{a}"), MlflowClient(f"sqlite:///{b}")

    # job 1, store a: killed (kill -9) before its first checkpoint: nothing closes its run, the kernel drops the lock
    ckpts, session = _job(tmp_path, a)
    ckpts.__enter__()
    killed = session.__enter__()
    atexit.unregister(killed.tracker._at_exit)
    ckpts.__exit__(None, None, None)
    assert store_a.get_run(killed.run_id).info.status == "RUNNING"

    # job 2, store b, same directory: job 1's run is closed in store a, and the note names that store
    caplog.set_level(logging.INFO)
    err = io.StringIO()
    ckpts, session = _job(tmp_path, b)
    with contextlib.redirect_stderr(err), ckpts, session as second:
        pass
    assert store_a.get_run(killed.run_id).info.status == "KILLED"
    assert (f"MLflow run {killed.run_id} (in MLflow store sqlite:///{a}) of the last job in {ckpts.save_dir} was "
            "still RUNNING (that job was killed); marked KILLED") in err.getvalue(), err.getvalue()[-2000:]
    assert store_b.get_run(second.run_id).info.status == "FINISHED"

    # job 3, back in store a: job 2's run, in store b, finished: nothing is said, at any level a console shows
    caplog.clear()
    err = io.StringIO()
    ckpts, session = _job(tmp_path, a)
    with contextlib.redirect_stderr(err), ckpts, session as third:
        pass
    said = [r.getMessage() for r in caplog.records if r.name.startswith("relax") and r.levelno >= logging.INFO]
    assert not [m for m in said if second.run_id in m], said
    assert second.run_id not in err.getvalue(), err.getvalue()[-2000:]
    assert store_b.get_run(second.run_id).info.status == "FINISHED"
    assert store_a.get_run(third.run_id).info.status == "FINISHED"
    assert json.loads((ckpts.save_dir / RUN_FILE).read_text()) == {
        "mlflow_run_id": third.run_id, "tracking_uri": f"sqlite:///{a}", "lineage": ckpts.lineage}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_run_json_without_its_store_is_looked_up_in_this_store_quietly(tmp_path, mlflow_template, caplog):
    """A run.json written before stores were recorded names only the run: it is looked for in this job's store, and
    when that store does not hold it (it was another's), nothing is said."""
    from relax.tracking.mlflow_run import Tracker, close_orphan_run

    b = tmp_path / "b.db"
    shutil.copyfile(mlflow_template, b)
    cfg = load_config([f"tracking.uri=sqlite:///{b}", "tracking.progress=false"])
    caplog.set_level(logging.DEBUG)
    with Tracker.start(cfg.tracking) as tracker:
        assert not close_orphan_run(tracker, "0123456789abcdef0123456789abcdef")
    said = [r.getMessage() for r in caplog.records if r.name.startswith("relax") and r.levelno >= logging.INFO]
    assert not [m for m in said if "0123456789abcdef" in m], said


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_run_of_another_servers_store_is_left_alone(tmp_path, mlflow_template, caplog):
    """Another server's store is not this job's to contact (other credentials, or down): nothing listens at the
    recorded address here, and the job goes on at once, without a word."""
    from relax.tracking.mlflow_run import Tracker, close_orphan_run

    b = tmp_path / "b.db"
    shutil.copyfile(mlflow_template, b)
    cfg = load_config([f"tracking.uri=sqlite:///{b}", "tracking.progress=false"])
    caplog.set_level(logging.DEBUG)
    with Tracker.start(cfg.tracking) as tracker:
        assert close_orphan_run(tracker, "0123456789abcdef0123456789abcdef", "http://127.0.0.1:9") is None
    said = [r.getMessage() for r in caplog.records if r.name.startswith("relax") and r.levelno >= logging.INFO]
    assert not [m for m in said if "0123456789abcdef" in m], said
