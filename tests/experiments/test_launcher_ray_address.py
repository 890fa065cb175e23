"""`relax-train -m ... hydra.launcher.address=HOST:PORT` where no Ray head listens: refused within seconds, naming
`hydra.launcher.address`, exit 2, before the sweep's jobs are checked, its MLflow parent run opens or Ray starts.
Before, the launcher's own address (which it prefers over `cluster.address` and RAY_ADDRESS) was not probed: the
parent run opened and `ray.init` retried the address in Ray's C++ client for ever (a SIGTERM took effect only when
that loop returned to Python). Each case against a real closed port (bound, then closed); the control, a real gRPC
server (as a Ray head is), passes the check and reaches the parent run, stopped here (exit 99). In process: seconds."""

from __future__ import annotations

import time

import pytest
from relax_train_inprocess import relax_train

from relax.runner.endpoints import ENDPOINT_TIMEOUT_S

SMALL = ["seed=1,2", "train.num_rollout=1", "tracking.progress=false"]


@pytest.fixture
def sweep(tmp_path, monkeypatch, capfd):
    """`relax-train -m ARGS` in tmp_path, the parent run and Ray replaced by exit 99 (every check passed):
    (code, stderr, seconds)."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.relax_ray_launcher import launcher

    Plugins.instance()  # Hydra's first scan of its plugins loads the launcher's module again: scanned before the patch

    def stop(self):
        raise SystemExit(99)

    monkeypatch.setattr(launcher.RelaxRayLauncher, "_start_parent", stop)
    monkeypatch.setattr(launcher.RelaxRayLauncher, "_init_ray", stop)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> tuple[int, str, float]:
        t0 = time.monotonic()
        code, out, err = relax_train(["-m", *args, *SMALL, f"hydra.sweep.dir={tmp_path / 'sweep'}"], capfd)
        return code, out + err, time.monotonic() - t0

    return run


def test_an_unreachable_launcher_address_is_refused_before_the_parent_run(closed_port, sweep, tmp_path, grpc_listening):
    port = closed_port()
    code, err, seconds = sweep(f"hydra.launcher.address=127.0.0.1:{port}")
    assert code == 2, err
    (line,) = [x for x in err.splitlines() if x.startswith("relax-train: error: ")]
    assert line.startswith(f"relax-train: error: cannot join Ray: hydra.launcher.address=127.0.0.1:{port}: "
                           f"connection to 127.0.0.1:{port} refused (is the Ray head the sweep joins"), line
    assert "nothing started" in line and "invalid config" not in err and "Traceback" not in err
    assert seconds < 2 * ENDPOINT_TIMEOUT_S + 30  # the probe's bound, plus composing the sweep in process
    assert not (tmp_path / "mlflow.db").exists()  # no parent run: the store was not even created
    code, err, _ = sweep(f"hydra.launcher.address=127.0.0.1:{grpc_listening}")  # control: it listens
    assert code == 99, err


def test_the_launcher_address_is_probed_in_place_of_cluster_address(closed_port, sweep, grpc_listening):
    """The launcher joins `hydra.launcher.address` when both are set: that is the address probed and named."""
    port = closed_port()
    code, err, _ = sweep(f"hydra.launcher.address=127.0.0.1:{port}", f"cluster.address=127.0.0.1:{grpc_listening}")
    assert code == 2, err
    assert f"cannot join Ray: hydra.launcher.address=127.0.0.1:{port}: connection to 127.0.0.1:{port} refused" in err


def test_an_unreachable_ray_address_is_named_as_ray_not_as_an_invalid_config(closed_port, sweep, monkeypatch,
                                                                              grpc_listening):
    """RAY_ADDRESS (joined when neither option is set) gets the same refusal; before, the jobs' own check named it
    under the header `invalid config in 2 of 2 sweep jobs`, which it is not."""
    port = closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    code, err, _ = sweep()
    assert code == 2, err
    assert f"relax-train: error: cannot join Ray: RAY_ADDRESS=127.0.0.1:{port}: connection to 127.0.0.1:{port} " \
           "refused (is the Ray head that RAY_ADDRESS names" in err
    assert "invalid config" not in err
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{grpc_listening}")  # control
    code, err, _ = sweep()
    assert code == 99, err
