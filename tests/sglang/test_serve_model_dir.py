"""relax-serve's model directory (model=tiny, a .gguf): a server killed without shutdown() (SIGKILL, the OOM killer)
leaves its `relax-serve-model-*` directory; the next server removes it, and only it.

A directory's server holds a `fcntl.flock` on its lock file while it lives; the kernel drops it when the server's
descriptor closes (its process dying closes it), so a lock that can be taken means a dead server. Here the "servers"
are descriptors of this process (flock locks conflict between open file descriptions, in one process too), and the
temp dir is `tmp_path`: the real /tmp's directories are never touched.
"""

import fcntl
import os
import stat

from relax.serve.sglang.server import MODEL_DIR_LOCK, MODEL_DIR_PREFIX, make_model_dir


def _model_dir(parent, name: str, *, lock: bool = True):
    """A directory as a server leaves it: a file of the model's and, unless `lock=False` (an older version's), its
    lock file, unlocked."""
    path = parent / f"{MODEL_DIR_PREFIX}{name}"
    path.mkdir(mode=0o700)
    (path / "config.json").write_text("{}")
    if lock:
        (path / MODEL_DIR_LOCK).write_text("")
    return path


def _locked(path) -> bool:
    """Whether another descriptor holds the lock of the directory `path` (a live server)."""
    fd = os.open(os.path.join(path, MODEL_DIR_LOCK), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_dead_servers_directory_is_removed_a_live_ones_kept(tmp_path):
    dead = _model_dir(tmp_path, "dead0000")
    old = _model_dir(tmp_path, "old00000", lock=False)  # made before the lock file existed: nobody can tell
    other = tmp_path / "not-relax-serve"  # another program's directory, lock file or not
    other.mkdir()
    (other / MODEL_DIR_LOCK).write_text("")
    live = _model_dir(tmp_path, "live0000")
    live_fd = os.open(live / MODEL_DIR_LOCK, os.O_RDONLY)
    fcntl.flock(live_fd, fcntl.LOCK_EX)  # its server runs
    new, new_fd = None, None
    try:
        new, new_fd = make_model_dir(str(tmp_path))
        assert not dead.exists()
        assert live.is_dir() and (live / "config.json").is_file()
        assert old.is_dir() and (old / "config.json").is_file()
        assert other.is_dir()
        assert os.path.dirname(new) == str(tmp_path) and os.path.basename(new).startswith(MODEL_DIR_PREFIX)
        assert stat.S_IMODE(os.stat(new).st_mode) == 0o700
        assert _locked(new)  # held through the returned descriptor, under its final name
        assert sorted(os.listdir(new)) == [MODEL_DIR_LOCK]

        # the first server dies (its descriptor closes, as its process dying closes it): the next server removes
        # its directory; the one whose server still runs stays
        os.close(new_fd)
        new_fd = None
        second, second_fd = make_model_dir(str(tmp_path))
        try:
            assert not os.path.exists(new)
            assert os.path.isdir(second) and _locked(second)
            assert live.is_dir() and old.is_dir()
        finally:
            os.close(second_fd)
    finally:
        os.close(live_fd)
        if new_fd is not None:
            os.close(new_fd)

