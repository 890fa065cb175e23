"""relax-train's last line after Ctrl-C or SIGTERM says what stopped: a run that started its own Ray instance stopped
Ray with every process in it; a run (or a sweep) that joined a cluster (relax-submit, cluster.address, RAY_ADDRESS)
stopped only its own actors, and the cluster keeps running. Before, both said "Ray and its processes stopped", which
on a shared cluster reads as if the head went down. The runner and the sweep launcher put the joined address on the
interrupt (`joined`); the end-to-end stop of a submitted run is
tests/experiments/test_submit.py::test_ray_job_stop_lets_the_submitted_run_commit_its_checkpoint."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from relax.config import load_config
from relax.runner.preempt import Preempted, Signalled

JOINED = "10.0.0.7:6379"


class _Runtime:
    """RayRuntime as the runner sees it after joining `JOINED` (or starting its own Ray: joined None)."""

    joined: str | None = JOINED

    def __init__(self, cfg, plan):
        pass

    def __exit__(self, *exc):
        pass


class _StoppedRecipe:
    """A recipe whose training is stopped by SIGTERM after its first step, with a checkpoint."""

    def __init__(self, *args, **kwargs):
        pass

    def train(self):
        exc = Preempted(signal.SIGTERM)
        exc.step, exc.checkpointed = 0, True
        raise exc


@pytest.mark.parametrize("joined", [JOINED, None])
def test_the_runner_says_which_ray_it_stopped(monkeypatch, tmp_path, joined):
    from relax.runner import train as runner

    monkeypatch.setattr(_Runtime, "joined", joined)
    monkeypatch.setattr(runner, "RayRuntime", _Runtime)
    monkeypatch.setattr(runner, "Recipe", _StoppedRecipe)
    cfg = load_config([f"train.save_dir={tmp_path}/ckpt", "tracking.enabled=false"])
    with pytest.raises(Preempted) as raised:
        runner.run(cfg, object(), output_dir=tmp_path)
    assert raised.value.joined == joined


def _main(monkeypatch, capsys, argv: list[str], interrupt: BaseException) -> tuple[int, str]:
    """relax-train's main with Hydra's main letting `interrupt` through, as it does from the run or the launcher."""
    import hydra

    from relax.cli import train as cli

    def fake_main(*args, **kwargs):
        def decorate(task):
            def run():
                raise interrupt
            return run
        return decorate

    monkeypatch.setattr(hydra, "main", fake_main)
    monkeypatch.setattr(sys, "argv", ["relax-train", *argv])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    return exited.value.code, capsys.readouterr().err


def _preempted(joined: str | None) -> Preempted:
    exc = Preempted(signal.SIGTERM)
    exc.step, exc.checkpointed, exc.latest, exc.joined = 45, True, Path("/shared/ckpt/step_000046"), joined
    return exc


def test_a_run_on_a_joined_cluster_says_only_its_actors_stopped(monkeypatch, capsys):
    code, err = _main(monkeypatch, capsys, ["train.num_rollout=3000"], _preempted(JOINED))
    assert code == 143
    assert err.strip().endswith(
        "relax-train: SIGTERM received: stopped after 46 steps with a checkpoint; train.resume=auto continues from "
        f"/shared/ckpt/step_000046. The run's Ray actors stopped (the Ray cluster at {JOINED} keeps running), the "
        "MLflow run is marked KILLED"), err
    assert "Ray and its processes stopped" not in err
    # control: a run with a Ray of its own stopped it
    code, err = _main(monkeypatch, capsys, ["train.num_rollout=3000"], _preempted(None))
    assert code == 143 and err.strip().endswith(
        "/shared/ckpt/step_000046. Ray and its processes stopped, the MLflow run is marked KILLED"), err


def test_a_sweep_on_a_joined_cluster_says_only_its_jobs_stopped(monkeypatch, capsys):
    """The launcher puts the cluster it joined on the interrupt it lets through (SIGTERM: Signalled; Ctrl-C: a plain
    KeyboardInterrupt)."""
    for interrupt, code in ((Signalled(signal.SIGTERM), 143), (KeyboardInterrupt(), 130)):
        interrupt.joined = JOINED
        got, err = _main(monkeypatch, capsys, ["-m", "seed=1,2"], interrupt)
        assert got == code
        assert f"the sweep's jobs and their Ray actors stopped (the Ray cluster at {JOINED} keeps running)" in err
        assert "Ray and its processes stopped" not in err
        interrupt.joined = None  # control: the sweep's own Ray
        got, err = _main(monkeypatch, capsys, ["-m", "seed=1,2"], interrupt)
        assert got == code and "interrupted; Ray and its processes stopped, the MLflow run is marked KILLED" in err
