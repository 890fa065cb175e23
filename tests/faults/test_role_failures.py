"""Role processes that die or hang in the middle of a run, on a real local Ray with the tiny model (chaos tests).

Each fault is injected from inside the run by `chaos_rewards` (a signal to a role process found on the run's
heartbeat board) and the outcome is checked against an uninterrupted run of the same config: the run completes
in the same MLflow run, every step's metrics are recorded exactly once, and the final weights are bit for bit
those of the uninterrupted run (every sample trained exactly once, none lost or repeated). The restart policy's
answers that need no process to die (no checkpoint yet: the restart begins at step 0; the limit reached: the run
stops) run with the roles in this process, the failure raised where the loop gets a dead actor's (`dies_once`); a
real process killed, stopped or replaced is each on Ray.
"""

from __future__ import annotations

import re

import pytest
import torch
from inprocess_ray import inprocess_ray
from safetensors.torch import load_file

from relax.config import load_config
from relax.metrics import FAULT_RESTARTS, FAULT_RESTARTS_ROLLOUT, fault_restarts
from relax.runner import checkpoint
from relax.runner.errors import RunError
from relax.runner.restarts import RESTARTS_TAG
from relax.runner.step_metrics import RAW_REWARD
from relax.runner.train import run
from relax.tracking.mlflow_run import RESUMED_TAG

# its tests share module-scoped fixtures: one xdist worker runs them in a row
pytestmark = [pytest.mark.xdist_group("role_failures"),
              pytest.mark.slow]

STEPS = 3
CALLS_PER_STEP = 16  # rollout_batch_size 4 x n_samples_per_prompt 4
# chaos_rewards runs in the driver (no reward worker processes); a checkpoint after every step
# (responses of up to 24 tokens: a rollout keeps a replica busy long enough to be killed in the middle of it)
# (one torch thread in every role: the uninterrupted run, its roles in this process, computes the same floats)
CHAOS = ["data.reward=chaos_rewards:digits_with_fault", "data.reward_timeout_s=null", "train.save_interval=1",
         "rollout.max_response_len=24", "cluster.cpus_per_node=1"]


@pytest.fixture(scope="module")
def overrides(run_overrides):
    """`overrides(directory, *extra)`: the chaos run's config in `directory`."""
    return lambda tmp_path, *extra: run_overrides(tmp_path, *CHAOS, *extra, steps=STEPS)


def final_weights(tmp_path) -> dict[str, torch.Tensor]:
    latest = checkpoint.latest(tmp_path / "ckpt")
    assert latest is not None and latest.name == f"step_{STEPS:06d}"
    return load_file(str(latest / "policy" / "model.safetensors"))


def mlflow_run(tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, "the restarts continue the run's one MLflow run"
    return client, runs[0]


def history(client, run, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))


def assert_every_step_once(client, run) -> None:
    """What `relax-verify-run` checks (every sample trained exactly once, every step's metrics once), and the
    same by hand over MLflow."""
    from relax.cli.verify_run import verify

    report = verify(run.info.run_id, client.tracking_uri)
    assert report.ok, report.text()
    for key in run.data.metrics:
        steps = [s for s, _ in history(client, run, key)]
        assert steps == sorted(set(steps)), f"{key} has a step twice: {steps}"
    assert [s for s, _ in history(client, run, RAW_REWARD)] == list(range(STEPS))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, overrides):
    """The chaos runs' config without a fault, its roles in this process: the final weights and rewards to match."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    with inprocess_ray():
        run(load_config(overrides(tmp)), output_dir=tmp / "out")
    client, mlrun = mlflow_run(tmp)
    return final_weights(tmp), history(client, mlrun, RAW_REWARD)


def chaos(monkeypatch, tmp_path, process: str, sig: str, step: int) -> None:
    """At the first reward call of `step`'s rollout, `sig` to `process`. The rollout stream generates and scores that
    rollout as soon as step - 1 has published its weights, while the loop may still be finishing step - 1 (its metrics
    and checkpoint): the fault lands in step - 1 or in `step`."""
    monkeypatch.setenv("RELAX_CHAOS", f"{process}:{sig}:{step * CALLS_PER_STEP + 1}:{tmp_path / 'injected'}")


def dies_once(monkeypatch, tmp_path, step: int) -> list[int]:
    """The actor dies once, at `step`, for a run with its roles in this process: the loop gets the RoleFailure a dead
    actor's call raises on Ray when it hands that step's batch to the trainer (the restart that follows makes new
    roles, which start from the checkpoint or from the initial weights, as new processes do). Returns the steps at
    which it died."""
    from relax.runner import train
    from relax.runner.errors import RoleFailure

    original, died = train.train_batch, []

    def dies_once_at(cfg, plan, cluster, samples, rewards, keep, at):
        if at == step and not died:
            died.append(at)
            (tmp_path / "injected").write_text(f"actor died at step {at}\n")
            raise RoleFailure("actor", "died: killed (injected)")
        return original(cfg, plan, cluster, samples, rewards, keep, at)

    monkeypatch.setattr(train, "train_batch", dies_once_at)
    return died


def assert_same_as(uninterrupted, tmp_path, client, mlrun) -> None:
    weights, rewards = uninterrupted
    assert (tmp_path / "injected").exists(), "the fault was not injected"
    assert history(client, mlrun, RAW_REWARD) == rewards
    got = final_weights(tmp_path)
    assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in weights)


def test_a_killed_actor_restarts_the_graph_from_the_last_checkpoint(ray_local, uninterrupted, monkeypatch, tmp_path,
                                                                    capfd, overrides):
    chaos(monkeypatch, tmp_path, "actor", "KILL", step=2)
    run(load_config(overrides(tmp_path)), output_dir=tmp_path / "out")
    client, mlrun = mlflow_run(tmp_path)
    assert mlrun.info.status == "FINISHED"
    assert_every_step_once(client, mlrun)
    assert history(client, mlrun, fault_restarts("actor"))[-1] == (STEPS - 1, 1.0)
    assert re.search(r"step [23]: actor died", mlrun.data.tags[RESTARTS_TAG])
    assert "restarting the service graph from checkpoint" in capfd.readouterr().err
    assert_same_as(uninterrupted, tmp_path, client, mlrun)


def test_the_comparison_fails_a_restart_that_loses_the_trained_weights(uninterrupted, monkeypatch, tmp_path,
                                                                     overrides):
    """Negative control of the test above: a restart that reads the checkpoint's step but does not load its weights
    into the new roles (they start from the initial weights) completes, and the comparison fails it. (The roles in
    this process: the actor's death at step 2 is the RoleFailure that the loop gets from a dead actor.)"""
    from relax.runner.cluster import Cluster

    monkeypatch.setattr(Cluster, "load", lambda self, path: checkpoint.read_state(path))
    died = dies_once(monkeypatch, tmp_path, step=2)
    with inprocess_ray():
        run(load_config(overrides(tmp_path)), output_dir=tmp_path / "out")
    client, mlrun = mlflow_run(tmp_path)
    assert mlrun.info.status == "FINISHED" and died == [2]
    assert re.search(r"step 3: actor died", mlrun.data.tags[RESTARTS_TAG])
    with pytest.raises(AssertionError):
        assert_same_as(uninterrupted, tmp_path, client, mlrun)


def test_a_hung_actor_is_declared_hung_and_restarted(ray_local, uninterrupted, monkeypatch, tmp_path, overrides):
    """SIGSTOP: the process is alive but sends nothing; after cluster.heartbeat_timeout_s it is treated as crashed."""
    chaos(monkeypatch, tmp_path, "actor", "STOP", step=1)
    run(load_config(overrides(tmp_path, "cluster.heartbeat_timeout_s=3")), output_dir=tmp_path / "out")
    client, mlrun = mlflow_run(tmp_path)
    assert mlrun.info.status == "FINISHED"
    assert_every_step_once(client, mlrun)
    assert re.search(r"step [12]: actor hung: no heartbeat for", mlrun.data.tags[RESTARTS_TAG])
    assert_same_as(uninterrupted, tmp_path, client, mlrun)


def kill_a_replica_holding_a_call(monkeypatch, tmp_path, replica: int, step: int) -> None:
    """Step `step`'s rollout (sync mode: the run's generate call number `step`) reaches replica `replica` while its
    process is stopped (SIGSTOP), which is then killed (SIGKILL): it dies holding the call, whatever the machine's
    load (a kill timed from outside can land between calls, or never). The driver's dispatch is the hook."""
    import os
    import signal

    from chaos_rewards import board_pid

    from relax.runner.rollout_driver.engines import ReplicaEngines

    original, calls = ReplicaEngines.generate, []

    class HeldCall:  # replica's handle for one dispatch: stop, send, kill
        def __init__(self, handle, pid: int):
            self.handle, self.pid = handle, pid

        @property
        def generate(self):
            return self

        def remote(self, *args, **kwargs):
            os.kill(self.pid, signal.SIGSTOP)
            ref = self.handle.generate.remote(*args, **kwargs)
            os.kill(self.pid, signal.SIGKILL)
            (tmp_path / "injected").write_text(f"rollout[{replica}] killed holding step {step}'s generate\n")
            return ref

    def generate(self, prompts, sample_ids, **kwargs):
        if kwargs.get("evaluation") or len(calls) != step:
            calls.append(None)
            return original(self, prompts, sample_ids, **kwargs)
        calls.append(None)
        handle = self.replicas[replica]
        self.replicas[replica] = HeldCall(handle, board_pid(f"rollout[{replica}]"))
        try:
            return original(self, prompts, sample_ids, **kwargs)  # the failure replaces replica `replica`
        finally:
            assert not isinstance(self.replicas[replica], HeldCall), "the killed replica was not replaced"

    monkeypatch.setattr(ReplicaEngines, "generate", generate)


def test_a_rollout_replica_killed_mid_generation_is_replaced_in_place(ray_local, uninterrupted, monkeypatch, tmp_path,
                                                                      overrides):
    """Two replicas; replica 1 dies holding step 2's generate call: a new one takes its place, gets the current
    weights and runs its share again (the same samples: each draws from its own random stream)."""
    kill_a_replica_holding_a_call(monkeypatch, tmp_path, replica=1, step=2)
    run(load_config(overrides(tmp_path, "rollout.num_replicas=2")), output_dir=tmp_path / "out")
    client, mlrun = mlflow_run(tmp_path)
    assert mlrun.info.status == "FINISHED"
    assert_every_step_once(client, mlrun)
    assert history(client, mlrun, FAULT_RESTARTS_ROLLOUT)[-1] == (STEPS - 1, 1.0)
    assert history(client, mlrun, FAULT_RESTARTS)[-1] == (STEPS - 1, 0.0)  # no restart of the graph
    # the stream generates step 2's rollout as soon as step 1 has published its weights, while the loop may still be
    # finishing step 1 (its metrics, its checkpoint): the failure is recorded at the step the loop is in (0-based
    # indices here; messages and the tag name steps 1-based, as the progress line: step 2 or 3)
    assert re.search(r"step [23]: rollout\[1\] died", mlrun.data.tags[RESTARTS_TAG])
    assert mlrun.data.tags[RESTARTS_TAG].endswith("replaced in place")
    assert_same_as(uninterrupted, tmp_path, client, mlrun)


def test_without_a_checkpoint_the_restart_begins_at_step_0_in_the_same_mlflow_run(uninterrupted, monkeypatch, tmp_path,
                                                                                 capfd, overrides):
    """The actor dies in step 1 before any checkpoint (train.save_interval=0): the new roles start from the initial
    weights at step 0, in the run's one MLflow run, and end with the uninterrupted run's weights. (Roles in this
    process: `dies_once`; a real actor's death answered by a restart is the first test's.)"""
    died = dies_once(monkeypatch, tmp_path, step=1)
    with inprocess_ray():
        run(load_config(overrides(tmp_path, "train.save_interval=0")), output_dir=tmp_path / "out")
    client, mlrun = mlflow_run(tmp_path)
    assert mlrun.info.status == "FINISHED" and died == [1]
    assert_every_step_once(client, mlrun)
    assert re.search(r"step 2: actor died", mlrun.data.tags[RESTARTS_TAG])
    assert "restarting the service graph from the first step (no checkpoint yet)" in capfd.readouterr().err
    assert mlrun.data.tags[RESUMED_TAG] == "no checkpoint (a restart from the first step)"
    assert_same_as(uninterrupted, tmp_path, client, mlrun)


def test_beyond_max_restarts_the_run_stops_naming_the_role_and_the_cause(monkeypatch, tmp_path, overrides):
    """(Roles in this process: `dies_once`; a real actor's death reaches the same policy in the first test.)"""
    dies_once(monkeypatch, tmp_path, step=2)
    with pytest.raises(RunError, match=r"step 3: actor died: .* The run stops: train\.max_restarts=0 restart\(s\) "
                                       r"already used \(none\)\.") as info, inprocess_ray():
        run(load_config(overrides(tmp_path, "train.max_restarts=0")), output_dir=tmp_path / "out")
    client, mlrun = mlflow_run(tmp_path)
    assert mlrun.info.status == "FAILED"
    step = int(re.match(r"step (\d+)", str(info.value)).group(1))
    assert checkpoint.latest(tmp_path / "ckpt").name == f"step_{step - 1:06d}"  # the checkpoint before it stays
