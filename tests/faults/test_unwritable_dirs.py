"""Directories relax-train cannot write: a checkpoint directory used before and now read-only (a read-only mount of
a finished run's checkpoints, a disk remounted read-only), and Hydra's output directory in a read-only working
directory (a container's readOnlyRootFilesystem). Each is one line naming the directory and what to set, exit 2,
the dry run saying what the start says; and a run that only reads its checkpoint directory (an evaluation of the
checkpoint, `train.num_rollout=0`) works on a read-only one, locked all the same. Before, the start of a run that
saves ended in an OSError traceback from the lock file's open while its dry run said ok, the evaluation failed the
same way, and Hydra's output directory was a Hydra traceback (exit 1), dry runs included.

Read-only directories are read-only tmpfs mounts (root writes through permission bits): the tests skip where mount
is not permitted."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path

import pytest
from relax_train_inprocess import relax_train

from relax.config import conf_dir, load_config
from relax.runner import checkpoint
from relax.runner.errors import RunError
from relax.runner.preflight import preflight

QUIET = ["tracking.progress=false", "tracking.system_metrics=false"]


@contextlib.contextmanager
def tmpfs(path: Path):
    """A tmpfs mounted at `path` (writable until `read_only`), unmounted after; skips where mount is not allowed."""
    path.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "none", str(path)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"mount not permitted here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=False)  # busy (a process's cwd): detached now


def read_only(path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)


def _listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def _checkpoints_line(out: str) -> str:
    (line,) = [x for x in out.splitlines() if x.split()[1:2] == ["checkpoints"]]
    return line


@contextlib.contextmanager
def read_only_checkpoint(tmp_path: Path):
    """A run's save directory (its checkpoint of step 1, its lock file) on a mount made read-only since: (the
    directory, the checkpoint, the config of the run)."""
    with tmpfs(tmp_path / "ro") as save_dir:
        run = [f"train.save_dir={save_dir}", *QUIET]
        with checkpoint.Checkpoints(load_config([*run, "train.num_rollout=1"])) as ckpts:
            staging = ckpts.staging(1)
            (staging / "weights.bin").write_bytes(b"\0" * 8)
            committed = ckpts.commit(staging, 1, {"sampler": {}})
        assert (save_dir / checkpoint.LOCK).exists()
        read_only(save_dir)
        yield save_dir, committed, run


def test_a_run_that_saves_in_a_read_only_checkpoint_directory_is_refused_in_one_line(tmp_path: Path, monkeypatch,
                                                                                      capfd):
    monkeypatch.chdir(tmp_path)
    with read_only_checkpoint(tmp_path) as (save_dir, _, run):
        capfd.readouterr()
        trains = [*run, "train.resume=auto", "train.num_rollout=3"]
        expected = f"checkpoint directory {save_dir} cannot be written (Read-only file system)"
        code, out, err = relax_train([*trains, "dry_run=true"], capfd)
        assert code == 2, out + err
        assert _checkpoints_line(out).split()[0] == "failed" and expected in _checkpoints_line(out)
        assert "Traceback" not in err
        # the real start's checks before Ray (which enter `Checkpoints`, locking the directory) say the same
        with contextlib.ExitStack() as stack:
            pre = preflight(load_config(trains), stack=stack)
        assert not pre.ok and str(pre.error()).startswith(expected), pre.problems
        assert "set train.save_dir" in str(pre.error())


def test_an_evaluation_reads_a_read_only_checkpoint_directory_under_its_lock(tmp_path: Path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    with read_only_checkpoint(tmp_path) as (save_dir, committed, run):
        before = _listing(save_dir)
        capfd.readouterr()
        evaluates = [*run, "train.resume=auto", "train.num_rollout=0"]
        code, out, err = relax_train([*evaluates, "dry_run=true"], capfd)
        assert code == 0, out + err
        with contextlib.ExitStack() as stack:
            pre = preflight(load_config(evaluates), stack=stack)
            assert pre.ok, pre.problems
            ckpts = pre.checkpoints
            assert ckpts is not None and ckpts.resume is not None and ckpts.resume.path == committed
            assert ckpts.locked and ckpts.read_only
            ckpts.record_run("run-id", "sqlite:///x.db")  # nothing to record where nothing can be written
            with pytest.raises(RunError, match="in use"):  # the lock is held: a second run there is refused
                checkpoint.Checkpoints(load_config(evaluates)).__enter__()
        assert _listing(save_dir) == before


def test_an_output_directory_that_cannot_be_made_is_one_line(tmp_path: Path, monkeypatch, capfd):
    with tmpfs(tmp_path / "ro") as ro:
        read_only(ro)
        plain = ["train.save=false", "tracking.enabled=false", *QUIET]
        # a sweep by -m, or by Hydra's hydra.mode=MULTIRUN (which Hydra sweeps on as on -m)
        for flags, key in (([], "hydra.run.dir"), (["-m", "seed=1,2"], "hydra.sweep.dir"),
                           (["hydra.mode=MULTIRUN", "seed=1,2"], "hydra.sweep.dir")):
            code, out, err = relax_train([*flags, f"{key}={ro}/out", *plain, "dry_run=true"], capfd)
            assert code == 2, out + err
            assert err.strip() == (f"relax-train: error: {key}={ro}/out: Hydra's output directory (the job's resolved "
                                   f"config and log) cannot be made, {ro} is not writable (Read-only file system); "
                                   f"set {key}=<a writable directory>"), err
            assert out == ""
        # conf/config.yaml's default, outputs/<date>/<time>, in a read-only working directory
        from relax.cli.train import output_dir_problem

        monkeypatch.chdir(ro)
        problem = output_dir_problem(plain, conf_dir())
        monkeypatch.chdir(tmp_path)  # out of the mount, so that it can be unmounted
        assert problem is not None and problem.startswith("hydra.run.dir=outputs/"), problem
        assert f"{ro} is not writable (Read-only file system)" in problem
    # control: a directory that can be made, and one that exists and can be written
    assert output_dir_problem(plain, conf_dir()) is None
    assert output_dir_problem([f"hydra.run.dir={tmp_path}", *plain], conf_dir()) is None


def test_an_evaluation_where_only_the_directory_is_unwritable_writes_nothing_there(tmp_path: Path, monkeypatch):
    """A directory whose entries cannot change while its .lock still opens for writing (chattr +i on the directory
    alone): whether the run may write there is tried (`try_writing`, made to fail here as it does there), not read
    from the lock file's open, so the evaluation locks read-only and records nothing (record_run would fail)."""
    save_dir = tmp_path / "ck"
    run = [f"train.save_dir={save_dir}", *QUIET]
    with checkpoint.Checkpoints(load_config([*run, "train.num_rollout=1"])) as ckpts:
        staging = ckpts.staging(1)
        (staging / "weights.bin").write_bytes(b"\0" * 8)
        ckpts.commit(staging, 1, {"sampler": {}})
    before = _listing(save_dir)

    def refused(directory: Path) -> None:
        raise PermissionError(1, "Operation not permitted", str(directory))

    monkeypatch.setattr(checkpoint, "try_writing", refused)
    with checkpoint.Checkpoints(load_config([*run, "train.resume=auto", "train.num_rollout=0"])) as ckpts:
        assert ckpts.locked and ckpts.read_only
        ckpts.record_run("run-id", "sqlite:///x.db")
    assert _listing(save_dir) == before
