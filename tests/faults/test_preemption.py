"""Ctrl-C and SIGTERM (preemption): with `train.save_on_preempt` the run finishes its step, writes its checkpoint and
stops (MLflow run KILLED, exit 128 + the signal); a second signal, or any without it, stops at once.

The signals come from inside the run (`interrupt_rewards:signals`: the reward runs in the driver with
`data.reward_timeout_s=null` and signals its own process at a chosen call). The runs are hybrid, whose rollout stream
scores a batch ahead of the loop, so the step a signal lands in depends on timing: the tests read it from the run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relax.config import load_config
from relax.metrics import SYNC_BYTES, SYSTEM_PREFIX
from relax.runner import checkpoint
from relax.runner.preempt import Preempted, Preemption

HERE = Path(__file__).resolve().parent  # interrupt_rewards.py
CALLS_PER_STEP = 16  # rollout_batch_size 4 x n_samples_per_prompt 4
STEPS = 3
# hybrid: each checkpoint holds the batch generated ahead, which the resumed run must train as the uninterrupted one
# (one torch thread in every role: runs with their roles in this process compute the same floats)
SIGNALS = ["data.reward=interrupt_rewards:signals", "data.reward_timeout_s=null", "train.mode=hybrid",
           "cluster.cpus_per_node=1"]


# ------------------------------------------------------------------------------------------------ unit tests


def test_the_first_signal_requests_a_stop_the_second_stops_at_once(capfd):
    before = signal.getsignal(signal.SIGTERM)
    with Preemption(save=True) as preemption:
        preemption.step = 3  # 0-based: the progress line shows it as step 4 once done, its checkpoint step_000004
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.requested == signal.SIGTERM  # nothing raised: the step goes on
        assert capfd.readouterr().err == ("relax-train: SIGTERM received: stopping after step 4 with a checkpoint; "
                                          "send SIGTERM again to stop now\n")
        with pytest.raises(Preempted) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # (the handler raises before this returns)
    assert info.value.exit_code == 143 and isinstance(info.value, KeyboardInterrupt)
    assert signal.getsignal(signal.SIGTERM) is before  # restored
    stop = preemption.stop(3, checkpointed=True)
    stop.latest = Path("/ckpt/step_000004")
    assert str(stop) == ("SIGTERM received: stopped after 4 steps with a checkpoint; train.resume=auto continues from "
                         "/ckpt/step_000004")
    assert str(preemption.stop(0, checkpointed=False)).startswith(
        "SIGTERM received: stopped after 1 step (its checkpoint could not be written)")


def test_the_first_signal_of_an_agent_program_run_says_its_runs_are_waited_for(capfd):
    """An agent program's step waits for its runs in flight (up to data.agent_timeout_s, 300 s by default): the first
    signal says so, so that a stop that takes minutes is not taken for a hang (found by an outside-in tryout: 206 s
    with a hung agent and no word of why). A run without one says nothing of it (the test above)."""
    cfg = load_config(["data.openai_agent=tests.agents:run", "data.agent_timeout_s=45", "rollout=sglang",
                       "rollout.sglang.server=embedded"])
    with Preemption.from_config(cfg) as preemption:
        preemption.step = 0
        os.kill(os.getpid(), signal.SIGINT)
        assert preemption.requested == signal.SIGINT
    assert capfd.readouterr().err == ("relax-train: SIGINT received: stopping after step 1 with a checkpoint (its "
                                      "agent runs in flight are waited for, up to data.agent_timeout_s=45 s); press "
                                      "Ctrl-C again to stop now\n")


def test_without_save_on_preempt_a_signal_stops_at_once():
    with Preemption.from_config(load_config(["train.save_on_preempt=false"])) as preemption:
        with pytest.raises(Preempted) as info:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert preemption.requested is None
    assert info.value.exit_code == 130 and str(info.value) == ("SIGINT received: stopped at once; no checkpoint was "
                                                               "committed (a new run starts from step 1)")
    # train.save=false writes no checkpoint to stop with: at once too
    assert not Preemption.from_config(load_config(["train.save=false"])).save


def test_a_stop_that_ray_turned_into_a_plain_keyboard_interrupt_is_still_the_signals():
    """A signal arriving while the driver blocks in ray.get runs the handler there, and Ray raises a plain
    KeyboardInterrupt instead of its Preempted: the run still stops as the signal's (message, exit 130)."""
    with Preemption(save=False) as preemption:
        assert preemption.as_preempted(KeyboardInterrupt()).__class__ is KeyboardInterrupt  # no signal yet
        with pytest.raises(Preempted):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    stopped = preemption.as_preempted(KeyboardInterrupt())
    assert isinstance(stopped, Preempted) and stopped.exit_code == 130


def test_outside_the_main_thread_no_handler_is_installed():
    before = signal.getsignal(signal.SIGINT)
    seen = []

    def enter() -> None:
        with Preemption(save=True):
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert seen == [before] and signal.getsignal(signal.SIGINT) is before


def test_relax_train_exits_128_plus_the_signal_with_one_message(tmp_path, monkeypatch, capsys):
    """The CLI's side: Preempted from the run becomes its message on stderr and the exit code, no traceback."""
    import relax.runner.train
    from relax.cli import train as cli

    def preempted(*args, **kwargs):
        exc = Preempted(signal.SIGINT)
        exc.step, exc.checkpointed, exc.latest = 5, True, tmp_path / "step_000006"
        raise exc

    monkeypatch.setattr(relax.runner.train, "run", preempted)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["relax-train", "tracking.progress=false"])
    with pytest.raises(SystemExit) as info:
        cli.main()
    assert info.value.code == 130
    err = capsys.readouterr().err
    assert err == (f"relax-train: SIGINT received: stopped after 6 steps with a checkpoint; train.resume=auto "
                   f"continues from {tmp_path}/step_000006. Ray and its processes stopped, the MLflow run is marked "
                   "KILLED\n")


def test_a_role_that_dies_while_the_run_stops_is_not_restarted(tmp_path, monkeypatch, capsys):
    import relax.runner.train as train
    from relax.runner.errors import RoleFailure

    def attempt(recipe):
        recipe.preemption.requested, recipe.restarts.step = signal.SIGTERM, 4  # SIGTERM came, then the actor died
        raise RoleFailure("actor", "died: the actor died unexpectedly")

    monkeypatch.setattr(train.Recipe, "train", attempt)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Preempted) as info:
        train.run(load_config(["train.max_restarts=3"]), output_dir=tmp_path / "out")
    assert info.value.exit_code == 143 and info.value.latest is None
    assert capsys.readouterr().err == ("step 5: actor died: the actor died unexpectedly; not restarted: the run is "
                                       "stopping (SIGTERM)\n")


# ------------------------------------------------------------------------------------- end to end, real Ray


def _mlflow_run(tmp_path: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (mlrun,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return client, mlrun


def _committed(save_dir: Path) -> list[str]:
    return sorted(p.name for p in save_dir.iterdir() if p.name.startswith(("step_", ".tmp-")))


def _overrides(run_overrides, tmp_path: Path, *extra: str) -> list[str]:
    return run_overrides(tmp_path, *SIGNALS, *extra, steps=STEPS)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_sigterm_checkpoints_the_step_exits_143_and_resume_equals_an_uninterrupted_run(in_process, tmp_path,
                                                                                       run_overrides, fresh_store):
    from relax.runner.train import run

    # relax-train as a scheduler sees it: SIGTERM at the first reward call of step 1's batch. Hybrid generates and
    # scores that batch ahead, while the loop trains step 0 or already step 1 (timing): it stops after that step
    job = tmp_path / "job"
    fresh_store(job)
    env = {**os.environ, "RELAX_SIGNAL": f"TERM:{CALLS_PER_STEP + 1}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    log = job / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "relax.cli.train", *_overrides(run_overrides, job)], cwd=job,
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        # meanwhile, the same run uninterrupted, its roles in this process (what it computes is what is compared)
        ref = tmp_path / "ref"
        fresh_store(ref)
        reference = run(load_config(_overrides(run_overrides, ref)), output_dir=ref / "out")
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    save_dir = job / "ckpt"
    assert code == 143, text[-3000:]
    found = re.search(r"relax-train: SIGTERM received: stopping after step (\d+) with a checkpoint; send SIGTERM again "
                      "to stop now", text)
    assert found, text[-3000:]
    k = int(found.group(1)) - 1  # the message counts steps from 1, as the progress line and checkpoint names do
    assert k in (0, 1)
    assert text.rstrip().endswith(
        f"relax-train: SIGTERM received: stopped after {k + 1} step{'s' if k else ''} with a checkpoint; "
        "train.resume=auto continues from "
        f"{save_dir}/step_{k + 1:06d}. Ray and its processes stopped, the MLflow run is marked KILLED"), text[-3000:]
    assert "Traceback" not in text
    assert _committed(save_dir) == [f"step_{k + 1:06d}"]  # the step it stopped after (no periodic checkpoints here)
    client, mlrun = _mlflow_run(job)
    assert mlrun.info.status == "KILLED"
    assert [m.step for m in client.get_metric_history(mlrun.info.run_id, "train/loss")] == list(range(k + 1))

    # train.resume=auto finishes the run, in the same MLflow run, exactly as the uninterrupted one (its roles in this
    # process: the signal's part is the real relax-train above)
    resumed = run(load_config(_overrides(run_overrides, job, "train.resume=auto")), output_dir=job / "out")
    assert [s for s, _ in resumed.history] == list(range(k + 1, STEPS)) and resumed.run_id == mlrun.info.run_id
    client, mlrun = _mlflow_run(job)
    assert mlrun.info.status == "FINISHED"
    ref_client, ref_run = _mlflow_run(ref)
    assert set(ref_run.data.metrics) == set(mlrun.data.metrics)
    for key in sorted(ref_run.data.metrics):
        if key.startswith(SYSTEM_PREFIX):
            continue  # system metrics are sampled in time (docs/experiments.md)
        ours = sorted((m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, key))
        theirs = sorted((m.step, m.value) for m in ref_client.get_metric_history(ref_run.info.run_id, key))
        assert [s for s, _ in ours] == [s for s, _ in theirs], key  # every step's, times included: none lost
        if key.startswith("perf/") and key != SYNC_BYTES:
            continue  # times
        assert [s for s, _ in ours] == list(range(STEPS)), key
        assert [v for _, v in ours] == pytest.approx([v for _, v in theirs], rel=1e-6, abs=1e-7), key
    final = f"step_{STEPS:06d}/policy/model.safetensors"
    ours, theirs = load_file(str(save_dir / final)), load_file(str(ref / "ckpt" / final))
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    assert reference.history[-1][0] == STEPS - 1


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_without_save_on_preempt_sigterm_stops_at_once_without_a_new_checkpoint(in_process, tmp_path, monkeypatch,
                                                                                 run_overrides, fresh_store):
    from relax.runner.train import run

    fresh_store(tmp_path)
    # at the first reward call of step 1's batch, scored ahead (hybrid) while the loop is in step 0 or 1 (timing)
    monkeypatch.setenv("RELAX_SIGNAL", f"TERM:{CALLS_PER_STEP + 1}:{tmp_path}")
    cfg = load_config(_overrides(run_overrides, tmp_path, "train.save_on_preempt=false", "train.save_interval=1"))
    with pytest.raises(Preempted) as info:
        run(cfg, output_dir=tmp_path / "out")
    save_dir = tmp_path / "ckpt"
    assert info.value.exit_code == 143 and info.value.step is None
    client, mlrun = _mlflow_run(tmp_path)
    assert mlrun.info.status == "KILLED"
    trained = [m.step for m in client.get_metric_history(mlrun.info.run_id, "train/loss")]
    assert trained in ([], [0])  # stopped at once in step 0 or 1: nothing after the step in progress
    # save_interval=1: at most a checkpoint per logged step (the stop may cut the save of the last one short)
    committed = [n for n in _committed(save_dir) if n.startswith(checkpoint.PREFIX)]
    assert set(committed) <= {f"step_{s + 1:06d}" for s in trained}
    assert info.value.latest == (save_dir / committed[-1] if committed else None)
    for name in committed:
        checkpoint.verify(save_dir / name, checkpoint.read_state(save_dir / name))
