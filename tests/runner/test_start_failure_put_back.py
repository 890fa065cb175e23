"""A fresh run that moved an earlier run's checkpoints to `earlier/` and then fails before its first step puts them
back where they were, whichever start step failed (before: only a failure to open the MLflow run did; Ray, a role,
the engines left them in `earlier/`, so `train.resume=auto` no longer continued the earlier run). A role failure that
the run restarts from step 0 keeps them aside until the run gives up: the next attempt must not resume the earlier
run's checkpoint; or until it is stopped, by Ctrl-C or SIGTERM between two attempts too (before: left in earlier/).

The start steps are the real ones (`relax.runner.train.run`: the real preflight locks the directory and sets the
checkpoint aside) but for Ray and the roles, stand-ins that fail on purpose at a chosen step (a hook, no sleep)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
from pathlib import Path

import pytest

from relax.config import load_config
from relax.runner import train as train_module
from relax.runner.errors import RoleFailure, RunError
from relax.runner.preempt import Preempted

QUICK = ["tracking.enabled=false", "tracking.progress=false", "train.num_rollout=2"]


def _earlier_checkpoint(save_dir: Path) -> Path:
    """A committed checkpoint of an earlier run (what `relax.runner.checkpoint` reads of one: its state.json)."""
    path = save_dir / "step_000004"
    path.mkdir(parents=True)
    (path / "state.json").write_text(json.dumps({"step": 4, "lineage": "feedbeef"}))
    return path


class _Cluster:
    """Stands in for the roles: `fail(where)` says at which start step the start fails (raises), else None."""

    attempts: list[str] = []
    fail = staticmethod(lambda where: None)

    def __init__(self, *args, **kwargs):
        pass

    def launch(self) -> _Cluster:
        type(self).attempts.append("launch")
        type(self).fail("launch")
        return self

    def __enter__(self) -> _Cluster:
        type(self).fail("roles answer")
        return self

    def __exit__(self, *exc) -> None:
        pass


@pytest.fixture
def start(monkeypatch, tmp_path):
    """(save_dir, the earlier checkpoint, what each start step saw) with Ray and the roles stood in for."""
    save_dir = tmp_path / "ckpt"
    earlier = _earlier_checkpoint(save_dir)
    seen: list[tuple[str, bool]] = []  # (start step, the earlier checkpoint in its place)
    monkeypatch.setattr(train_module.RayRuntime, "__enter__", lambda self: self)
    monkeypatch.setattr(train_module.RayRuntime, "__exit__", lambda self, *exc: None)
    monkeypatch.setattr(_Cluster, "attempts", [])
    monkeypatch.setattr(train_module, "Cluster", _Cluster)

    def hook(where: str, fails):
        def fail(step: str) -> None:
            seen.append((step, earlier.exists()))
            if step == where:
                raise fails()
        monkeypatch.setattr(_Cluster, "fail", staticmethod(fail))
    return save_dir, earlier, seen, hook


def _run(save_dir: Path, tmp_path: Path, *extra: str):
    cfg = load_config([f"train.save_dir={save_dir}", *QUICK, *extra])
    return train_module.run(cfg, output_dir=tmp_path / "out")


@pytest.mark.parametrize("where, fails", [
    ("engines", lambda: RuntimeError("an engine did not start")),  # after the session opened: the latest step
    ("roles answer", lambda: RuntimeError("a role's constructor raised")),
])
def test_a_start_that_fails_at_a_later_step_puts_the_earlier_checkpoints_back(where, fails, start, tmp_path,
                                                                               monkeypatch, capsys):
    save_dir, earlier, seen, hook = start
    hook(where, fails)

    def engines(cluster):
        _Cluster.fail("engines")
        raise AssertionError("the hook raises first")
    monkeypatch.setattr(train_module, "started_engines", engines)
    with pytest.raises(RuntimeError, match="did not start|constructor raised"):
        _run(save_dir, tmp_path)
    assert seen[-1] == (where, False)  # the start had set it aside when the step failed
    assert json.loads((earlier / "state.json").read_text())["lineage"] == "feedbeef"
    assert not (save_dir / "earlier").exists()
    assert "1 checkpoint(s) of the earlier run moved back" in capsys.readouterr().err


def test_a_role_failure_restarted_from_step_0_keeps_them_aside_until_the_run_gives_up(start, tmp_path):
    """train.max_restarts=1: the first attempt's role failure restarts the run from step 0 with the checkpoint still
    aside (else the restart would resume it: `Restarts.next` takes the directory's latest); the second's ends the
    run, and it goes back."""
    save_dir, earlier, seen, hook = start
    hook("roles answer", lambda: RoleFailure("actor", "died at start"))
    with pytest.raises(RunError, match="train.max_restarts=1"):
        _run(save_dir, tmp_path, "train.max_restarts=1")
    assert _Cluster.attempts == ["launch", "launch"]
    assert [s for s in seen if s[0] == "roles answer"] == [("roles answer", False), ("roles answer", False)]
    assert (earlier / "state.json").is_file() and not (save_dir / "earlier").exists()


def _fails_then_is_interrupted(monkeypatch, hook, where: str, also=lambda: None, send=None) -> None:
    """The first attempt's roles fail (a RoleFailure the run restarts from step 0), then Ctrl-C arrives at `where`:
    while that attempt's roles stop (its `Cluster.__exit__`), or while the run restarts (`Restarts.next`): raised
    there as the default SIGINT handler would, or, with `send`, that signal sent to this process (the run's own
    handler takes it). `also`: what else happens there first."""
    hook("roles answer", lambda: RoleFailure("actor", "died at start"))

    def interrupt(*args, **kwargs):
        also()
        if send is None:
            raise KeyboardInterrupt
        os.kill(os.getpid(), send)  # the handler runs before the next line: signals reach the main thread at once
    if where == "roles stopping":
        monkeypatch.setattr(_Cluster, "__exit__", lambda self, *exc: interrupt() if exc[0] is RoleFailure else None)
    else:
        monkeypatch.setattr(train_module.Restarts, "next", interrupt)


@pytest.mark.parametrize("where, send", [("roles stopping", None), ("restart", None),
                                         ("roles stopping", signal.SIGTERM)])
def test_ctrl_c_or_sigterm_between_restart_attempts_puts_them_back(where, send, start, tmp_path, monkeypatch,
                                                                    capsys):
    """A role failure kept them aside for the restart; Ctrl-C or SIGTERM (train.save_on_preempt: the run stops
    instead of restarting, `Preempted`) before the next attempt starts ends a run that never began, so they go back
    as for any other start that fails (before: left in earlier/, the decision having been taken before the signal)."""
    save_dir, earlier, seen, hook = start
    _fails_then_is_interrupted(monkeypatch, hook, where, send=send)
    with pytest.raises(Preempted if send is not None else KeyboardInterrupt):  # the run's stop, not a restart
        _run(save_dir, tmp_path, "train.max_restarts=1")
    assert _Cluster.attempts == ["launch"] and seen[-1] == ("roles answer", False)  # aside when the role failed
    assert json.loads((earlier / "state.json").read_text())["lineage"] == "feedbeef"
    assert not (save_dir / "earlier").exists()
    assert "1 checkpoint(s) of the earlier run moved back" in capsys.readouterr().err


def test_a_run_that_took_the_directory_meanwhile_keeps_them_aside(start, tmp_path, monkeypatch, capsys):
    """Between two attempts the directory is not locked: a relax-train that took it then (a lock held on another open
    file, as another process holds it) found no checkpoint to set aside and writes its own there; the interrupted run
    leaves the earlier ones in earlier/ rather than mixing them with that run's, and says where."""
    save_dir, earlier, seen, hook = start
    other = os.open(save_dir / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        _fails_then_is_interrupted(monkeypatch, hook, "restart",
                                   also=lambda: fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB))
        with pytest.raises(KeyboardInterrupt):
            _run(save_dir, tmp_path, "train.max_restarts=1")
    finally:
        os.close(other)
    aside = save_dir / "earlier" / "feedbeef" / earlier.name
    assert not earlier.exists() and (aside / "state.json").is_file()
    err = capsys.readouterr().err
    assert "moved back" not in err
    assert (f"another relax-train holds {save_dir} now, so the 1 checkpoint(s) of the earlier run stay in "
            f"{aside.parent} (train.resume={aside.parent} continues that run)") in err


def _two_aside(save_dir: Path) -> tuple[Path, list[tuple[Path, Path]]]:
    """Two earlier checkpoints a fresh run set aside (`moves`, as `Checkpoints.set_aside` gives them), the first of
    which the Session has already put back (`put_back_earlier_runs`, on a tracker failure): earlier/<lineage>."""
    aside = save_dir / "earlier" / "feedbeef"
    moves = [(save_dir / name, aside / name) for name in ("step_000004", "step_000008")]
    _earlier_checkpoint(save_dir)
    (aside / "step_000008").mkdir(parents=True)
    (aside / "step_000008" / "state.json").write_text(json.dumps({"step": 8, "lineage": "feedbeef"}))
    return aside, moves


@pytest.mark.parametrize("already_back", [1, 2])
def test_the_note_of_a_held_directory_counts_only_the_checkpoints_still_aside(already_back, tmp_path, capsys):
    """Another process holds the lock: the note counts what stays in earlier/, not the moves the Session already put
    back (before: 'the 2 checkpoint(s) ... stay in earlier/' with 1 there, or with none there)."""
    from relax.runner import checkpoint

    save_dir = tmp_path / "ckpt"
    aside, moves = _two_aside(save_dir)
    if already_back == 2:
        (aside / "step_000008").rename(save_dir / "step_000008")
    other = os.open(save_dir / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert checkpoint.put_back(save_dir, moves, locked=False) == 0
    finally:
        os.close(other)
    err = capsys.readouterr().err
    if already_back == 2:
        assert err == ""  # nothing aside: nothing to say
    else:
        assert (aside / "step_000008" / "state.json").is_file() and not (save_dir / "step_000008").exists()
        assert err == (f"relax-train: note: the run did not start; another relax-train holds {save_dir} now, so the "
                       f"1 checkpoint(s) of the earlier run stay in {aside} (train.resume={aside} continues that "
                       "run)\n")


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOLCK])
def test_only_a_filesystem_without_flock_puts_them_back_unlocked(code, tmp_path, monkeypatch, capsys):
    """flock fails: ENOLCK (NFS without its lock daemon, one of `NO_FLOCK`) means no lock can be had there, and they
    move back unlocked, as the run itself went on unlocked; any other errno (EIO) leaves them aside, with the note
    (before: moved back unlocked on any errno)."""
    from relax.runner import checkpoint

    save_dir = tmp_path / "ckpt"
    aside, moves = _two_aside(save_dir)

    def flock(fd, op):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(checkpoint.fcntl, "flock", flock)
    back = checkpoint.put_back(save_dir, moves, locked=False)
    err = capsys.readouterr().err
    if code == errno.ENOLCK:  # the control
        assert back == 1 and (save_dir / "step_000008" / "state.json").is_file() and not aside.exists()
        assert err == f"relax-train: note: the run did not start; 1 checkpoint(s) of the earlier run moved back to " \
                      f"{save_dir}\n"
    else:
        assert back == 0 and (aside / "step_000008" / "state.json").is_file()
        assert err == (f"relax-train: note: the run did not start; the lock of {save_dir} cannot be taken (flock on "
                       f"{save_dir / '.lock'} failed with Input/output error (EIO)), so the 1 checkpoint(s) of the "
                       f"earlier run stay in {aside} (train.resume={aside} continues that run)\n")
