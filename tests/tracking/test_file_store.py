"""A file store (tracking.uri a plain directory or `file:`; docs/operations.md lists it as accepted) is refused by
MLflow 3 itself unless MLFLOW_ALLOW_FILE_STORE=true. relax-train, relax-verify-run and relax-compare then say so and
what to use instead, as an error without a traceback (relax-train showed MLflow's exception with Hydra's traceback
note; relax-verify-run said the run was not in the store). The refusal is MLflow's own, from the installed version."""

from __future__ import annotations

import pytest

from relax.config.schema import TrackingConfig
from relax.tracking import RunOptions, Tracker
from relax.tracking.compare import CompareError, compare
from relax.tracking.mlflow_run import TrackingUnavailable
from relax.tracking.verify import VerifyError, read_run

QUIET = RunOptions(announce=False)


@pytest.fixture
def no_opt_in(monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return monkeypatch


def _advice(text: str, store: str, exists: bool = False) -> bool:
    what = ("is a file store (a directory)" if exists
            else "does not exist; as a path it names a file store (a directory)")
    return (f"the MLflow store {store} {what}, which MLflow " in text
            and f"use a database store, e.g. sqlite:///{store.removeprefix('file://')}/mlflow.db" in text
            and "or set MLFLOW_ALLOW_FILE_STORE=true to use it anyway" in text)


@pytest.mark.parametrize("form", ["path", "file:"])
def test_a_file_store_is_refused_with_what_to_use_instead(no_opt_in, tmp_path, form):
    store = str(tmp_path / "store")
    uri = store if form == "path" else f"file:{store}"
    shown = store if form == "path" else f"file://{store}"
    cfg = TrackingConfig(uri=uri, experiment="file-store")
    with pytest.raises(TrackingUnavailable) as start:
        Tracker.start(cfg, QUIET)
    assert str(start.value).startswith(f"tracking.uri={uri}: ") and _advice(str(start.value), shown)
    with pytest.raises(TrackingUnavailable) as reopen:
        Tracker.reopen(cfg, "0123456789abcdef", QUIET)
    assert _advice(str(reopen.value), shown)
    with pytest.raises(VerifyError) as verify:
        read_run(uri, "0123456789abcdef", "ledger.jsonl")
    assert _advice(str(verify.value), shown)
    with pytest.raises(CompareError) as comp:
        compare(uri=uri, out_dir=str(tmp_path / "compare"), log=False)
    assert _advice(str(comp.value), shown)
    (tmp_path / "store").mkdir()  # a directory there: it is a file store
    with pytest.raises(TrackingUnavailable) as start:
        Tracker.start(cfg, QUIET)
    assert _advice(str(start.value), shown, exists=True)


def test_control_with_mlflows_opt_in_the_file_store_works(no_opt_in, tmp_path):
    """The advice holds: with MLFLOW_ALLOW_FILE_STORE=true the same store records a run."""
    no_opt_in.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    with Tracker.start(TrackingConfig(uri=str(tmp_path / "store"), experiment="file-store"), QUIET) as tracker:
        tracker.log_metrics({"x": 1.0}, 0)
    assert (tmp_path / "store").is_dir()
