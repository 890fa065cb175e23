"""A sweep's parent run is never an arm of relax-compare, whatever selects the runs (relax.tracking.compare's
`select_runs`): also a parent none of whose jobs' runs names it any more, because later sweeps reopened them all (a
sweep resumed by a second sweep, the second by a third). `relax-compare --experiment NAME` selects all three parents
then; the first two have no child left, and used to be counted as an arm `(none)` (no `algorithm` tag or param).

The parents are made as the sweep launcher makes them (`Tracker.start` with the sweep's tags, the launcher's own
`_tag_statuses` when it ends), the jobs' runs with a run's `standard_tags`, and the resumes with `Tracker.reopen`,
which moves a run to the parent of the sweep that reopens it."""

from __future__ import annotations

from types import SimpleNamespace

from mlflow import MlflowClient

from relax.config import load_config
from relax.config.schema import TrackingConfig
from relax.tracking import RunOptions, Tracker
from relax.tracking.compare import NO_VALUE, SWEEP_PARENT_TAG, compare
from relax.tracking.mlflow_run import PARENT_RUN_ID_TAG
from relax.tracking.params import TAG_OVERRIDES, TAG_SWEEP_ID, standard_tags

QUIET = RunOptions(announce=False, background=False)
ARMS = ("grpo", "rloo")
SEEDS = (1, 2)
R = "rollout/raw_reward"


def test_the_launchers_parent_tag_is_the_one_compare_reads():
    from hydra_plugins.relax_ray_launcher.launcher import JOBS_TAG

    assert SWEEP_PARENT_TAG == JOBS_TAG


def _parent(cfg: TrackingConfig, sweep: str) -> Tracker:
    """A sweep's parent run, as the launcher starts it (`RelaxRayLauncher._start_parent`)."""
    return Tracker.start(cfg, QUIET, run_name=f"sweep-{sweep}",
                         tags={TAG_SWEEP_ID: sweep, TAG_OVERRIDES: "algorithm=rloo,grpo seed=1,2"})


def _end(parent: Tracker, run_ids: list[str]) -> None:
    """The sweep's end, as the launcher ends it: its jobs' statuses tagged, the parent FINISHED."""
    from hydra_plugins.relax_ray_launcher.launcher import RelaxRayLauncher
    from hydra_plugins.relax_ray_launcher.sweep import JobRow

    rows = [JobRow(i, "", "FINISHED", run_id) for i, run_id in enumerate(run_ids)]
    RelaxRayLauncher._tag_statuses(SimpleNamespace(parent=parent), rows)  # type: ignore[arg-type]
    parent.finish("FINISHED")


def _job_tags(algorithm: str, seed: int, sweep: str) -> dict[str, str]:
    return standard_tags(load_config([f"algorithm={algorithm}", f"seed={seed}", f"tracking.sweep_id={sweep}"]))


def _sweeps(cfg: TrackingConfig, n: int) -> tuple[list[str], list[str]]:
    """Sweep 1 (2 arms x 2 seeds, steps 0..2), then `n - 1` sweeps that resume it, each reopening every job's run
    (steps 3, 4, ...). (The parents' run ids, the jobs' run ids.)"""
    parents, runs = [], []
    parent = _parent(cfg, "S1")
    for algorithm in ARMS:
        for seed in SEEDS:
            with Tracker.start(cfg, QUIET, tags=_job_tags(algorithm, seed, "S1"),
                               parent_run_id=parent.run_id) as job:
                for step in range(3):
                    job.log_metrics({R: seed + (0.5 if algorithm == "rloo" else 0.0) + 0.01 * step}, step)
                runs.append(job.run_id)
    _end(parent, runs)
    parents.append(parent.run_id)
    for k in range(2, n + 1):
        sweep = f"S{k}"
        parent = _parent(cfg, sweep)
        for i, run_id in enumerate(runs):
            algorithm, seed = ARMS[i // len(SEEDS)], SEEDS[i % len(SEEDS)]
            step = 3 + (k - 2)
            with Tracker.reopen(cfg, run_id, QUIET, from_step=step, tags=_job_tags(algorithm, seed, sweep),
                                parent_run_id=parent.run_id) as job:
                job.log_metrics({R: seed + (0.5 if algorithm == "rloo" else 0.0) + 0.01 * step}, step)
        _end(parent, runs)
        parents.append(parent.run_id)
    return parents, runs


def test_parents_whose_jobs_later_sweeps_reopened_are_no_arm(tracking_cfg: TrackingConfig, tmp_path):
    parents, runs = _sweeps(tracking_cfg, 3)
    client = MlflowClient(tracking_cfg.uri)
    # the shape of the tryout: every job's run now names the third sweep's parent; the first two parents no child
    for run_id in runs:
        tags = client.get_run(run_id).data.tags
        assert (tags[TAG_SWEEP_ID], tags[PARENT_RUN_ID_TAG]) == ("S3", parents[2])
    for parent in parents:
        assert SWEEP_PARENT_TAG in client.get_run(parent).data.tags
    for by in ("algorithm", "arm"):
        result = compare(uri=tracking_cfg.uri, experiment=tracking_cfg.experiment, by=by, control="grpo",
                         last_k=1, out_dir=tmp_path / by, log=False)
        c = result.comparison
        assert sorted(c.arms) == ["grpo", "rloo"], c.arms
        assert sorted(r.run_id for r in c.runs) == sorted(runs)
        assert {s.arm: (s.n, sorted(s.seeds)) for s in c.stats} == {"grpo": (2, ["1", "2"]), "rloo": (2, ["1", "2"])}
        assert not any(p in note for note in c.notes for p in parents), c.notes
        assert NO_VALUE not in result.text
        # the paired difference: rloo's rewards are grpo's + 0.5 at every seed and step
        (diff,) = c.diffs
        assert diff.n_pairs == 2 and abs(diff.mean - 0.5) < 1e-9
    # the other selectors agree: --tag, and the latest sweep (no selector)
    for kwargs in ({"tags": {"algorithm": "rloo"}}, {}):
        c = compare(uri=tracking_cfg.uri, by="algorithm", out_dir=tmp_path / "other", log=False, **kwargs).comparison
        assert set(r.run_id for r in c.runs) <= set(runs) and NO_VALUE not in c.arms


def test_control_a_run_without_the_by_key_that_is_no_parent_is_still_an_arm(tracking_cfg: TrackingConfig,
                                                                             tmp_path):
    """Only parents are left out: a finished run of the experiment that lacks the `--by` tag (not a sweep's
    parent) is still grouped as (none), with its note."""
    parents, runs = _sweeps(tracking_cfg, 2)
    with Tracker.start(tracking_cfg, QUIET, tags={"seed": "1"}) as odd:
        odd.log_metrics({R: 0.3}, 0)
    c = compare(uri=tracking_cfg.uri, experiment=tracking_cfg.experiment, by="algorithm", last_k=1,
                out_dir=tmp_path, log=False).comparison
    assert sorted(c.arms) == sorted(["grpo", "rloo", NO_VALUE]), c.arms
    assert sorted(r.run_id for r in c.runs) == sorted([*runs, odd.run_id])
    assert any(f"run {odd.run_id} has no tag or param 'algorithm'" in note for note in c.notes), c.notes
