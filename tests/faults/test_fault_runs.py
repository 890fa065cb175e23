"""End-to-end with the tiny model, the roles in this process (`in_process`; the reward workers are processes as in
every run): a diverging run stops, a hanging reward is cut off, a reward that fails every call stops the run."""

from __future__ import annotations

import math
import time

import pytest
import torch
from safetensors.torch import load_file

from relax.config import load_config
from relax.runner.errors import RunError
from relax.runner.train import run

pytestmark = pytest.mark.slow


def test_a_diverged_run_skips_its_nonfinite_steps_then_stops_keeping_its_checkpoints(in_process, small_run,
                                                                                     tmp_path):
    """lr=1e30: the first update blows the weights up (finite, ~1e30), every later gradient is NaN."""
    from mlflow.tracking import MlflowClient

    cfg = load_config(small_run("train.lr=1e30", "train.max_skipped_steps=2", "train.save_interval=1", steps=6))
    t0 = time.perf_counter()
    with pytest.raises(RunError, match=r"step 3: 2 optimizer step\(s\) in a row were skipped because the loss or the "
                                       r"gradient norm is not finite \(.*train/grad_norm=nan\); "
                                       r"train\.max_skipped_steps=2\..*the last checkpoint is .*step_000002"):
        run(cfg, output_dir=tmp_path / "out")
    took = time.perf_counter() - t0
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (mlrun,) = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    assert mlrun.info.status == "FAILED"
    skipped = sorted((m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, "train/skipped_steps"))
    assert skipped == [(0, 0.0), (1, 1.0), (2, 1.0)]
    assert "train/nonfinite_grad_tensors" in mlrun.data.metrics
    # the stop writes no checkpoint: those committed before it stay, with finite weights
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_000001", "step_000002"]
    weights = load_file(str(ckpt / "step_000002" / "policy" / "model.safetensors"))
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())
    print(f"diverged run: {took:.1f} s")


def test_a_hanging_reward_is_cut_off_and_its_groups_dropped(in_process, small_run, tmp_path):
    cfg = load_config(small_run("data.reward=fault_rewards:hangs", "data.reward_timeout_s=0.2",
                                "rollout.max_response_len=3"))
    t0 = time.perf_counter()
    result = run(cfg, output_dir=tmp_path / "out")
    took = time.perf_counter() - t0
    assert [s for s, _ in result.history] == [0, 1]
    for _, m in result.history:
        errors, timeouts = m["rollout/reward_errors"], m["rollout/reward_timeouts"]
        dropped = m["rollout/reward_dropped_frac"]
        assert 0 < errors == timeouts < 16  # the hung calls, and only they, failed
        assert (dropped * 16) % 4 == 0 and dropped * 16 >= errors  # their whole groups of 4 are left out
        if dropped < 1:
            assert math.isfinite(m["train/loss"])
    assert took < 60, took
    print(f"hanging reward run: {took:.1f} s")


def test_a_reward_that_fails_every_call_stops_the_run_naming_the_failure(in_process, small_run, tmp_path, caplog,
                                                                         capfd):
    """Every group left out in data.max_failed_reward_steps steps in a row: nothing was trained, and the run stops
    (FAILED, exit 2 from relax-train) with the first failure, its steps' metrics logged; before, it ran to the end
    and finished with exit 0. (A reward failing on some responses, the control, trains on: the test above.)

    Such a step has no mean reward: rollout/raw_reward is not logged there, and the run says so once, instead of the
    tracker's warning `metric rollout/raw_reward is nan at MLflow step 0` (as if something broke) and a count in the tag
    relax.nonfinite_metrics."""
    from mlflow.tracking import MlflowClient

    cfg = load_config(small_run("data.reward=fault_rewards:always_fails", "data.reward_timeout_s=null",
                                "data.max_failed_reward_steps=2", "tracking.progress=true", steps=5))
    with pytest.raises(RunError, match=r"step 2: in 2 step\(s\) in a row every group was left out because its reward "
                                       r"calls failed, so nothing was trained \(data\.max_failed_reward_steps=2\); "
                                       r"the first failure: RuntimeError: the verifier refuses every response"):
        run(cfg, output_dir=tmp_path / "out")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (mlrun,) = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    assert mlrun.info.status == "FAILED"
    dropped = sorted((m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id,
                                                                          "rollout/reward_dropped_frac"))
    assert dropped == [(0, 1.0), (1, 1.0)]
    assert client.get_metric_history(mlrun.info.run_id, "rollout/raw_reward") == []
    assert "relax.nonfinite_metrics" not in mlrun.data.tags
    assert not [r.message for r in caplog.records if "rollout/raw_reward is nan" in r.message]
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if "every group was left out (the warnings above say why)" in line]
    assert said == ["step 1: every group was left out (the warnings above say why), so rollout/raw_reward has no "
                    "value: not logged at such a step (rollout/reward_dropped_frac 1.0 marks it; said once)"], err


def test_failed_reward_steps_count_in_a_row_only():
    from relax.runner.optimizer_steps import FailedRewardSteps

    steps = FailedRewardSteps(2)
    steps.count(16, False, "Traceback ...\nRuntimeError: first")
    steps.check(0)
    steps.count(3, True, "RuntimeError: some")  # a group kept: something trained, the count starts again
    steps.count(16, False, "RuntimeError: second")
    steps.check(2)
    steps.count(16, False, "RuntimeError: third")
    with pytest.raises(RunError, match="step 4: in 2 step.*the first failure: RuntimeError: second"):
        steps.check(3)
    never = FailedRewardSteps(0)
    for step in range(5):
        never.count(16, False, "RuntimeError: x")
        never.check(step)


def test_the_limit_is_refused_where_the_first_failure_stops_the_run():
    from relax.config import ConfigError

    with pytest.raises(ConfigError, match=r"data.max_failed_reward_steps=1 has no effect with "
                                          r"data.reward_error=raise"):
        load_config(["data.reward_error=raise", "data.max_failed_reward_steps=1"])
    with pytest.raises(ConfigError, match=r"data.max_failed_reward_steps=-1 must be >= 0"):
        load_config(["data.max_failed_reward_steps=-1"])
    assert load_config(["data.reward_error=raise"]).data.max_failed_reward_steps == 3  # the control: the default
