"""relax-train -m end to end on the tiny model: 2 arms in parallel on a local Ray (one of them continuing a crashed
job's checkpoint with train.resume=auto), one MLflow parent run with a child per job, then relax-compare on that store;
a sweep stopped by Ctrl-C. (Seeds are one more axis of the same sweep: the launcher's jobs, their
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
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # SQLAlchemy's, from MLflow's store
def test_relax_train_sweep_with_resume_auto_and_compare(tmp_path, fresh_store, in_process, monkeypatch, capsys):
    """A sweep of 2 arms (`algorithm=rloo,grpo`) with train.resume=auto, where the grpo arm's job had crashed after its
    first step's checkpoint, its MLflow run ended FAILED by the sweep it was in: the rloo job starts at step 0, the
    grpo job continues its checkpoint in its own run, which joins the new sweep (its parent run, sweep id and
    `relax.sweep_job` tag, by which the launcher finds a job's run: a crashed job's run is ended FAILED through it, on
    a dummy app in test_launcher.py's `test_a_crashed_jobs_run_is_ended_failed_with_the_sweep`) and ends FINISHED with
    every step once. Then relax-compare on that store. The crashed job is made cheaply: its first step trained in this
    process with the job's config (the sweep's keys aside, which a resume may change), its run then ended FAILED as
    the launcher ends a crashed job's."""
    from mlflow import MlflowClient

    from relax.config import load_config
    from relax.runner.train import run

    tail = ["seed=1", "train.eval_interval=0", "tracking.progress=false", "tracking.experiment=sweep-test",
            "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4", "train.global_batch_size=8",
            "train.resume=auto", "train.num_rollout=2"]
    fresh_store(tmp_path)
    monkeypatch.chdir(tmp_path)  # the default store and checkpoint directories, as the sweep's jobs resolve them
    run(load_config(["+experiment=rloo_vs_grpo_cpu", "algorithm=grpo", *tail[:-1], "train.num_rollout=1",
                     "tracking.arm='algorithm=grpo'"]), output_dir=tmp_path / "crashed")
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("sweep-test")
    (crashed,) = client.search_runs([exp.experiment_id])
    client.set_terminated(crashed.info.run_id, "FAILED")
    save_dir = tmp_path / "checkpoints" / "sweep-test" / "algorithm=grpo-seed1"  # named by its experiment and arm
    assert [p.name for p in save_dir.glob("step_*")] == ["step_000001"]

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "relax.cli.train", "-m", "+experiment=rloo_vs_grpo_cpu", "algorithm=rloo,grpo", *tail]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "2 of 2 jobs finished" in proc.stdout
    assert f"resuming from {save_dir}/step_000001 (1 steps trained)" in out, out[-5000:]
    # each job runs inside the sweep's Ray (a worker of the instance the launcher started): its plan says so, and
    # not that it started a Ray of its own (RayRuntime starts none in a job)
    sweep_ray = "Ray: the sweep's Ray instance (local, started by the sweep launcher for its jobs)"
    assert out.count(sweep_ray) == 2, out[-5000:]
    assert "Ray: a local Ray instance started for this run" not in out

    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = {r.data.tags["algorithm"]: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    assert len(parents) == 1 and sorted(children) == ["grpo", "rloo"]
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["overrides"].startswith("+experiment=rloo_vs_grpo_cpu algorithm=rloo,grpo seed=1")
    sweep_id = parent.data.tags["sweep_id"]
    for index, (algorithm, c) in enumerate(sorted(children.items(), key=lambda kv: kv[0] != "rloo")):
        tags = c.data.tags
        assert c.info.status == "FINISHED" and tags["mlflow.parentRunId"] == parent.info.run_id
        assert tags["sweep_id"] == sweep_id and tags["relax.sweep_job"] == f"{sweep_id}/{index}"
        assert tags["arm"] == f"algorithm={algorithm}" and tags["seed"] == "1"
        assert [m.step for m in client.get_metric_history(c.info.run_id, "rollout/raw_reward")] == [0, 1]
        assert [m.step for m in client.get_metric_history(c.info.run_id, "train/loss")] == [0, 1]  # each step once
        assert c.info.run_id in proc.stdout  # the launcher's table names it
    rloo, grpo = children["rloo"], children["grpo"]
    assert rloo.data.tags["overrides"] == (
        "+experiment=rloo_vs_grpo_cpu algorithm=rloo seed=1 train.eval_interval=0 tracking.progress=False "
        "tracking.experiment=sweep-test rollout.rollout_batch_size=2 rollout.n_samples_per_prompt=4 "
        "train.global_batch_size=8 train.resume=auto train.num_rollout=2")
    assert rloo.data.params["tracking.sweep_id"] == sweep_id
    assert grpo.info.run_id == crashed.info.run_id  # continued in its own run
    assert "relax.resumed" in grpo.data.tags and "relax.resumed" not in rloo.data.tags
    plan = client.download_artifacts(rloo.info.run_id, "plan.txt", str(tmp_path / "plan"))
    assert sweep_ray in open(plan).read()  # the plan the job's MLflow run keeps (grpo's: that of its first start)

    from relax.cli.compare import main as compare_main

    compare_main(["--control", "algorithm=grpo", "--bootstrap", "200"])  # relax-compare's entry point, in process
    out = capsys.readouterr().out
    assert "algorithm=grpo (control)  1" in out and "algorithm=rloo  1" in out
    names = {f.path for f in client.list_artifacts(parent.info.run_id, "compare")}
    assert names == {"compare/compare.csv", "compare/compare.png"}


@pytest.mark.slow
def test_sigterm_stops_every_job_as_a_single_run_with_a_checkpoint(tmp_path, fresh_store):
    """SIGTERM on `relax-train -m` (a scheduler's stop; Ctrl-C takes the same path, tests/experiments/test_launcher.py):
    every running job stops as a single run does on Ctrl-C (its step finished, a checkpoint of it committed, its MLflow
    run KILLED), the parent run ends KILLED, exit 143 (128 + SIGTERM, as a single run; it was 130: ray.wait turned the
    handler's exception into a plain KeyboardInterrupt), and the table names each job's run. Both jobs are held in the
    scoring of a batch after their first step (`sweep_rewards:hold`) when the driver gets SIGTERM, and released once
    each has said that it got the interrupt: each stops after the step it was held in. The driver's `stop_timeout_s`
    is set beyond the test's own waits: its default 120 s counts from the signal, across the hold, and a loaded
    machine (CI) turned the stop into a kill that lost the step's metrics. Before: the jobs were force-killed, their
    runs stayed RUNNING, their checkpoint directories held no checkpoint and the table said `KILLED -`."""
    from mlflow import MlflowClient

    fresh_store(tmp_path)  # the sweep's default store, sqlite:///mlflow.db in its working directory
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
        proc.send_signal(signal.SIGTERM)  # a scheduler stopping the sweep's driver
        wait_for(lambda: len(stopping.findall(log.read_text())) == 2)  # each job got it, while held
        (hold / "go").touch()
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 143, text[-5000:]
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
