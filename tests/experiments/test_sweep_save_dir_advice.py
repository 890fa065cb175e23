"""`relax-train -m seed=1,2 train.save_dir=<one directory>`: the jobs already differ in seed, but the checkpoint
directory they share is named by train.save_dir, for both; the refusal (before anything starts, exit 2) advises a
train.save_dir of each, not a seed or run name that would change nothing. Before, it advised `e.g. in seed,
tracking.run_name or train.save_dir` whatever the jobs were. Control: two identical jobs (seed=1,1, the directory
derived from the run) keep that advice, which is right for them. In process, nothing starts: seconds."""

from __future__ import annotations

from pathlib import Path

import pytest
from relax_train_inprocess import relax_train

SMALL = ["train.num_rollout=1", "tracking.progress=false"]
OLD_ADVICE = "make the jobs differ, e.g. in seed, tracking.run_name or train.save_dir"
OWN_DIR = ("the jobs already differ in seed or tracking.run_name, but train.save_dir names this one directory for all "
           "of them: give each job a train.save_dir of its own")


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


def test_jobs_that_differ_in_seed_but_share_train_save_dir_are_told_to_give_each_its_own(sweep, tmp_path: Path):
    shared = tmp_path / "shared"
    code, err = sweep("seed=1,2", f"train.save_dir={shared}")
    assert code == 2, err
    assert f"checkpoint directory {shared} is also job 1's: two jobs would write the same files (the second would " \
           f"fail on the first's lock); {OWN_DIR}" in err, err
    assert OLD_ADVICE not in err
    code, err = sweep("seed=1,1")  # control: identical jobs, the directory derived from the run
    assert code == 2, err
    assert OLD_ADVICE in err and OWN_DIR not in err
