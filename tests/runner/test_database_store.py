"""A tracking.uri naming an MLflow database store on a server (postgresql://, mysql://, mssql://, with or without a
driver: postgresql+psycopg2://) is checked before anything starts: the SQLAlchemy driver it selects must import here
(preflight's `tracking` check, `relax.tracking.db_store.driver_problem`), and its server must accept a TCP connection
(the `endpoints` check, at the engine's default port where the URI names none). Before, neither was checked: a dry
run passed, and a real start set the previous run's checkpoints aside into `earlier/`, started Ray, then crashed in
MLflow with a traceback (No module named 'psycopg'). A start whose MLflow run still fails to open (the store went away
between the check and the start) moves those checkpoints back."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from relax_train_inprocess import relax_train

from relax.config import load_config
from relax.config.credentials import without_secrets
from relax.runner.endpoints import endpoint_targets
from relax.runner.preflight import preflight
from relax.tracking.db_store import driver_problem

QUICK = ["tracking.progress=false", "tracking.system_metrics=false"]


def _driver_module(uri: str) -> str:
    """The DBAPI module SQLAlchemy's dialect for `uri` imports, from its own dialect table (an independent check of
    what `driver_problem` reports)."""
    from sqlalchemy.engine.url import make_url

    return {"psycopg": "psycopg", "psycopg2": "psycopg2", "mysqldb": "MySQLdb", "pymysql": "pymysql",
            "pyodbc": "pyodbc"}[make_url(uri).get_dialect().driver]


@pytest.mark.parametrize("uri", ["postgresql://u@127.0.0.1:1/db", "postgresql+psycopg2://u@127.0.0.1/db",
                                 "mysql://u@127.0.0.1/db", "mysql+pymysql://u@127.0.0.1/db", "mssql://127.0.0.1/db"])
def test_a_missing_driver_is_named_exactly_when_it_does_not_import(uri):
    module = _driver_module(uri)
    problem = driver_problem(uri)
    assert (problem is None) == (importlib.util.find_spec(module) is not None), problem
    if problem is not None:
        assert problem.startswith(f"tracking.uri={without_secrets(uri)}: ")
        assert repr(module) in problem and "pip install" in problem


def test_what_is_no_database_server_is_not_the_drivers_check():
    for uri in ("sqlite:///mlflow.db", "http://127.0.0.1:5000", "/tmp/mlruns", "file:///tmp/mlruns"):
        assert driver_problem(uri) is None
    assert "no driver 'postgresql+nosuch'" in driver_problem("postgresql+nosuch://h/db")


def test_the_database_server_is_probed_at_its_port_and_a_refused_one_is_named_without_its_secrets(
        closed_port, tmp_path):
    port = closed_port()
    cfg = load_config([f"tracking.uri='mysql://relax@127.0.0.1:{port}/mlflow?token=s3cret'"])
    [target] = endpoint_targets(cfg)
    assert (target.host, target.port, target.tracking_store) == ("127.0.0.1", port, True)
    assert [(t.host, t.port) for t in endpoint_targets(load_config(["tracking.uri=postgresql://db.internal/m"]))] \
        == [("db.internal", 5432)]
    assert endpoint_targets(load_config(["tracking.uri=mssql+pyodbc://db/m", "tracking.enabled=false"])) == []
    pre = preflight(cfg, only=("endpoints",))
    text = pre.problems["endpoints"]
    assert text.startswith(f"tracking.uri=mysql://***@127.0.0.1:{port}/mlflow?***: connection to 127.0.0.1:{port} "
                           "refused"), text
    assert "s3cret" not in text and "relax@" not in text


@pytest.mark.skipif(importlib.util.find_spec("psycopg") is not None, reason="needs postgresql's driver missing")
def test_relax_train_refuses_a_database_store_before_anything_moves(closed_port, capfd, tmp_path):
    """The reviewer's case: one line, exit 2, the earlier run's checkpoint where it was, for the dry run and the real
    start alike."""
    save_dir = tmp_path / "ckpt"
    _earlier_checkpoint(save_dir)
    port = closed_port()
    uri = f"postgresql://u@127.0.0.1:{port}/db"
    for dry in ("true", "false"):
        code, out, err = relax_train([f"tracking.uri={uri}", "train.num_rollout=2", f"train.save_dir={save_dir}",
                                      f"dry_run={dry}", f"hydra.run.dir={tmp_path / 'out'}", *QUICK], capfd)
        assert code == 2, out + err
        assert "Traceback" not in out + err
        assert "No module named" not in out + err and "no module named 'psycopg'" in err
        assert f"connection to 127.0.0.1:{port} refused" in err  # both problems at once
        assert (save_dir / "step_000004" / "state.json").is_file() and not (save_dir / "earlier").exists()


def _earlier_checkpoint(save_dir: Path) -> None:
    """A committed checkpoint of an earlier run (what `relax.runner.checkpoint` reads of one: its state.json)."""
    (save_dir / "step_000004").mkdir(parents=True)
    (save_dir / "step_000004" / "state.json").write_text(json.dumps({"step": 4, "lineage": "feedbeef"}))


def test_a_run_whose_store_fails_at_start_moves_the_earlier_checkpoints_back(closed_port, tmp_path, capsys):
    """Past the checks (the store's driver uninstalled, or its server gone, in between): `Session` fails to open the
    MLflow run with a one-line RunError, and the checkpoints the fresh run set aside are back in place. Negative
    control: on the code before, Tracker.start raised the driver's ModuleNotFoundError and `earlier/` kept them."""
    from relax.runner.checkpoint import Checkpoints
    from relax.runner.errors import RunError
    from relax.runner.plan import build_plan
    from relax.runner.session import Session

    save_dir = tmp_path / "ckpt"
    _earlier_checkpoint(save_dir)
    (save_dir / "earlier" / "other").mkdir(parents=True)  # an older run set aside before: left alone
    cfg = load_config([f"tracking.uri=postgresql+nosuchdriver_x://u@127.0.0.1:{closed_port()}/db",
                       f"train.save_dir={save_dir}", "train.num_rollout=2", *QUICK])
    with Checkpoints(cfg) as checkpoints:
        assert not (save_dir / "step_000004").exists()
        assert (save_dir / "earlier" / "feedbeef" / "step_000004" / "state.json").is_file()
        with pytest.raises(RunError, match="postgresql"):
            with Session(cfg, build_plan(cfg), tmp_path / "out", checkpoints=checkpoints):
                pass
    assert json.loads((save_dir / "step_000004" / "state.json").read_text())["step"] == 4
    assert sorted(p.name for p in (save_dir / "earlier").iterdir()) == ["other"]
    assert "moved back" in capsys.readouterr().err
