"""`relax-train -m`: before the sweep's MLflow parent run or any job starts, the launcher checks every job as a single
run checks itself before Ray (`check_sweep_job`: validation, addresses, and preflight's input and checkpoint checks)
and refuses jobs that would share a checkpoint directory; every invalid job is named at once, exit 2, nothing
recorded. Each case has its control: the same sweep made valid passes the check and reaches the parent run, stopped
here (exit 99). In process, nothing starts: seconds.

Before: a missing eval file, two jobs with one checkpoint directory and a resume from a checkpoint of another config
each passed the check, so the jobs failed one by one after Ray started, under a FAILED parent run, exit 1."""

from __future__ import annotations

from pathlib import Path

import pytest
from relax_train_inprocess import relax_train

from relax.config import load_config
from relax.runner import checkpoint
from relax.runner.errors import RunError

SMALL = ["train.num_rollout=1", "tracking.progress=false"]


@pytest.fixture
def sweep(tmp_path, monkeypatch, capfd):
    """`relax-train -m ARGS` in tmp_path, the parent run replaced by exit 99 (the check passed): (code, stderr)."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.relax_ray_launcher import launcher

    Plugins.instance()  # Hydra's first scan of its plugins loads the launcher's module again: scanned before the patch

    def stop(self):
        raise SystemExit(99)

    monkeypatch.setattr(launcher.RelaxRayLauncher, "_start_parent", stop)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> tuple[int, str]:
        code, out, err = relax_train(["-m", *args, *SMALL, f"hydra.sweep.dir={tmp_path / 'sweep'}"], capfd)
        return code, out + err

    return run


def test_a_missing_eval_file_is_named_before_anything_starts(sweep, tmp_path: Path):
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"prompt": "repeat 7", "label": "7"}\n')
    missing = tmp_path / "nonexistent.jsonl"
    code, err = sweep(f"+data.eval_sets=choice({{a:{ok}}},{{a:{missing}}})", "train.eval_interval=1")
    assert code == 2, err
    assert "invalid config in 1 of 2 sweep jobs (nothing started)" in err
    assert f"job 1 (+data.eval_sets={{a:{missing}}} train.eval_interval=1 train.num_rollout=1" in err
    assert f"data.eval_sets.a: data file {missing} does not exist" in err
    assert "job 0" not in err and "HYDRA_FULL_ERROR" not in err
    assert not (tmp_path / "mlflow.db").exists()
    other = tmp_path / "ok2.jsonl"
    other.write_text('{"prompt": "repeat 3", "label": "3"}\n')
    code, err = sweep(f"+data.eval_sets=choice({{a:{ok}}},{{a:{other}}})", "train.eval_interval=1")  # control
    assert code == 99, err


def test_two_jobs_with_one_checkpoint_directory_are_both_named(sweep, tmp_path: Path):
    code, err = sweep("seed=1,1")
    assert code == 2, err
    assert "invalid config in 2 of 2 sweep jobs" in err
    save_dir = tmp_path / "checkpoints" / "relax" / "grpo-seed1"
    assert f"job 0 (seed=1 train.num_rollout=1 tracking.progress=False):\n  checkpoint directory {save_dir} is also " \
           "job 1's" in err
    assert f"job 1 (seed=1 train.num_rollout=1 tracking.progress=False):\n  checkpoint directory {save_dir} is also " \
           "job 0's" in err
    assert not save_dir.exists() and not (tmp_path / "mlflow.db").exists()
    assert sweep("seed=1,2")[0] == 99  # control: a directory each
    assert sweep("seed=1,1", "train.save=false")[0] == 99  # and none


OLD_ADVICE = "make the jobs differ, e.g. in seed, tracking.run_name or train.save_dir"
OWN_DIR = ("the jobs already differ in seed or tracking.run_name, but train.save_dir names this one directory for all "
           "of them: give each job a train.save_dir of its own")


def test_jobs_that_differ_in_seed_but_share_train_save_dir_are_told_to_give_each_its_own(sweep, tmp_path: Path):
    """The advice fits the jobs: a seed or run name each would change nothing where train.save_dir names one
    directory for all (before, every clash was told `e.g. in seed, tracking.run_name or train.save_dir`)."""
    shared = tmp_path / "shared"
    code, err = sweep("seed=1,2", f"train.save_dir={shared}")
    assert code == 2, err
    assert f"checkpoint directory {shared} is also job 1's: two jobs would write the same files (the second would " \
           f"fail on the first's lock); {OWN_DIR}" in err, err
    assert OLD_ADVICE not in err
    code, err = sweep("seed=1,1")  # control: identical jobs, the directory derived from the run
    assert code == 2, err
    assert OLD_ADVICE in err and OWN_DIR not in err


def test_a_resume_from_a_checkpoint_of_another_config_is_refused(sweep, tmp_path: Path):
    # a committed checkpoint of seed 2's directory, written with train.lr=0.5 (a real commit; only its files are fake)
    written = load_config(["seed=2", "train.lr=0.5", *SMALL])
    with checkpoint.Checkpoints(written) as ckpts:
        staging = ckpts.staging(1)
        (staging / "weights.bin").write_bytes(b"\0" * 8)
        ckpts.commit(staging, 1, {"sampler": {}})
    code, err = sweep("seed=1,2", "train.resume=auto", "train.lr=0.001")
    assert code == 2, err
    assert "invalid config in 1 of 2 sweep jobs" in err
    assert "job 1 (seed=2 train.resume=auto train.lr=0.001" in err
    assert f"train.resume=auto: checkpoint {ckpts.save_dir}/step_000001 was written with a different config" in err
    assert "train.lr: 0.5 -> 0.001" in err
    assert sweep("seed=1,2", "train.resume=auto", "train.lr=0.5")[0] == 99  # control: the checkpoint's config


def test_the_input_checks_run_once_for_jobs_that_differ_in_their_seed(monkeypatch, tmp_path: Path):
    """A sweep over seeds reads and tokenizes its data once (`check_sweep_job` keys its input checks by the config
    less seed and tracking, within one sweep); the control, jobs that differ in another key, reads it per job."""
    from relax.config import compose
    from relax.runner import preflight, sweep_check

    monkeypatch.chdir(tmp_path)
    calls = []
    real = preflight.build_datasets
    monkeypatch.setattr(preflight, "build_datasets", lambda *a, **k: calls.append(1) or real(*a, **k))
    for seed in (1, 2, 3):
        sweep_check.check_sweep_job(compose([f"seed={seed}", "tracking.sweep_id=s1", *SMALL]))
    assert len(calls) == 1
    for lr in (0.1, 0.2):
        sweep_check.check_sweep_job(compose([f"train.lr={lr}", "tracking.sweep_id=s2", *SMALL]))
    assert len(calls) == 3


def test_the_precheck_checks_a_resume_points_files_by_size_and_leaves_their_hashes_to_the_job(sweep, tmp_path: Path):
    """The sweep's precheck checks each job's resume point as its start would, but its files by their committed size
    only: each job hashes its own checkpoint when it starts, so hashing them all in the driver first would read every
    checkpoint twice before any job runs. A file cut short is named before anything starts; one changed in place,
    same size, passes here and is refused by the job's own check (`checkpoint.probe`, as a single run and a dry run
    do), which hashes it."""
    written = load_config(["seed=1", *SMALL])
    with checkpoint.Checkpoints(written) as ckpts:
        staging = ckpts.staging(1)
        (staging / "weights.bin").write_bytes(b"\0" * 8)
        ckpts.commit(staging, 1, {"sampler": {}})
    weights = ckpts.save_dir / "step_000001" / "weights.bin"
    resumed = load_config(["seed=1", "train.resume=auto", *SMALL])
    weights.write_bytes(b"\1" * 8)  # changed in place, same size
    assert sweep("seed=1", "train.resume=auto")[0] == 99  # the precheck passed: the parent run would open
    with pytest.raises(RunError, match="was changed after the checkpoint was committed"):
        checkpoint.probe(resumed, tmp_path)  # the job's own check
    weights.write_bytes(b"\0" * 4)  # cut short
    code, err = sweep("seed=1", "train.resume=auto")
    assert code == 2 and f"{weights} is damaged: 4 bytes, 8 when it was committed (truncated)" in err, err


def test_a_tracking_store_that_cannot_be_opened_is_named_before_anything_starts(sweep, tmp_path: Path):
    """Every job's check includes preflight's `tracking` (the same check as a single run's and a dry run's): a sqlite
    store where nothing can be created is named before the parent run opens, exit 2. Before, the parent run's start
    raised it as a traceback (exit 1). Control: a store in a directory still to be created passes, creating nothing."""
    code, err = sweep("seed=1,2", "tracking.uri=sqlite:////proc/nope/mlflow.db")
    assert code == 2, err
    assert "relax-train: error: invalid config in 2 of 2 sweep jobs (nothing started)" in err
    assert ("tracking.uri=sqlite:////proc/nope/mlflow.db: the MLflow store /proc/nope/mlflow.db cannot be created "
            "(/proc/nope does not exist)") in err
    assert "Traceback" not in err
    code, err = sweep("seed=1,2", f"tracking.uri=sqlite:///{tmp_path}/new/mlflow.db")
    assert code == 99, err
    assert not (tmp_path / "new").exists()
