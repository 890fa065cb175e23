"""The checkpoint directory's lock (`<save_dir>/.lock`, an exclusive non-blocking flock) on a filesystem without
flock: NFS without its lock daemon (ENOLCK), FUSE mounts (EOPNOTSUPP, ENOSYS), Lustre without -o flock (ENOSYS).
Before, every OSError of flock was reported as `in use by another running relax-train`, by the real start and by the
dry run alike, sending the user after a run that does not exist. Now only EWOULDBLOCK means in use (checked against
a real second holder of the lock, in this process); a filesystem without flock is warned of and the run goes on
without the lock; any other errno is refused naming it. The filesystem's errors are made by replacing fcntl.flock
(no such filesystem here)."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest
from relax_train_inprocess import relax_train

from relax.config import load_config
from relax.runner import checkpoint
from relax.runner.errors import RunError


def _failing_flock(code: int):
    def flock(fd: int, operation: int) -> None:
        raise OSError(code, os.strerror(code))
    return flock


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS],
                         ids=["ENOLCK", "EOPNOTSUPP", "ENOSYS"])
def test_a_filesystem_without_flock_is_named_and_the_run_goes_on_unlocked(code, tmp_path: Path, monkeypatch, capsys):
    cfg = load_config([f"train.save_dir={tmp_path / 'ckpt'}"])
    monkeypatch.setattr(fcntl, "flock", _failing_flock(code))
    with checkpoint.Checkpoints(cfg) as ckpts:  # the real start's lock
        assert not ckpts.locked
    err = capsys.readouterr().err
    name = errno.errorcode[code]
    assert (f"relax-train: warning: cannot lock checkpoint directory {tmp_path / 'ckpt'}: flock on "
            f"{tmp_path / 'ckpt' / '.lock'} failed with {os.strerror(code)} ({name}): the filesystem of "
            "train.save_dir does not support flock; going on without the lock") in err, err
    assert "in use by another" not in err
    assert checkpoint.probe(cfg) is True  # the dry run's probe of the same directory (its .lock exists now)
    err = capsys.readouterr().err
    assert "does not support flock" in err and "in use by another" not in err


def test_another_errno_is_refused_naming_it(tmp_path: Path, monkeypatch):
    cfg = load_config([f"train.save_dir={tmp_path / 'ckpt'}"])
    monkeypatch.setattr(fcntl, "flock", _failing_flock(errno.EIO))
    with pytest.raises(RunError) as info:
        checkpoint.Checkpoints(cfg).__enter__()
    text = str(info.value)
    assert text.startswith(f"cannot lock checkpoint directory {tmp_path / 'ckpt'}: flock on "
                           f"{tmp_path / 'ckpt' / '.lock'} failed with {os.strerror(errno.EIO)} (EIO)"), text
    assert "in use by another" not in text


def test_a_directory_locked_by_another_run_is_still_in_use(tmp_path: Path):
    """Control, with the real flock: a second holder (another open of the lock file: a lock of its own, as another
    process's) is `in use by another running relax-train`, at the start and in the dry run's probe."""
    cfg = load_config([f"train.save_dir={tmp_path / 'ckpt'}"])
    with checkpoint.Checkpoints(cfg) as first:
        assert first.locked
        for attempt in (lambda: checkpoint.Checkpoints(cfg).__enter__(), lambda: checkpoint.probe(cfg)):
            with pytest.raises(RunError, match="is in use by another running relax-train"):
                attempt()


def test_the_dry_run_says_the_filesystem_not_another_run(tmp_path: Path, monkeypatch, capfd):
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    (save_dir / ".lock").touch()  # left by an earlier run: the probe tries to lock it
    monkeypatch.setattr(fcntl, "flock", _failing_flock(errno.ENOLCK))
    code, out, err = relax_train(["dry_run=true", "train.num_rollout=1", f"train.save_dir={save_dir}"], capfd)
    assert code == 0, out + err
    assert "the filesystem of train.save_dir does not support flock" in err
    assert "in use by another" not in out + err
