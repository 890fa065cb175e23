"""A checkpoint that cannot be written (`train.save_failures`): the previous checkpoint stays valid, and the run stops
(`stop`, the default) or goes on without that checkpoint (`continue`).

The end-to-end tests make the actor's own writes fail at the OS level on a real local Ray: just before the driver
asks the roles to write a chosen checkpoint, it limits the size of the files the actor process may write
(`RLIMIT_FSIZE` through `prlimit`, so the write fails with EFBIG as it would with ENOSPC; the tests run as root, for
whom chmod blocks nothing), and lifts the limit before the next one. The unit tests cover what the libraries
raise (safetensors, torch.save) and a driver-side failure, without Ray.
"""

from __future__ import annotations

import errno
import json
import resource
from pathlib import Path

import pytest
import torch

from relax.config import load_config
from relax.metrics import FAULT_CHECKPOINT_FAILURES
from relax.models.write_errors import os_write_error, os_write_errors, torch_save
from relax.runner import checkpoint
from relax.runner.errors import RunError

LIMIT = 16 * 1024  # bytes: config.json fits, the model's safetensors (~170 kB) does not
# a checkpoint every step; the heartbeat board tells the test the actor's pid
SAVE_EVERY_STEP = ["train.save_interval=1", "cluster.heartbeat_timeout_s=60"]


# ------------------------------------------------------------------------------------------------ unit tests


def test_what_the_libraries_raise_on_a_full_disk_becomes_an_oserror_naming_the_file(tmp_path):
    from safetensors.torch import save_file

    def limited(write) -> OSError:
        """`write` in a child process whose files may not grow beyond 1 kB: the exception it raised there."""
        import multiprocessing
        import resource

        def child(queue) -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
            try:
                write()
                queue.put(None)
            except Exception as exc:
                queue.put(exc)

        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        proc = ctx.Process(target=child, args=(queue,))
        proc.start()
        out = queue.get(timeout=60)
        proc.join()
        return out

    big = {"w": torch.zeros(10_000)}
    target = tmp_path / "opt.pt"
    exc = limited(lambda: torch_save(big, target))  # torch.save to a path would raise RuntimeError, no errno
    assert type(exc) is OSError and exc.errno == errno.EFBIG and exc.filename == str(target)

    def safetensors_in(directory: Path) -> None:
        with os_write_errors(directory):
            save_file(big, str(directory / "model.safetensors"))

    exc = limited(lambda: safetensors_in(tmp_path))  # SafetensorError("... File too large (os error 27)")
    assert type(exc) is OSError and exc.errno == errno.EFBIG and exc.filename == str(tmp_path)


def test_only_os_level_failures_count_as_a_write_failure():
    class RayTaskError(RuntimeError):  # Ray's: the role's exception is its `cause`
        def __init__(self, cause):
            super().__init__("traceback text")
            self.cause = cause

    full = OSError(errno.ENOSPC, "No space left on device", "/ckpt/.tmp-step_000002/policy")
    assert os_write_error(RayTaskError(full)) is full
    assert os_write_error(full) is full
    assert os_write_error(RayTaskError(ValueError("a bad batch"))) is None
    assert os_write_error(ConnectionRefusedError(errno.ECONNREFUSED, "refused")) is None
    assert os_write_error(RuntimeError("size mismatch")) is None
    rust = os_write_error(RuntimeError("Error while serializing: I/O error: Disk quota exceeded (os error 122)"))
    assert rust is not None and rust.errno == errno.EDQUOT


class WritesThenFails:
    """Cluster.save without Ray: the roles write part of the checkpoint into staging, then the write fails."""

    def __init__(self, error: BaseException):
        self.error = error

    def save(self, ckpts, step: int, state: dict, rollout=None) -> Path:
        staging = ckpts.staging(step)
        (staging / "policy").mkdir()
        (staging / "policy" / "model.safetensors").write_bytes(b"half")
        if self.error is not None:
            raise self.error
        return ckpts.commit(staging, step, state)


def _session(tmp_path, *overrides: str):
    from relax.runner.checkpoint import Checkpoints
    from relax.runner.plan import build_plan
    from relax.runner.session import Session

    cfg = load_config(["tracking.enabled=false", "tracking.progress=false", f"train.save_dir={tmp_path}/ckpt",
                       *overrides])
    ckpts = Checkpoints(cfg, tmp_path)
    return ckpts, Session(cfg, build_plan(cfg), tmp_path / "out", checkpoints=ckpts)


def test_a_driver_side_failure_removes_the_staging_directory_and_keeps_the_committed_checkpoint(tmp_path, capsys):
    ckpts, session = _session(tmp_path)
    full = OSError(errno.ENOSPC, "No space left on device")
    with ckpts, session:
        first = session.save_checkpoint(WritesThenFails(None), 1, {"sampler": {}})
        with pytest.raises(RunError) as info:
            session.save_checkpoint(WritesThenFails(full), 2, {"sampler": {}})
    message = str(info.value)
    assert message.startswith("step 2: checkpoint step_000002 could not be written: No space left on device "
                              "(ENOSPC). The run stops (train.save_failures=stop); the latest committed checkpoint, "
                              f"{first}, stays valid.")
    assert message.endswith("run with train.resume=auto to continue from it.")
    assert sorted(p.name for p in ckpts.save_dir.iterdir() if p.name != ".lock") == ["step_000001"]
    checkpoint.verify(first, checkpoint.read_state(first))
    # continue: the same failure is a warning and a count, and the next save tries again
    ckpts, session = _session(tmp_path / "c", "train.save_failures=continue")
    with ckpts, session:
        assert session.save_checkpoint(WritesThenFails(full), 1, {"sampler": {}}) is None
        assert session.checkpoint_failures == 1
        saved = session.save_checkpoint(WritesThenFails(None), 2, {"sampler": {}})
    assert json.loads((saved / "state.json").read_text())["checkpoint_failures"] == 1  # carried across a resume
    err = capsys.readouterr().err
    assert err.count("checkpoint step_000001 could not be written: No space left on device (ENOSPC); training goes "
                     "on (train.save_failures=continue)") == 1
    assert "Traceback" not in err
    # any other error is not a write failure: raised as it is, whatever the policy
    ckpts, session = _session(tmp_path / "o", "train.save_failures=continue")
    with ckpts, session, pytest.raises(ValueError, match="a bad batch"):
        session.save_checkpoint(WritesThenFails(ValueError("a bad batch")), 1, {"sampler": {}})


def test_a_failed_commit_rename_puts_back_the_checkpoint_it_was_replacing(tmp_path, monkeypatch):
    from relax.runner.checkpoint import Checkpoints

    with Checkpoints(load_config([f"train.save_dir={tmp_path}/ckpt"]), tmp_path) as ckpts:
        first = WritesThenFails(None).save(ckpts, 2, {"sampler": {}})
        rename = Path.rename

        def failing(self, target):
            if self.name.startswith(checkpoint.STAGING_PREFIX):
                raise OSError(errno.EIO, "Input/output error", str(self))
            return rename(self, target)

        monkeypatch.setattr(Path, "rename", failing)
        with pytest.raises(OSError, match="Input/output error"):
            WritesThenFails(None).save(ckpts, 2, {"sampler": {}})  # the same step again (a resume from before it)
    checkpoint.verify(first, checkpoint.read_state(first))  # still committed, as it was


# ------------------------------------------------------------------------------------- end to end, real Ray


def _mlflow_run(tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (mlrun,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return client, mlrun


def actor_pid() -> int:
    """The pid of the run's actor process, from the heartbeat board of the run (the newest board with an actor)."""
    import ray

    found = []
    for entry in ray.util.list_named_actors(all_namespaces=False):
        name = entry["name"] if isinstance(entry, dict) else entry
        if name.startswith("relax-heartbeats-"):
            try:
                beats = ray.get(ray.get_actor(name).snapshot.remote(), timeout=30)
            except (ValueError, ray.exceptions.RayActorError):  # the board of an earlier run, gone
                continue
            if "actor" in beats:
                found.append((beats["actor"].beat_age_s, beats["actor"].pid))
    assert found, "no heartbeat board with an actor (cluster.heartbeat_timeout_s must be set)"
    return min(found)[1]


def full_disk_at(monkeypatch, *failing: int) -> None:
    """The actor process cannot write files beyond LIMIT while the checkpoints of the steps in `failing` are written.

    The limit is set (or lifted) by the driver as it prepares each checkpoint's staging directory, before it asks
    the roles to write: tied to the checkpoint, not to the rollout, which the stream generates ahead."""
    from relax.runner.checkpoint import Checkpoints

    staging = Checkpoints.staging

    def limited(self, step: int) -> Path:
        limit = LIMIT if step in failing else resource.RLIM_INFINITY
        resource.prlimit(actor_pid(), resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        return staging(self, step)

    monkeypatch.setattr(Checkpoints, "staging", limited)


def _names(save_dir: Path) -> list[str]:
    return sorted(p.name for p in save_dir.iterdir() if p.name.startswith(("step_", ".tmp-", ".old-")))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_stop_keeps_the_previous_checkpoint_intact(ray_local, small_run, tmp_path, monkeypatch, fresh_store):
    from relax.runner.train import run

    fresh_store(tmp_path)
    full_disk_at(monkeypatch, 2)  # the checkpoint of step 1 (step_000002) fails
    cfg = load_config(small_run(*SAVE_EVERY_STEP, steps=2))
    with pytest.raises(RunError) as info:
        run(cfg, output_dir=tmp_path / "out")
    save_dir = tmp_path / "ckpt"
    message = str(info.value)
    assert message.startswith(f"step 2: checkpoint step_000002 could not be written: File too large (EFBIG): "
                              f"{save_dir}/.tmp-step_000002/policy. The run stops (train.save_failures=stop); the "
                              f"latest committed checkpoint, {save_dir}/step_000001, stays valid."), message
    assert "train.resume=auto" in message
    assert _names(save_dir) == ["step_000001"]  # nothing half-written left
    checkpoint.verify(save_dir / "step_000001", checkpoint.read_state(save_dir / "step_000001"))
    client, mlrun = _mlflow_run(tmp_path)
    assert mlrun.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(mlrun.info.run_id, "train/loss")] == [0, 1]
    # what train.resume=auto would continue (test_preemption.py resumes such a checkpoint to the end)
    assert checkpoint.resume_point(load_config(small_run(*SAVE_EVERY_STEP, "train.resume=auto", steps=2)),
                                   save_dir).path == save_dir / "step_000001"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_continue_goes_on_without_the_checkpoint_and_counts_it(ray_local, small_run, tmp_path, monkeypatch, capfd,
                                                               fresh_store):
    from relax.runner.train import run

    fresh_store(tmp_path)
    full_disk_at(monkeypatch, 2)  # the checkpoint of step 1 (step_000002) fails; step 2's is written again
    cfg = load_config(small_run(*SAVE_EVERY_STEP, "train.save_failures=continue", steps=3))
    result = run(cfg, output_dir=tmp_path / "out")
    assert [s for s, _ in result.history] == [0, 1, 2]
    save_dir = tmp_path / "ckpt"
    err = capfd.readouterr().err
    assert err.count("step 2: checkpoint step_000002 could not be written: File too large (EFBIG): "
                     f"{save_dir}/.tmp-step_000002/policy; training goes on (train.save_failures=continue), the next "
                     f"checkpoint tries again; latest committed checkpoint: {save_dir}/step_000001") == 1, err[-3000:]
    assert "Traceback" not in err
    # the failed step has no checkpoint, the next one was written (keep_checkpoints=2)
    assert _names(save_dir) == ["step_000001", "step_000003"]
    latest = checkpoint.latest(save_dir)
    assert latest == save_dir / "step_000003"
    checkpoint.verify(latest, checkpoint.read_state(latest))
    assert checkpoint.read_state(latest)["checkpoint_failures"] == 1
    client, mlrun = _mlflow_run(tmp_path)
    assert mlrun.info.status == "FINISHED"
    failures = [(m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, FAULT_CHECKPOINT_FAILURES)]
    assert failures == [(1, 1.0)]  # logged at the step whose checkpoint failed, cumulative
    assert dict(result.history)[1][FAULT_CHECKPOINT_FAILURES] == 1.0
