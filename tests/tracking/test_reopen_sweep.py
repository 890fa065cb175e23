"""A sweep resumed by a new `relax-train -m ... train.resume=auto`: its launcher makes a new parent run and sweep id,
and each job reopens its MLflow run (`Tracker.reopen(..., parent_run_id=...)`). The run then belongs to the new
sweep on both counts, its `sweep_id` tag and its `mlflow.parentRunId`, so that relax-compare finds it under the new
sweep and logs to the new parent; the old ones are kept in `relax.previous_*` tags."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from relax.config.schema import TrackingConfig
from relax.tracking import RunOptions, Tracker
from relax.tracking.compare import CompareError, compare
from relax.tracking.mlflow_run import PARENT_RUN_ID_TAG

PREVIOUS_SWEEP_TAG, PREVIOUS_PARENT_TAG = "relax.previous_sweep_id", "relax.previous_parent_run_id"

QUIET = RunOptions(announce=False, background=False)


def sweep_parent(cfg: TrackingConfig, sweep: str) -> str:
    with Tracker.start(cfg, QUIET, run_name=f"sweep-{sweep}", tags={"sweep_id": sweep}) as parent:
        return parent.run_id


def job(cfg: TrackingConfig, sweep: str, parent: str, seed: int) -> str:
    """A finished job of the sweep: rewards at steps 0..2."""
    tags = {"sweep_id": sweep, "seed": str(seed), "arm": "algorithm=grpo"}
    with Tracker.start(cfg, QUIET, tags=tags, parent_run_id=parent) as tracker:
        for step in range(3):
            tracker.log_metrics({"rollout/raw_reward": 0.1 * step + seed}, step)
        return tracker.run_id


def resume(cfg: TrackingConfig, run_id: str, tags: dict, parent: str | None) -> None:
    """The job of the resumed sweep: steps 3, 4 more."""
    relink = {} if parent is None else {"parent_run_id": parent}
    with Tracker.reopen(cfg, run_id, QUIET, from_step=3, tags=tags, **relink) as tracker:
        for step in (3, 4):
            tracker.log_metrics({"rollout/raw_reward": 1.0 + step}, step)


def test_a_resumed_sweeps_runs_move_to_its_parent_and_compare_follows(tracking_cfg: TrackingConfig, tmp_path):
    client = MlflowClient(tracking_cfg.uri)
    old = sweep_parent(tracking_cfg, "S1")
    runs = [job(tracking_cfg, "S1", old, seed) for seed in (11, 12)]
    new = sweep_parent(tracking_cfg, "S2")
    for run_id, seed in zip(runs, (11, 12), strict=True):
        resume(tracking_cfg, run_id, {"sweep_id": "S2", "seed": str(seed), "arm": "algorithm=grpo"}, new)
    for run_id in runs:
        tags = client.get_run(run_id).data.tags
        assert (tags["sweep_id"], tags[PARENT_RUN_ID_TAG]) == ("S2", new)
        assert (tags[PREVIOUS_SWEEP_TAG], tags[PREVIOUS_PARENT_TAG]) == ("S1", old)
    children = client.search_runs([client.get_run(new).info.experiment_id],
                                  filter_string=f"tags.`{PARENT_RUN_ID_TAG}` = '{new}'")
    assert sorted(r.info.run_id for r in children) == sorted(runs)
    # relax-compare: the new sweep has both runs and logs to its parent
    # within this test's experiment: the store is the worker's, where another test may have run a sweep S2 too
    mine = {"uri": tracking_cfg.uri, "experiment": tracking_cfg.experiment}
    r = compare(**mine, sweep="S2", last_k=2, out_dir=tmp_path / "cmp")
    assert r.logged_to == new and r.comparison.stats[0].n == 2
    assert {f.path for f in client.list_artifacts(new, "compare")} == {"compare/compare.csv", "compare/compare.png"}
    assert client.list_artifacts(old, "compare") == []
    # the old sweep id says where its runs went
    with pytest.raises(CompareError, match="no runs match experiment .* and sweep S1: its runs were reopened by a "
                                           "job of sweep S2 .* --sweep S2$"):
        compare(**mine, sweep="S1", out_dir=tmp_path / "cmp1", log=False)


def test_control_a_run_reopened_without_a_parent_keeps_its_sweep_and_parent(tracking_cfg: TrackingConfig):
    """A job resumed on its own (`relax-train train.resume=...`, no sweep): nothing to re-link."""
    client = MlflowClient(tracking_cfg.uri)
    parent = sweep_parent(tracking_cfg, "S1")
    alone = job(tracking_cfg, "S1", parent, 11)
    resume(tracking_cfg, alone, {"seed": "11"}, None)
    tags = client.get_run(alone).data.tags
    assert (tags["sweep_id"], tags[PARENT_RUN_ID_TAG]) == ("S1", parent)
    assert PREVIOUS_SWEEP_TAG not in tags and PREVIOUS_PARENT_TAG not in tags


def test_a_run_reopened_under_the_parent_it_has_gets_no_previous_tags(tracking_cfg: TrackingConfig):
    """A job of the same sweep run again (its parent is the one given): nothing moves, nothing is recorded."""
    client = MlflowClient(tracking_cfg.uri)
    parent = sweep_parent(tracking_cfg, "S1")
    same = job(tracking_cfg, "S1", parent, 12)
    resume(tracking_cfg, same, {"sweep_id": "S1", "seed": "12"}, parent)
    tags = client.get_run(same).data.tags
    assert (tags["sweep_id"], tags[PARENT_RUN_ID_TAG]) == ("S1", parent)
    assert PREVIOUS_SWEEP_TAG not in tags and PREVIOUS_PARENT_TAG not in tags


def test_a_reopened_run_takes_the_tags_of_mlflows_run_context(tracking_cfg: TrackingConfig, monkeypatch):
    """MLflow tags every run it creates with MLFLOW_RUN_CONTEXT's tags; a sweep's launcher names each job's run there
    (`relax.sweep_job`: `<sweep id>/<job index>`, how its table finds the run). A job of a resumed sweep reopens its
    run instead of creating one: it takes the new sweep's context too, else the table of the new sweep could not
    find it. Control: a run reopened outside any context keeps the tag it had."""
    client = MlflowClient(tracking_cfg.uri)
    monkeypatch.setenv("MLFLOW_RUN_CONTEXT", '{"relax.sweep_job": "S1/0"}')
    old = sweep_parent(tracking_cfg, "S1")
    first, second = job(tracking_cfg, "S1", old, 11), job(tracking_cfg, "S1", old, 12)
    assert client.get_run(first).data.tags["relax.sweep_job"] == "S1/0"  # MLflow's own, at creation
    new = sweep_parent(tracking_cfg, "S2")
    monkeypatch.setenv("MLFLOW_RUN_CONTEXT", '{"relax.sweep_job": "S2/0"}')
    resume(tracking_cfg, first, {"sweep_id": "S2", "seed": "11"}, new)
    assert client.get_run(first).data.tags["relax.sweep_job"] == "S2/0"
    monkeypatch.delenv("MLFLOW_RUN_CONTEXT")
    resume(tracking_cfg, second, {"seed": "12"}, None)
    assert client.get_run(second).data.tags["relax.sweep_job"] == "S1/0"
