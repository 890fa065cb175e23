"""`checkpoint.probe` (the `checkpoints` check of a dry run and of a sweep's precheck) decides whether the save
directory can be created by creating an empty file where it would go and removing it, not from permission bits: for
root (containers, most clusters) `os.access` says every directory is writable, /proc and /sys included, so the dry
run passed and the real start failed. Each verdict is compared with what entering `Checkpoints` (the real start's
lock: the directories made) finds on the same directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from relax.config import load_config
from relax.runner import checkpoint
from relax.runner.errors import RunError


def _verdicts(save_dir: str) -> tuple[str | None, str | None]:
    """(the probe's problem, the real start's problem) on `train.save_dir=save_dir`; None where it passes."""
    cfg = load_config([f"train.save_dir={save_dir}"])
    found: list[str | None] = []
    for attempt in (lambda: checkpoint.probe(cfg), lambda: checkpoint.Checkpoints(cfg).__enter__().__exit__()):
        try:
            attempt()
            found.append(None)
        except RunError as exc:
            found.append(str(exc))
    return found[0], found[1]


@pytest.mark.parametrize("where", ["/proc", "/sys"])
def test_a_directory_nothing_can_be_created_in_is_refused_as_the_start_refuses_it(where: str):
    """/proc and /sys: no file can be created there, whatever the permission bits say (root: writable). Before, the
    probe passed them (`os.access`) while the start could not make the directory."""
    if os.geteuid() != 0 and not os.access(where, os.W_OK):
        pytest.skip("os.access already refuses it for this user: the case is root's")  # the old code's blind spot
    save_dir = f"{where}/relax-probe-test/ckpt"
    probed, started = _verdicts(save_dir)
    assert started is not None and started.startswith(f"checkpoint directory {save_dir} cannot be created")
    assert probed is not None, "the probe passed a directory the start cannot create"
    assert probed.startswith(f"checkpoint directory {save_dir} cannot be created ({where} is not writable (")
    assert probed.endswith("; set train.save_dir")


def test_the_probe_of_a_writable_directory_passes_and_leaves_nothing(tmp_path: Path):
    """Control: a directory that can be created passes the probe, which leaves it as it found it (its file removed,
    the directories not made), and the start, which makes them."""
    cfg = load_config([f"train.save_dir={tmp_path}/new/ckpt"])
    assert checkpoint.probe(cfg) is True
    assert os.listdir(tmp_path) == []
    assert _verdicts(f"{tmp_path}/new/ckpt") == (None, None)
    assert (tmp_path / "new" / "ckpt").is_dir()


def test_the_probe_tries_the_directory_rather_than_read_its_permission_bits(tmp_path: Path, monkeypatch):
    """A filesystem mounted read-only (EROFS) with permission bits that allow writing: made to happen at the probe's
    own file creation, the only way the directory is written. Before, the probe never tried: it passed."""
    import errno

    real_open = os.open
    tried = []

    def read_only(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and Path(path).parent == tmp_path:
            tried.append(path)
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    cfg = load_config([f"train.save_dir={tmp_path}/ckpt"])
    with pytest.raises(RunError) as refused:
        checkpoint.probe(cfg)
    assert tried, "the probe did not try to create a file"
    assert str(refused.value) == (f"checkpoint directory {tmp_path}/ckpt cannot be created ({tmp_path} is not "
                                  f"writable (Read-only file system)); set train.save_dir")
    assert os.listdir(tmp_path) == []
