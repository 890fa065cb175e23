from __future__ import annotations

import dataclasses
import inspect
import io
import logging
import math
import os
from pathlib import Path
from typing import Any, Optional

import pytest
from mlflow import MlflowClient

from relax.config.schema import RelaxConfig, TrackingConfig
from relax.tracking import (
    NullTracker,
    RunOptions,
    Tracker,
    flatten_config,
    resolve_tracking_uri,
    standard_tags,
    start_tracker,
)
from relax.tracking import mlflow_run as M
from relax.tracking.params import PARAM_VALUE_MAX_LEN, TRUNCATION_MARKER


def start(cfg: TrackingConfig, *, run_name: Optional[str] = "test", tags: Optional[dict[str, str]] = None,
          params: Optional[dict[str, str]] = None, parent_run_id: Optional[str] = None, **options: Any) -> Tracker:
    """`Tracker.start` of a run named "test", without tags, params or the start line; `options`: `RunOptions` fields."""
    options.setdefault("announce", False)
    return Tracker.start(cfg, RunOptions(**options), run_name=run_name, tags={} if tags is None else tags,
                         params={} if params is None else params, parent_run_id=parent_run_id)


def reopen(cfg: TrackingConfig) -> MlflowClient:
    """A second client on the same store, to check what is really in the database."""
    return MlflowClient(tracking_uri=cfg.uri)


class CountingClient:
    """Wraps MlflowClient.log_batch to record the sizes of every call."""

    def __init__(self, tracker: Tracker) -> None:
        self.calls: list[tuple[int, int, int]] = []
        real = tracker.client.log_batch

        def log_batch(run_id: str, metrics: Any = (), params: Any = (), tags: Any = (), synchronous: Any = None):
            self.calls.append((len(metrics), len(params), len(tags)))
            return real(run_id, metrics=metrics, params=params, tags=tags, synchronous=synchronous)

        tracker.client.log_batch = log_batch  # type: ignore[method-assign]


def test_limits_match_mlflow() -> None:
    from mlflow.utils import validation

    assert M.MAX_METRICS_PER_BATCH == validation.MAX_METRICS_PER_BATCH
    assert M.MAX_PARAMS_TAGS_PER_BATCH == validation.MAX_PARAMS_TAGS_PER_BATCH
    assert M.MAX_TAG_VALUE_LEN == validation.MAX_TAG_VAL_LENGTH


def test_params_and_tags_logged(tracking_cfg: TrackingConfig) -> None:
    cfg = RelaxConfig(seed=3)
    params = flatten_config(cfg)
    params.update({f"extra.p{i:03d}": str(i) for i in range(150)})  # > 100: several batches
    params["extra.long"] = "z" * (PARAM_VALUE_MAX_LEN + 100)
    params = flatten_config(params)  # truncation happens in flatten_config
    stream = io.StringIO()
    with start(tracking_cfg, tags=standard_tags(cfg), params=params, announce=True, stream=stream) as tracker:
        run_id = tracker.run_id
    assert run_id in stream.getvalue() and f"mlflow ui --backend-store-uri {tracking_cfg.uri}" in stream.getvalue()
    run = reopen(tracking_cfg).get_run(run_id)
    logged = run.data.params
    assert logged == params
    assert logged["algorithm.eps_clip"] == "0.2"
    assert logged["algorithm.eps_clip_high"] == "None"
    assert logged["rollout.n_samples_per_prompt"] == "8"
    assert logged["seed"] == "3"
    assert logged["extra.long"].endswith(TRUNCATION_MARKER) and len(logged["extra.long"]) == PARAM_VALUE_MAX_LEN
    tags = run.data.tags
    for key, value in standard_tags(cfg).items():
        assert tags[key] == value
    assert tags["arm"] == "grpo" and tags["seed"] == "3"
    assert tags["mlflow.runName"] == "test"
    assert "mlflow.parentRunId" not in tags
    assert run.info.status == "FINISHED"
    assert reopen(tracking_cfg).get_experiment(run.info.experiment_id).name == tracking_cfg.experiment


def test_params_chunked_to_100(tracking_cfg: TrackingConfig) -> None:
    tracker = start(tracking_cfg)
    counter = CountingClient(tracker)
    tracker.log_params({f"p{i}": str(i) for i in range(250)})
    tracker.set_tags({f"t{i}": str(i) for i in range(120)})
    tracker.finish()
    assert counter.calls == [(0, 100, 0), (0, 100, 0), (0, 50, 0), (0, 0, 100), (0, 0, 20)]
    assert len(reopen(tracking_cfg).get_run(tracker.run_id).data.params) == 250


def test_metrics_batched_and_complete(tracking_cfg: TrackingConfig) -> None:
    tracker = start(tracking_cfg, flush_every_steps=10, flush_interval_s=1e9, background=False)
    counter = CountingClient(tracker)
    keys = [f"train/m{i}" for i in range(12)]
    client = reopen(tracking_cfg)
    for step in range(250):
        tracker.log_metrics({k: step + i / 100 for i, k in enumerate(keys)}, step=step)
        if step == 4:  # nothing written before the first flush is due
            assert client.get_metric_history(tracker.run_id, "train/m0") == []
    tracker.finish()
    assert counter.calls == [(120, 0, 0)] * 25  # one log_batch per 10 steps
    for i, key in enumerate(keys):
        history = sorted(client.get_metric_history(tracker.run_id, key), key=lambda m: m.step)
        assert [m.step for m in history] == list(range(250))
        assert [m.value for m in history] == [step + i / 100 for step in range(250)]
    assert client.get_run(tracker.run_id).data.metrics["train/m3"] == 249.03  # latest value


def test_metric_batches_respect_1000_limit(tracking_cfg: TrackingConfig) -> None:
    tracker = start(tracking_cfg, flush_every_steps=100, flush_interval_s=1e9, background=False)
    counter = CountingClient(tracker)
    for step in range(100):
        tracker.log_metrics({f"m{i}": float(i) for i in range(25)}, step=step)
    assert counter.calls == [(1000, 0, 0), (1000, 0, 0), (500, 0, 0)]
    tracker.finish()
    assert len(reopen(tracking_cfg).get_metric_history(tracker.run_id, "m24")) == 100


def test_flush_by_time_and_explicit(tracking_cfg: TrackingConfig) -> None:
    tracker = start(tracking_cfg, flush_every_steps=1000, flush_interval_s=0.0, background=False)
    client = reopen(tracking_cfg)
    tracker.log_metrics({"a": 1.0}, step=1)  # interval 0: due at once
    assert [m.value for m in client.get_metric_history(tracker.run_id, "a")] == [1.0]
    tracker.flush_interval_s = 1e9
    tracker.log_metrics({"a": 2.0}, step=2)
    assert len(client.get_metric_history(tracker.run_id, "a")) == 1
    tracker.flush()
    assert len(client.get_metric_history(tracker.run_id, "a")) == 2
    tracker.finish()


def test_background_writer_lands_everything(tracking_cfg: TrackingConfig) -> None:
    with start(tracking_cfg, flush_every_steps=5, background=True) as tracker:
        assert tracker._writer is not None and tracker._writer.is_alive()
        for step in range(250):
            tracker.log_metrics({f"m{i}": step * 1.0 for i in range(12)}, step=step)
    assert not tracker._writer.is_alive()
    assert tracker.stats["metrics"] == 3000
    history = reopen(tracking_cfg).get_metric_history(tracker.run_id, "m11")
    assert sorted(m.step for m in history) == list(range(250))


def test_metric_values_converted(tracking_cfg: TrackingConfig) -> None:
    import numpy as np
    import torch

    with start(tracking_cfg, background=False) as tracker:
        tracker.log_metrics({"t": torch.tensor(0.5), "n": np.float32(0.25), "i": 3, "b": True}, step=0)
    metrics = reopen(tracking_cfg).get_run(tracker.run_id).data.metrics
    assert metrics == {"t": 0.5, "n": 0.25, "i": 3.0, "b": 1.0}


def test_bad_metric_key_fails_early(tracking_cfg: TrackingConfig) -> None:
    with start(tracking_cfg, background=False) as tracker:
        with pytest.raises(ValueError, match="invalid metric key"):
            tracker.log_metrics({"bad|key": 1.0}, step=0)
        tracker.log_metrics({"good/key": 1.0}, step=0)
    assert "good/key" in reopen(tracking_cfg).get_run(tracker.run_id).data.metrics


def test_nonfinite_skipped_by_default(tracking_cfg: TrackingConfig, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="relax.tracking.mlflow_run"):
        with start(tracking_cfg, background=False) as tracker:
            for step, value in enumerate([1.0, math.nan, math.inf, 2.0, math.nan]):
                tracker.log_metrics({"train/loss": value, "ok": 1.0}, step=step)
    assert tracker.nonfinite_counts == {"train/loss": 3}
    assert sum("train/loss" in r.getMessage() for r in caplog.records) == 1  # warned once per key
    client = reopen(tracking_cfg)
    history = sorted(client.get_metric_history(tracker.run_id, "train/loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [(0, 1.0), (3, 2.0)]
    assert client.get_run(tracker.run_id).data.tags[M.NONFINITE_TAG] == "train/loss=3"


def test_nonfinite_logged_on_request(tracking_cfg: TrackingConfig) -> None:
    with start(tracking_cfg, nonfinite="log", background=False) as tracker:
        tracker.log_metrics({"x": math.nan}, step=0)
        tracker.log_metrics({"x": 1.0}, step=1)
    history = sorted(reopen(tracking_cfg).get_metric_history(tracker.run_id, "x"), key=lambda m: m.step)
    assert math.isnan(history[0].value) and history[1].value == 1.0
    with pytest.raises(ValueError):
        start(tracking_cfg, nonfinite="drop")


def test_a_nonfinite_metric_is_named_with_mlflows_step(tracking_cfg: TrackingConfig, caplog) -> None:
    """The warning names the step as MLflow records it (0-based; the progress line's step 1 is MLflow's step 0)."""
    with caplog.at_level("WARNING", logger="relax.tracking.mlflow_run"):
        with start(tracking_cfg, nonfinite="log", background=False) as tracker:
            tracker.log_metrics({"x": 1.0}, step=0)
            tracker.log_metrics({"x": math.inf}, step=1)
    assert [r.getMessage() for r in caplog.records if "is inf" in r.getMessage()] == \
        ["metric x is inf at MLflow step 1 (logged)"]


def test_text_and_file_artifacts(tracking_cfg: TrackingConfig, tmp_path: Path) -> None:
    local = tmp_path / "plan.json"
    local.write_text('{"roles": ["actor"]}')
    with start(tracking_cfg) as tracker:
        tracker.log_text("algorithm:\n  name: grpo\n", "config.yaml")
        tracker.log_text("actor: 1 CPU", "plan.txt")
        tracker.log_artifact(str(local))
    client = reopen(tracking_cfg)
    names = {a.path for a in client.list_artifacts(tracker.run_id)}
    assert names == {"config.yaml", "plan.txt", "plan.json"}
    out = client.download_artifacts(tracker.run_id, "config.yaml", str(tmp_path / "dl"))
    assert Path(out).read_text() == "algorithm:\n  name: grpo\n"
    # artifacts live next to the database, not in whatever the cwd was
    artifact_uri = client.get_run(tracker.run_id).info.artifact_uri
    assert artifact_uri.startswith(str(Path(M.sqlite_path(tracking_cfg.uri)).parent / "mlruns"))


@pytest.mark.parametrize(
    "exc, status", [(RuntimeError("boom"), "FAILED"), (KeyboardInterrupt(), "KILLED"), (SystemExit(0), "FINISHED")]
)
def test_context_manager_status(tracking_cfg: TrackingConfig, exc: BaseException, status: str) -> None:
    with pytest.raises(type(exc)):
        with start(tracking_cfg, background=False) as tracker:
            tracker.log_metrics({"a": 1.0}, step=0)
            raise exc
    run = reopen(tracking_cfg).get_run(tracker.run_id)
    assert run.info.status == status
    assert run.data.metrics == {"a": 1.0}  # flushed on the way out


def test_finish_idempotent_and_later_calls_ignored(tracking_cfg: TrackingConfig) -> None:
    tracker = start(tracking_cfg)
    tracker.finish("KILLED")
    tracker.finish("FINISHED")  # no effect
    tracker.log_metrics({"a": 1.0}, step=0)  # ignored with a warning
    tracker.set_tags({"late": "1"})
    tracker.flush()
    with pytest.raises(ValueError):
        tracker.finish("DONE")
    run = reopen(tracking_cfg).get_run(tracker.run_id)
    assert tracker.status == "KILLED" and run.info.status == "KILLED"
    assert run.data.metrics == {} and "late" not in run.data.tags


def test_parent_run_id_nests_child(tracking_cfg: TrackingConfig) -> None:
    with start(tracking_cfg, run_name="sweep") as parent:
        with start(tracking_cfg, run_name="job-0", parent_run_id=parent.run_id) as child:
            assert child.experiment_id == parent.experiment_id
    client = reopen(tracking_cfg)
    assert client.get_run(child.run_id).data.tags["mlflow.parentRunId"] == parent.run_id
    children = client.search_runs([parent.experiment_id], f"tags.mlflow.parentRunId = '{parent.run_id}'")
    assert [r.info.run_id for r in children] == [child.run_id]


def test_run_name_from_config(tracking_cfg: TrackingConfig) -> None:
    cfg = dataclasses.replace(tracking_cfg, run_name="from-config")
    with Tracker.start(cfg, RunOptions(announce=False), run_name=None, tags={}, params={}) as tracker:
        pass
    assert reopen(tracking_cfg).get_run(tracker.run_id).info.run_name == "from-config"


def test_null_tracker_noops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = TrackingConfig(enabled=False)
    tracker = start_tracker(cfg, run_name="x", tags={"a": "b"}, params={"p": "1"})
    assert isinstance(tracker, NullTracker)
    with tracker:
        tracker.log_metrics({"a": 1.0}, step=0)
        tracker.log_params({"p": "1"})
        tracker.log_text("x", "config.yaml")
        tracker.log_artifact("/does/not/exist")
        tracker.set_tags({"a": "b"})
        tracker.flush()
    tracker.finish("FAILED")
    assert tracker.run_id is None and tracker.ui_command() is None
    assert tracker.status == "FINISHED"
    assert list(tmp_path.iterdir()) == []  # no database, no mlruns


def test_null_tracker_start_takes_what_tracker_start_takes() -> None:
    """The loop starts either without an `if`: same parameters, same defaults (a NullTracker needs no config)."""
    real = inspect.signature(Tracker.start).parameters
    null = inspect.signature(NullTracker.start).parameters
    assert list(null) == list(real)
    assert {k: p.default for k, p in null.items() if k != "tracking_cfg"} == {
        k: p.default for k, p in real.items() if k != "tracking_cfg"}
    assert isinstance(NullTracker.start(None, RunOptions(announce=False), run_name="x", tags={}, params={}),
                      NullTracker)


def test_run_options_are_frozen() -> None:
    options = RunOptions(flush_interval_s=1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.flush_interval_s = 2.0  # type: ignore[misc]


def test_start_tracker_enabled(tracking_cfg: TrackingConfig) -> None:
    with start_tracker(tracking_cfg, RunOptions(announce=False), run_name="x", tags={}, params={}) as tracker:
        assert isinstance(tracker, Tracker)


@pytest.mark.parametrize(
    "uri, expected",
    [
        ("sqlite:///mlflow.db", "sqlite:////base/dir/mlflow.db"),
        ("sqlite:///sub/x.db?timeout=30", "sqlite:////base/dir/sub/x.db?timeout=30"),
        ("sqlite:///../up.db", "sqlite:////base/up.db"),
        ("sqlite:////abs/mlflow.db", "sqlite:////abs/mlflow.db"),
        ("sqlite://", "sqlite://"),
        ("sqlite:///:memory:", "sqlite:///:memory:"),
        ("http://tracking:5000", "http://tracking:5000"),
        ("databricks", "databricks"),
        ("mlruns", "/base/dir/mlruns"),
        ("file:./mlruns", "file:///base/dir/mlruns"),
        ("file:///abs/mlruns", "file:///abs/mlruns"),
    ],
)
def test_resolve_tracking_uri(uri: str, expected: str) -> None:
    assert resolve_tracking_uri(uri, cwd="/base/dir") == expected


def test_relative_sqlite_uri_resolved_at_start(
    tracking_cfg: TrackingConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = M.sqlite_path(tracking_cfg.uri)
    monkeypatch.chdir(os.path.dirname(db))
    relative = dataclasses.replace(tracking_cfg, uri="sqlite:///mlflow.db")
    tracker = start(relative, background=False)
    assert tracker.uri == f"sqlite:///{db}" and tracker.uri.startswith("sqlite:////")
    assert tracker.ui_command() == f"mlflow ui --backend-store-uri sqlite:///{db}"
    monkeypatch.chdir(tmp_path)  # e.g. Hydra changing into its run directory
    tracker.log_metrics({"a": 1.0}, step=0)
    tracker.finish()
    assert not (tmp_path / "mlflow.db").exists()
    assert reopen(tracking_cfg).get_run(tracker.run_id).data.metrics == {"a": 1.0}


def test_mlflow_logging_quieted(tracking_cfg: TrackingConfig) -> None:
    start(tracking_cfg).finish()
    for name in ("mlflow.store.db.utils", "alembic"):
        assert logging.getLogger(name).getEffectiveLevel() >= logging.WARNING


def test_deleted_experiment_is_reported(tracking_cfg: TrackingConfig) -> None:
    client = reopen(tracking_cfg)
    client.delete_experiment(client.create_experiment(tracking_cfg.experiment))
    with pytest.raises(RuntimeError, match="deleted"):
        start(tracking_cfg)


def test_tracking_cost_benchmark_runs(tracking_cfg: TrackingConfig) -> None:
    """The cost benchmark (python -m relax.tracking.bench) runs and logs every metric; timing is its report,
    not an assertion."""
    from relax.tracking.bench import measure_tracking_cost

    r = measure_tracking_cost(tracking_cfg.uri, experiment=tracking_cfg.experiment, steps=20, background=True)
    assert r["metrics"] == 20 * 30
    assert r["caller_us_per_step"] > 0 and r["write_ms_per_step"] > 0
