"""relax-train -m end to end on the tiny model: 2 arms in parallel on a local Ray, one MLflow parent run with a child
per job, then relax-compare on that store. (Seeds are one more axis of the same sweep: the launcher's jobs, their
concurrency and failures are tested on a dummy app in test_launcher.py, and relax-compare's seed pairs and intervals
in test_compare.py.)"""

import os
import subprocess
import sys

import pytest


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
