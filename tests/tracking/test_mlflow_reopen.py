"""Tracker.reopen: a resumed job continues its MLflow run and records every (key, step) exactly once."""

from __future__ import annotations

import atexit
from collections import Counter

import pytest
from mlflow import MlflowClient

from relax.config.schema import TrackingConfig
from relax.tracking import RunOptions, Tracker
from relax.tracking.mlflow_run import RESUMED_TAG

QUIET = RunOptions(announce=False, background=False)  # no start line; writes in the logging call (deterministic)


def killed_run(cfg: TrackingConfig, steps: dict[int, dict[str, float]], unflushed: dict[int, dict[str, float]]) -> str:
    """A run as `kill -9` leaves it: `steps` written to the store, `unflushed` only buffered, status RUNNING."""
    tracker = Tracker.start(cfg, QUIET, run_name="killed")
    for step, metrics in steps.items():
        tracker.log_metrics(metrics, step)
    tracker.flush()
    for step, metrics in unflushed.items():
        tracker.log_metrics(metrics, step)
    atexit.unregister(tracker._at_exit)  # the process dies here: nothing closes the run, the buffer is lost
    return tracker.run_id


def recorded(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_reopened_run_records_each_step_once_and_keeps_the_first_value(tracking_cfg: TrackingConfig) -> None:
    # steps 0-2 durable (the checkpoint covers 0-1; step 2 was flushed after it, key "b" of step 2 was not logged
    # yet); step 3 only buffered when the process died
    run_id = killed_run(
        tracking_cfg,
        steps={0: {"a": 0.0, "b": 10.0}, 1: {"a": 1.0, "b": 11.0}, 2: {"a": 2.0}},
        unflushed={3: {"a": 3.0, "b": 13.0}},
    )
    client = MlflowClient(tracking_cfg.uri)
    assert client.get_run(run_id).info.status == "RUNNING"

    # the resumed job recomputes from the checkpoint (step 2) on; its values are marked so we can tell them apart
    tracker = Tracker.reopen(tracking_cfg, run_id, QUIET, from_step=2, tags={RESUMED_TAG: "step 2"})
    assert client.get_run(run_id).info.status == "RUNNING"
    with tracker:
        for step in (2, 3, 4):
            tracker.log_metrics({"a": step + 0.5, "b": 10 + step + 0.5}, step)
    assert tracker.stats["already_recorded"] == 1  # ("a", 2) only

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags[RESUMED_TAG] == "step 2"
    a, b = recorded(client, run_id, "a"), recorded(client, run_id, "b")
    assert a == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.5), (4, 4.5)]  # step 2: the killed job's value, written once
    assert b == [(0, 10.0), (1, 11.0), (2, 12.5), (3, 13.5), (4, 14.5)]  # step 2 was missing: written now
    runs = client.search_runs([run.info.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]  # the same run, no new one


def test_reopen_dedups_with_the_background_writer_too(tracking_cfg: TrackingConfig) -> None:
    run_id = killed_run(tracking_cfg, steps={s: {"x": float(s)} for s in range(5)}, unflushed={})
    options = RunOptions(announce=False, flush_interval_s=0.05)  # the background writer, every 50 ms
    with Tracker.reopen(tracking_cfg, run_id, options, from_step=3) as tracker:
        for step in range(3, 8):
            tracker.log_metrics({"x": float(step)}, step)
        tracker.flush()
    steps = [s for s, _ in recorded(MlflowClient(tracking_cfg.uri), run_id, "x")]
    assert Counter(steps) == Counter(range(8))


def test_reopen_returns_the_values_and_tags_the_run_holds(tracking_cfg: TrackingConfig) -> None:
    run_id = killed_run(tracking_cfg, steps={s: {"r": s / 10, "y": 1.0} for s in range(4)}, unflushed={})
    with Tracker.reopen(tracking_cfg, run_id, QUIET, from_step=2, keep_history=("r",)) as tracker:
        # every step the store holds: the caller takes the ones it needs (Session: the rewards before step 2)
        assert tracker.recorded_history == {"r": [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.3)]}
        assert tracker.reopened_tags["mlflow.runName"] == "killed"  # the run's tags as it was found


def test_flush_makes_everything_logged_before_it_durable(tracking_cfg: TrackingConfig) -> None:
    """What a checkpoint relies on: after flush() returns, another client sees every value logged before it."""
    with Tracker.start(tracking_cfg, RunOptions(announce=False, flush_every_steps=1000, flush_interval_s=3600),
                       run_name="durable") as tracker:
        for step in range(20):
            tracker.log_metrics({"k": float(step), "m": 1.0}, step)
        tracker.flush()
        other = MlflowClient(tracking_cfg.uri)
        assert [s for s, _ in recorded(other, tracker.run_id, "k")] == list(range(20))
        assert len(recorded(other, tracker.run_id, "m")) == 20


def test_reopen_of_a_missing_run_is_a_lookup_error(tracking_cfg: TrackingConfig) -> None:
    with pytest.raises(LookupError, match="not in the store"):
        Tracker.reopen(tracking_cfg, "0" * 32, QUIET)


def test_reopen_of_a_deleted_run_is_a_lookup_error(tracking_cfg: TrackingConfig) -> None:
    run_id = killed_run(tracking_cfg, steps={0: {"x": 1.0}}, unflushed={})
    MlflowClient(tracking_cfg.uri).delete_run(run_id)
    with pytest.raises(LookupError, match="deleted"):
        Tracker.reopen(tracking_cfg, run_id, QUIET)


def test_reopen_reads_only_the_histories_it_needs(tracking_cfg: TrackingConfig, monkeypatch) -> None:
    """Reading histories is the only cost of a reopen: keys whose last step is before the resumed step are skipped."""
    run_id = killed_run(tracking_cfg, steps={0: {"old": 1.0, "new": 1.0, "r": 0.5}, 1: {"new": 2.0, "r": 0.6},
                                             2: {"new": 3.0}}, unflushed={})
    queried = []
    real = MlflowClient.get_metric_history

    def counting(self, run_id, key):
        queried.append(key)
        return real(self, run_id, key)

    monkeypatch.setattr(MlflowClient, "get_metric_history", counting)
    with Tracker.reopen(tracking_cfg, run_id, QUIET, from_step=2, keep_history=("r",)) as tracker:
        tracker.log_metrics({"old": 9.0, "new": 9.0}, 2)
    assert sorted(queried) == ["new", "r"]  # "old" ends at step 0; "r" is wanted for its earlier values
    monkeypatch.undo()
    client = MlflowClient(tracking_cfg.uri)
    assert recorded(client, run_id, "new") == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert recorded(client, run_id, "old") == [(0, 1.0), (2, 9.0)]


def test_the_reopened_line_names_the_step_the_run_continues_with_as_the_progress_line_does(
        tracking_cfg: TrackingConfig) -> None:
    """A run resumed from the checkpoint of 2 steps (step_000002) continues with the step its progress line will show
    as `step 3/N`: the line says step 3, and MLflow's step 2 of its metrics (before: `reopened at step 2`)."""
    import io

    from relax.tracking.progress import Progress

    run_id = killed_run(tracking_cfg, steps={0: {"a": 0.0}, 1: {"a": 1.0}}, unflushed={})
    stream = io.StringIO()
    tracker = Tracker.reopen(tracking_cfg, run_id, RunOptions(background=False, stream=stream), from_step=2)
    tracker.finish()
    (line,) = [x for x in stream.getvalue().splitlines() if "reopened" in x]
    assert f"({run_id}) reopened at step 3 (MLflow step 2) in experiment" in line, line
    assert Progress(4, is_tty=False).format_line(3).startswith("step 3/4")  # the progress line after that step
