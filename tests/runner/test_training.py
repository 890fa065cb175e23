"""End-to-end training with the tiny model: every algorithm, learning, resume, failures.

Each role beyond actor + rollout (a reference, PPO's critic and advantages, in one run; a teacher) trains on a real
local Ray; the algorithm matrix, learning, resume and reward faults run the same loop with the roles in this process
(`in_process`, tests/inprocess_ray.py), which is what they test: the loop's arithmetic and records, not processes."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import psutil
import pytest
import torch

from relax.config import load_config
from relax.runner.errors import RunError
from relax.runner.train import run

pytestmark = pytest.mark.slow

# the metrics each algorithm must log besides the common ones (names as the trainers define them)
ALGORITHM_CASES = {
    "grpo": ([], ["train/pg_clipfrac"]),
    "rloo": ([], ["rollout/rloo/baseline_mean", "rollout/rloo/adv_abs_mean", "rollout/rloo/no_signal_frac",
                  "rollout/rloo/empty_response_frac", "rollout/rloo/zero_adv_group_frac",
                  "rollout/rloo/dropped_group_frac"]),
    "ppo": (["algorithm.num_critic_only_steps=1"], ["critic/value_loss", "critic/value_clipfrac"]),
    "cispo": (["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.001", "algorithm.use_tis=true"],
              ["train/kl_loss"]),
    "gspo": ([], ["train/pg_clipfrac"]),
    "sapo": ([], ["train/pg_loss"]),
    "m2po": (["train.num_steps_per_rollout=2"], ["train/ppo_kl_m2_before", "train/ppo_kl_m2_after"]),
    "reinforce_pp": ([], ["train/ppo_kl"]),
    "reinforce_pp_baseline": (["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.01"], ["train/kl_loss"]),
    # with a teacher (`teacher_for`); its learning: tests/runner/test_distillation.py
    "opd": ([], ["train/teacher_kl", "rollout/teacher_logp_mean", "train/pg_clipfrac"]),
}


def teacher_for(name: str, directory) -> list[str]:
    """The teacher an algorithm that distills needs: an untrained tiny model saved with its tokenizer (what it
    knows does not matter to these tests)."""
    from relax import algorithms

    if not algorithms.get(name).requires_teacher:
        return []
    from relax.data.tokenizer import load_tokenizer
    from relax.models.hf import build_model

    cfg = load_config([])
    tokenizer = load_tokenizer(cfg.model)
    build_model(cfg.model, len(tokenizer), tokenizer.pad_token_id, seed=7).save_pretrained(str(directory / "teacher"))
    tokenizer.save_pretrained(str(directory / "teacher"))
    return [f"teacher.path={directory / 'teacher'}"]
COMMON = ["rollout/raw_reward", "rollout/response_len", "rollout/truncated_frac", "rollout/reward_errors",
          "train/loss", "train/grad_norm", "train/lr", "perf/step_time", "perf/rollout_time", "perf/train_time",
          "perf/weight_sync_time", "perf/tokens_per_s"]


def check_algorithm_run(name: str, result, tmp_path) -> None:
    """Two steps, the common and the algorithm's own metrics, PPO's critic-only first step, the final checkpoint."""
    _, expected = ALGORITHM_CASES[name]
    assert [step for step, _ in result.history] == [0, 1]
    last = result.history[-1][1]
    missing = [k for k in COMMON + expected if k not in last]
    assert not missing, missing
    if name == "ppo":  # num_critic_only_steps=1: the first step trains only the critic
        first = result.history[0][1]
        assert first["train/critic_only"] == 1.0 and "train/pg_loss" not in first and "critic/value_loss" in first
        assert "train/pg_loss" in last
    assert (tmp_path / "ckpt" / "step_000002" / "policy" / "model.safetensors").is_file()


@pytest.mark.parametrize("name", list(ALGORITHM_CASES))
def test_every_algorithm_trains_end_to_end(name, in_process, small_run, tmp_path):
    cfg = load_config(small_run(f"algorithm={name}", *ALGORITHM_CASES[name][0], *teacher_for(name, tmp_path)))
    check_algorithm_run(name, run(cfg, output_dir=tmp_path / "out"), tmp_path)


# one run per role beyond actor + rollout (which every graph has; grpo's graph is just those two, and runs on Ray
# in most tests of tests/runner and tests/faults): + critic and advantages, and + reference (ppo with a KL loss: the
# reference is started and called as in cispo's graph, actor + reference, whatever the algorithm), + teacher (opd).
# Two prompts of two samples: the claim is the processes and the object store, not the batch size.
RAY_GRAPHS = {"ppo": (["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.01"], ["train/kl_loss"],
                      ["actor", "critic", "advantages", "reference"]),
              "opd": ([], [], ["actor", "teacher"])}
RAY_SMALL = ["rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2", "train.micro_batch_size=4"]


@pytest.mark.parametrize("name", list(RAY_GRAPHS))
def test_every_service_graph_trains_on_ray(name, ray_local, small_run, tmp_path):
    """The roles as Ray actors in processes of their own: batches, weights and metrics through the object store."""
    from relax.runner import cluster
    started = []
    original = cluster.Cluster._remote

    def remote(self, cls, role, replica, *args, **kwargs):
        started.append(role)
        return original(self, cls, role, replica, *args, **kwargs)

    extra, metrics, roles = RAY_GRAPHS[name]
    cluster.Cluster._remote = remote
    try:
        cfg = load_config(small_run(f"algorithm={name}", *ALGORITHM_CASES[name][0], *extra, *RAY_SMALL,
                                    *teacher_for(name, tmp_path)))
        result = run(cfg, output_dir=tmp_path / "out")
    finally:
        cluster.Cluster._remote = original
    # sync on a CPU machine: the rollout engine runs in the actor's process (test_the_rollout_in_the_actors_process)
    assert sorted(started) == sorted(roles)
    check_algorithm_run(name, result, tmp_path)
    missing = [k for k in metrics if k not in result.history[-1][1]]
    assert not missing, missing


def test_the_rollout_in_the_actors_process_trains_as_in_a_process_of_its_own(in_process, small_run, tmp_path):
    """Sync on one CPU node: the plan puts the rollout engine in the actor's process (`HybridWorker`); the run
    records exactly what the same run with a rollout process of its own records (metrics, final weights)."""
    import dataclasses

    from safetensors.torch import load_file

    from relax.roles import workers
    from relax.runner.plan import build_plan

    built = []
    original = workers.HybridWorker.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        original(self, *args, **kwargs)

    workers.HybridWorker.__init__ = counting
    try:
        runs = {}
        for in_actor in (True, False):
            cfg = load_config(small_run("algorithm=grpo", "train.save_interval=2") + [
                f"train.save_dir={tmp_path}/ckpt-{in_actor}"])
            plan = build_plan(cfg)
            assert plan.rollout_in_actor and "in the actor's process" in plan.render()
            result = run(cfg, dataclasses.replace(plan, rollout_in_actor=in_actor), output_dir=tmp_path / f"{in_actor}")
            weights = load_file(str(tmp_path / f"ckpt-{in_actor}" / "step_000002" / "policy" / "model.safetensors"))
            runs[in_actor] = ([(s, {k: v for k, v in m.items() if not k.startswith("perf/")})
                               for s, m in result.history], weights)
    finally:
        workers.HybridWorker.__init__ = original
    assert built == [1]  # the first run built one, the second a rollout process of its own
    (h1, w1), (h2, w2) = runs[True], runs[False]
    assert h1 == h2
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)


def test_run_is_recorded_in_mlflow(in_process, small_run, tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = load_config(small_run("algorithm=rloo", "seed=3"))
    result = run(cfg, output_dir=tmp_path / "out")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    mlrun = client.get_run(result.run_id)
    assert mlrun.info.status == "FINISHED"
    assert mlrun.data.tags["algorithm"] == "rloo" and mlrun.data.tags["seed"] == "3"
    assert mlrun.data.params["rollout.n_samples_per_prompt"] == "4"
    history = client.get_metric_history(result.run_id, "rollout/raw_reward")
    assert sorted(m.step for m in history) == [0, 1]
    logged = [m.value for m in sorted(history, key=lambda m: m.step)]
    assert logged == pytest.approx(result.series("rollout/raw_reward"))
    artifacts = {a.path for a in client.list_artifacts(result.run_id)}
    assert {"config.yaml", "plan.txt"} <= artifacts


def learning(name: str, tmp_path, *extra: str) -> tuple[float, float, list[float]]:
    """(mean reward of the first 5 steps, of the last 5, all) of 20 steps on the default task, seed 1."""
    cfg = load_config([f"algorithm={name}", "train.num_rollout=20", "seed=1", "tracking.enabled=false",
                       "tracking.progress=false", "train.save=false", "cluster.cpus_per_node=1", *extra])
    rewards = run(cfg, output_dir=tmp_path / "out").series("rollout/raw_reward")
    return sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5, rewards


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_reward_rises_on_the_default_task(name, in_process, tmp_path):
    """Fixed seed and steps: the mean reward of the last 5 steps is clearly above the first 5."""
    first, last, rewards = learning(name, tmp_path)
    assert last > first + 0.08, rewards


def test_the_learning_criterion_fails_a_run_that_does_not_learn(in_process, tmp_path):
    """Negative control of the test above: the same run with a learning rate too small to move the weights (1e-9)
    does not pass it."""
    first, last, rewards = learning("grpo", tmp_path, "train.lr=1e-9")
    assert not last > first + 0.08, rewards


RESUME_KEYS = ["rollout/raw_reward", "rollout/response_len", "train/loss", "train/grad_norm", "train/pg_clipfrac"]


def resume_mismatches(small_run, tmp_path) -> list[tuple[int, str, float, float]]:
    """(step, key, uninterrupted, resumed) for every recorded value of steps 2-3 where a run resumed from its step-2
    checkpoint differs from the uninterrupted 4-step run."""
    full = run(load_config(small_run("train.save_interval=2", steps=4)), output_dir=tmp_path / "a")
    checkpoint = tmp_path / "ckpt" / "step_000002"
    assert json.loads((checkpoint / "state.json").read_text())["step"] == 2
    resumed = run(load_config(small_run(f"train.resume={checkpoint}", f"train.save_dir={tmp_path}/ckpt2", steps=4)),
                  output_dir=tmp_path / "b")
    assert [s for s, _ in resumed.history] == [2, 3]
    out = []
    for (step_a, a), (step_b, b) in zip(full.history[2:], resumed.history, strict=True):
        assert step_a == step_b
        out += [(step_a, key, a[key], b[key]) for key in RESUME_KEYS
                if a[key] != pytest.approx(b[key], rel=1e-6, abs=1e-7)]
    return out


def test_resume_equals_uninterrupted(in_process, small_run, tmp_path):
    assert resume_mismatches(small_run, tmp_path) == []


def test_the_resume_check_fails_a_resume_that_drops_the_optimizer_state(in_process, small_run, tmp_path,
                                                                       monkeypatch):
    """Negative control of the test above: a resume that loads the weights but starts AdamW afresh (its moments
    and step count lost) is not exact, and the comparison sees it."""
    from relax.train.torch_policy import TorchPolicy

    load = TorchPolicy.load_checkpoint
    monkeypatch.setattr(TorchPolicy, "load_checkpoint",
                        lambda self, directory, load_optimizer=True: load(self, directory, load_optimizer=False))
    assert "train/grad_norm" in {key for _, key, _, _ in resume_mismatches(small_run, tmp_path)}


def test_resume_auto_without_checkpoint_starts_fresh(in_process, small_run, tmp_path):
    result = run(load_config(small_run("train.resume=auto", steps=1)), output_dir=tmp_path / "out")
    assert [s for s, _ in result.history] == [0]


def test_a_raising_reward_function_drops_its_group_and_is_counted(in_process, small_run, tmp_path):
    """flaky_reward raises on odd-length responses: each step some calls fail and their whole groups (of 2) are left
    out, the others train. (Groups of 2, not 4: with 4 every group of both steps held an odd-length response, and a
    job that trains nothing fails, relax.runner.errors.NothingTrained.)"""
    cfg = load_config(small_run("data.reward=flaky_reward:reward", "rollout.max_response_len=3",
                                "rollout.n_samples_per_prompt=2"))
    result = run(cfg, output_dir=tmp_path / "out")
    rows, trained = 4 * 2, 0
    for _, m in result.history:
        errors, dropped = m["rollout/reward_errors"], m["rollout/reward_dropped_frac"]
        assert 0 < errors < rows  # some responses raised, the others were scored
        assert (dropped * rows) % 2 == 0 and dropped * rows >= errors  # whole groups of 2 are left out
        if dropped < 1:
            assert "train/pg_loss" in m
            trained += 1
    assert trained  # a step kept a group and trained on it


def test_reward_error_raise_stops_with_the_traceback(in_process, small_run, tmp_path):
    cfg = load_config(small_run("data.reward=flaky_reward:reward", "data.reward_error=raise"))
    with pytest.raises(RunError, match=r"(?s)data.reward_error=raise.*Traceback.*odd-length"):
        run(cfg, output_dir=tmp_path / "out")


def test_a_failed_call_leaves_out_its_whole_group():
    from relax.runner.rollout_driver.scoring import kept_groups

    keep = kept_groups([False, False, True, False, False, False], 2)
    assert keep.tolist() == [True, True, False, False, True, True]


def test_malformed_data_fails_before_ray_with_file_and_line(tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "repeat 1", "label": "1"}\n{"prompt": "repeat 2", "label": \n')
    cfg = load_config(["data=jsonl", f"data.path={bad}", "tracking.enabled=false"])
    with pytest.raises(RunError, match=r"prompts\.jsonl.*2"):
        run(cfg, output_dir=tmp_path / "out")


def test_cli_reports_bad_data_without_traceback(tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"question": "no prompt key"}\n')
    out = subprocess.run([sys.executable, "-m", "relax.cli.train", "data=jsonl", f"data.path={bad}"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2
    assert "prompts.jsonl" in out.stderr and "prompt" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "mlflow.db").exists()  # failed before tracking started


def test_ctrl_c_stops_ray_and_marks_the_run_killed(tmp_path, fresh_store):
    import signal
    import time

    from mlflow.tracking import MlflowClient

    fresh_store(tmp_path)  # the run's default store, sqlite:///mlflow.db in its working directory
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        # small steps: the run works until the signal, and what it does meanwhile is not what this test checks
        proc = subprocess.Popen([sys.executable, "-m", "relax.cli.train", "train.num_rollout=1000", "train.save=false",
                                 "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
                                 "rollout.max_response_len=4", "train.micro_batch_size=4"],
                                cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + 180
            while "step " not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert "step " in log.read_text(), log.read_text()[-2000:]
            # the run's Ray: its GCS and raylet are the driver's children, the role workers the raylet's
            started = psutil.Process(proc.pid).children(recursive=True)
            names = []
            for p in started:
                with contextlib.suppress(psutil.Error):  # one that ended meanwhile
                    names.append(" ".join(p.cmdline()))
            assert any("raylet" in n for n in names), names
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=120) == 130
        finally:
            proc.kill()
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, f"left running after Ctrl-C: {[p.pid for p in alive]}"
    text = log.read_text()
    assert "relax-train: SIGINT received: stopped at once" in text and "Traceback" not in text
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.status for r in runs] == ["KILLED"]
