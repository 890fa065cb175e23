"""The local Ray instance a run starts for itself (relax.runner.cluster.RayRuntime)."""

from __future__ import annotations

import os
import sys

import pytest
from terminal_streams import TerminalOrNot

from relax.config.compose import load_config
from relax.runner.cluster import RayRuntime
from relax.runner.plan import build_plan


@pytest.mark.slow
def test_a_runs_own_ray_starts_beside_a_stale_session_file_with_roles_at_normal_priority(no_ray, monkeypatch) -> None:
    """The instance a run starts itself (one start, two claims):
    - a Ray head stopped by a signal (or a user's `ray start --head`) leaves <ray temp dir>/ray_current_cluster naming
      its address, and plain `ray.init()` joins what it names: the local cluster option starts its own instance anyway;
    - Ray's default starts every worker process at niceness 15, where the driver scoring rewards (or any other process
      of normal priority) takes the cores from the roles: a run's own instance starts them at 0."""
    import shutil
    import tempfile

    ray = no_ray  # this test is about the instance a run starts

    class Probe:
        def niceness(self) -> int:
            return os.nice(0)

    tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths live under it
    try:
        monkeypatch.setenv("RAY_TMPDIR", tmp)
        os.makedirs(os.path.join(tmp, "ray"))
        with open(os.path.join(tmp, "ray", "ray_current_cluster"), "w") as f:
            f.write("127.0.0.1:1")  # a head that is gone
        cfg = load_config(["tracking.enabled=false"])
        with RayRuntime(cfg, build_plan(cfg)) as runtime:
            assert runtime.started
            actor = ray.remote(Probe).options(num_cpus=0.5).remote()
            task = ray.remote(lambda: os.nice(0)).options(num_cpus=0.25)
            assert ray.get([actor.niceness.remote(), task.remote()], timeout=120) == [os.nice(0), os.nice(0)]
        assert not ray.is_initialized()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_joining_a_cluster_sends_the_auth_token_when_one_is_available(monkeypatch, tmp_path) -> None:
    """A cluster with token authentication (Ray's default since 2.59) refuses a driver that does not send the token;
    relax-train joining one (cluster.address) turns RAY_AUTH_MODE=token on when a token is found, as relax-submit
    does; a local instance started for the run is left as it is."""
    import ray

    token = tmp_path / "auth_token"
    token.write_text("secret")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    seen: list[tuple] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda address=None, **kwargs: seen.append((address, os.environ.get(
        "RAY_AUTH_MODE"))))
    for address, mode in ((None, None), ("10.0.0.1:6379", "token")):
        monkeypatch.setenv("RAY_AUTH_MODE", "unset")
        monkeypatch.delenv("RAY_AUTH_MODE")  # restored (unset) after the test, whatever the run sets
        cfg = load_config([f"cluster.address={address}" if address else "cluster=local"])
        RayRuntime(cfg, build_plan(cfg)).__enter__()
        assert seen[-1] == (address or "local", mode)


def test_a_ray_that_cannot_start_is_one_line_naming_rays_reason(monkeypatch) -> None:
    """Ray's own start can fail with a bare Exception (its raylet not up within its fixed 30 s on a loaded machine):
    that is the run's one-line error (RunError: `relax-train: error: ...`, exit 2), not a traceback."""
    import ray

    from relax.runner.errors import RunError

    started: list[str] = []

    def init(address=None, **kwargs):
        started.append("half")  # its GCS up, its raylet not: what is left is shut down before the error
        raise Exception("The current node timed out during startup. This could happen because some of the raylet "
                        "failed to startup or the GCS has become overloaded.")

    monkeypatch.setattr(ray, "is_initialized", lambda: bool(started))
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", started.clear)
    monkeypatch.setenv("TQDM_DISABLE", "1")  # RayRuntime sets it for its roles: restored after the test
    cfg = load_config(["cluster=local"])
    with pytest.raises(RunError, match=r"^cannot start or join Ray \(cluster.address=None\): The current node timed "
                                       r"out during startup"):
        RayRuntime(cfg, build_plan(cfg)).__enter__()
    assert not started  # shut down

    # a mistake in the call itself (Relax's, a keyword Ray does not take) is not blamed on Ray: it propagates
    monkeypatch.setattr(ray, "init", lambda address=None, **kwargs: (_ for _ in ()).throw(TypeError("bad kwarg")))
    with pytest.raises(TypeError, match="bad kwarg"):
        RayRuntime(cfg, build_plan(cfg)).__enter__()


def test_a_runs_own_ray_starts_without_colour_when_output_is_not_a_terminal(monkeypatch) -> None:
    """relax-train's output to a file or a pipe carries no ANSI codes around Ray's `(Role pid=...)` prefixes: the
    run's Ray starts with RAY_COLOR_PREFIX=0 (relax.runner.ray_logs, the sweep launcher's decision too) unless both
    stdout and stderr are terminals; on a terminal, it stays unset, Ray's colour as before."""
    import ray

    seen: list = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda address=None, **kwargs: seen.append(os.environ.get("RAY_COLOR_PREFIX")))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("TQDM_DISABLE", "1")  # RayRuntime sets it for its roles: restored after the test
    cfg = load_config(["cluster=local"])
    for tty, expected in ((False, "0"), (True, None)):
        monkeypatch.setenv("RAY_COLOR_PREFIX", "unset")
        monkeypatch.delenv("RAY_COLOR_PREFIX")  # restored (unset) after the test, whatever the start sets
        monkeypatch.setattr(sys, "stdout", TerminalOrNot(tty))
        monkeypatch.setattr(sys, "stderr", TerminalOrNot(tty))
        RayRuntime(cfg, build_plan(cfg)).__enter__()
        assert seen[-1] == expected, tty
    assert len(seen) == 2
