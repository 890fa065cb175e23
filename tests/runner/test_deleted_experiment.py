"""tracking.experiment naming an experiment deleted in the store (`mlflow experiments delete`) is refused before
anything starts (preflight's `tracking` check, `relax.tracking.mlflow_run.experiment_problem`), by the dry run and the
real start alike, in one line with the restore command; and where the start still meets it (the experiment deleted
after the check), `Tracker.start` raises it as TrackingRefused, which relax-train reports in one line. Before, the dry
run passed and the start failed after Ray with a RuntimeError traceback. The store is a real MLflow sqlite store."""

from __future__ import annotations

from pathlib import Path

import pytest
from relax_train_inprocess import relax_train

from relax.config import load_config
from relax.config.schema import TrackingConfig
from relax.runner.errors import RunError
from relax.runner.preflight import preflight
from relax.tracking.mlflow_run import Tracker, TrackingUnavailable
from relax.tracking.run_options import RunOptions

QUICK = ["tracking.progress=false", "tracking.system_metrics=false"]


@pytest.fixture()
def store(tmp_path: Path) -> tuple[str, str]:
    """A sqlite store with experiment 'gone' deleted and 'kept' live; (its URI, the id of 'gone')."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    gone = client.create_experiment("gone")
    client.create_experiment("kept")
    client.delete_experiment(gone)
    return uri, gone


def _start_error(uri: str, experiment: str) -> str | None:
    """What the real start says when it opens a run in `experiment` (None: it opened one)."""
    try:
        Tracker.start(TrackingConfig(uri=uri, experiment=experiment), RunOptions(background=False, announce=False)
                      ).finish()
    except TrackingUnavailable as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("experiment", ["gone", "kept", "new"])
def test_the_check_agrees_with_the_real_start(store, experiment):
    uri, gone = store
    pre = preflight(load_config([f"tracking.uri={uri}", f"tracking.experiment={experiment}"]), only=("tracking",))
    problem = pre.problems.get("tracking")
    said = _start_error(uri, experiment)  # after the check: it opens (or creates) the experiment
    assert (problem is None) == (said is None), (problem, said)
    if problem is not None:
        assert problem == f"tracking.experiment={experiment}: {said}"
        assert f"is deleted in {uri}; restore it (mlflow experiments restore --experiment-id {gone})" in problem


def test_a_store_that_is_not_there_is_not_created_by_the_check(tmp_path):
    pre = preflight(load_config([f"tracking.uri=sqlite:///{tmp_path}/new/mlflow.db", "tracking.experiment=gone"]),
                    only=("tracking",))
    assert pre.ok and not (tmp_path / "new").exists()


def test_relax_train_refuses_a_deleted_experiment_in_one_line(store, capfd, tmp_path):
    uri, gone = store
    for dry in ("true", "false"):
        code, out, err = relax_train([f"tracking.uri={uri}", "tracking.experiment=gone", "train.num_rollout=1",
                                      "train.save=false", f"dry_run={dry}", f"hydra.run.dir={tmp_path / 'out'}",
                                      *QUICK], capfd)
        assert code == 2, out + err
        assert "Traceback" not in out + err
        assert f"tracking.experiment=gone: MLflow experiment 'gone' (id {gone}) is deleted" in err


def test_a_deleted_experiment_met_at_the_start_is_a_run_error(store, tmp_path):
    """Past the check (deleted in between): `Session` raises the one-line RunError relax-train prints. Negative
    control: on the code before, Tracker.start raised a bare RuntimeError (a traceback)."""
    from relax.runner.plan import build_plan
    from relax.runner.session import Session

    uri, gone = store
    cfg = load_config([f"tracking.uri={uri}", "tracking.experiment=gone", "train.save=false", *QUICK])
    with pytest.raises(RunError, match=f"experiment 'gone' \\(id {gone}\\) is deleted"):
        with Session(cfg, build_plan(cfg), tmp_path / "out"):
            pass
