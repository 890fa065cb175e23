"""relax-train -m end to end on the tiny model: 2 arms in parallel on a local Ray, one MLflow parent run with a child
per job, then relax-compare on that store. (Seeds are one more axis of the same sweep: the launcher's jobs, their
concurrency and failures are tested on a dummy app in test_launcher.py, and relax-compare's seed pairs and intervals
in test_compare.py.)"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
def test_relax_train_sweep_and_compare(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "relax.cli.train", "-m", "+experiment=rloo_vs_grpo_cpu", "algorithm=rloo,grpo",
           "seed=1", "train.num_rollout=1", "train.eval_interval=0", "train.save=false", "tracking.progress=false",
           "tracking.experiment=sweep-test", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4",
           "train.global_batch_size=8"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "2 of 2 jobs finished" in proc.stdout

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("sweep-test")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 2
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["overrides"].startswith("+experiment=rloo_vs_grpo_cpu algorithm=rloo,grpo seed=1")
    seen = set()
    for c in children:
        tags = c.data.tags
        assert c.info.status == "FINISHED" and tags["mlflow.parentRunId"] == parent.info.run_id
        assert tags["sweep_id"] == parent.data.tags["sweep_id"]
        assert tags["arm"] == f"algorithm={tags['algorithm']}"
        assert tags["overrides"] == (f"+experiment=rloo_vs_grpo_cpu algorithm={tags['algorithm']} seed={tags['seed']}"
                                     " train.num_rollout=1 train.eval_interval=0 train.save=False "
                                     "tracking.progress=False tracking.experiment=sweep-test "
                                     "rollout.rollout_batch_size=2 rollout.n_samples_per_prompt=4 "
                                     "train.global_batch_size=8")
        assert c.data.params["tracking.sweep_id"] == tags["sweep_id"]
        assert "rollout/raw_reward" in c.data.metrics
        assert c.info.run_id in proc.stdout  # the launcher's table names it
        seen.add((tags["algorithm"], tags["seed"]))
    assert seen == {("rloo", "1"), ("grpo", "1")}

    cmp = subprocess.run([sys.executable, "-m", "relax.cli.compare", "--control", "algorithm=grpo", "--bootstrap",
                          "200"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert cmp.returncode == 0, cmp.stderr
    assert "algorithm=grpo (control)  1" in cmp.stdout and "algorithm=rloo  1" in cmp.stdout
    names = {f.path for f in client.list_artifacts(parent.info.run_id, "compare")}
    assert names == {"compare/compare.csv", "compare/compare.png"}


@pytest.mark.slow
def test_ctrl_c_stops_every_job_as_a_single_run_with_a_checkpoint(tmp_path):
    """Ctrl-C on `relax-train -m`: every running job stops as a single run does on Ctrl-C (its step finished, a
    checkpoint of it committed, its MLflow run KILLED), the parent run ends KILLED, exit 130, and the table names each
    job's run. Both jobs are held in the scoring of a batch after their first step (`sweep_rewards:hold`) when the
    driver gets SIGINT, and released once each has said that it got the interrupt: each stops after the step it was
    held in. The driver's `stop_timeout_s` is set beyond the test's own waits: its default 120 s counts from the
    Ctrl-C, across the hold, and a loaded machine (CI) turned the stop into a kill that lost the step's metrics.
    Before: the jobs were force-killed, their runs stayed RUNNING, their checkpoint directories held no checkpoint
    and the table said `KILLED -`."""
    from mlflow import MlflowClient

    hold = tmp_path / "hold"
    hold.mkdir()
    calls_per_step = 2 * 4
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0", "RELAX_HOLD_DIR": str(hold),
           "RELAX_HOLD_CALL": str(calls_per_step + 1),
           "PYTHONPATH": os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "relax.cli.train", "-m", "seed=1,2", "train.num_rollout=20", "train.eval_interval=0",
           "tracking.progress=false", "tracking.system_metrics=false", "rollout.rollout_batch_size=2",
           "rollout.n_samples_per_prompt=4", "train.global_batch_size=8", "data.reward=sweep_rewards:hold",
           "data.reward_timeout_s=null", "hydra.launcher.stop_timeout_s=900"]
    log = tmp_path / "log.txt"
    stopping = re.compile(r"relax-train: SIGINT received: stopping after step (\d+) with a checkpoint")

    def wait_for(done) -> None:  # polling files the jobs and the driver write
        deadline = time.monotonic() + 300
        while not done() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert done(), log.read_text()[-5000:]

    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: len(list(hold.glob("reached-*"))) == 2)
        proc.send_signal(signal.SIGINT)  # Ctrl-C on the sweep's driver
        wait_for(lambda: len(stopping.findall(log.read_text())) == 2)  # each job got it, while held
        (hold / "go").touch()
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 130, text[-5000:]
    assert "relax-train: interrupted: stopping 2 running job(s), each after its current step with a checkpoint" in text
    assert "killing" not in text, text[-5000:]  # every job stopped by itself
    (step,) = {int(k) - 1 for k in stopping.findall(text)}  # the same step of both (0-based; said 1-based)
    assert step >= 1

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("relax").experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = {r.data.tags["seed"]: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    assert parent.info.status == "KILLED" and sorted(children) == ["1", "2"]
    table = text[text.index("0 of 2 jobs finished"):]
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line[:2] in ("0 ", "1 ")}
    for index, seed in (("0", "1"), ("1", "2")):
        run = children[seed]
        assert run.info.status == "KILLED", seed
        assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == list(range(step + 1))
        save_dir = tmp_path / "checkpoints" / "relax" / f"grpo-seed{seed}"
        assert sorted(p.name for p in save_dir.glob("step_*")) == [f"step_{step + 1:06d}"], seed
        assert (save_dir / f"step_{step + 1:06d}" / "state.json").is_file()
        row = rows[index]
        assert row[1] == f"seed={seed}" and "KILLED" in row and run.info.run_id in row, row  # its own run


@pytest.mark.slow
def test_a_crashed_jobs_run_ends_failed_and_resume_auto_continues_it(tmp_path):
    """A job of `relax-train -m` killed (SIGKILL, from its reward function in step 2's scoring, once its checkpoint of
    step 1 is committed) is FAILED in the table and its MLflow run is ended FAILED when the sweep ends; before, the
    run stayed RUNNING for good (relax-compare: "is RUNNING: left out", as if still training). The same sweep run
    again with train.resume=auto (the crash disarmed) continues the checkpoint in that same run, which ends FINISHED
    with every step once."""
    from mlflow import MlflowClient

    hold = tmp_path / "crash"
    hold.mkdir()
    save_dir = tmp_path / "checkpoints" / "relax" / "grpo-seed1"
    calls_per_step = 2 * 4
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RELAX_CRASH_DIR": str(hold),
           "RELAX_CRASH_CALL": str(2 * calls_per_step + 1), "RELAX_CRASH_AFTER": str(save_dir / "step_000001"),
           "PYTHONPATH": os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "relax.cli.train", "-m", "seed=1", "train.num_rollout=4", "train.eval_interval=0",
           "train.save_interval=1", "tracking.progress=false", "tracking.system_metrics=false",
           "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4", "train.global_batch_size=8",
           "data.reward=sweep_rewards:crash", "data.reward_timeout_s=null", "train.resume=auto"]
    first = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = first.stdout + first.stderr
    assert first.returncode == 1, out[-5000:]
    assert (hold / "crashed").exists(), out[-5000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("relax").experiment_id
    (child,) = [r for r in client.search_runs([experiment]) if "mlflow.parentRunId" in r.data.tags]
    assert child.info.status == "FAILED", out[-5000:]
    row = next(line.split() for line in first.stdout.splitlines() if line.startswith("0 "))
    assert "FAILED" in row and child.info.run_id in row, row

    second = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-5000:]
    assert re.search(rf"resuming from {save_dir}/step_0000\d\d \(\d+ steps trained\)", out), out[-5000:]
    resumed = client.get_run(child.info.run_id)
    assert resumed.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(child.info.run_id, "train/loss")] == [0, 1, 2, 3]
