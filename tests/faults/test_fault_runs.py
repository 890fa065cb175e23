"""End-to-end with the tiny model, the roles in this process (`in_process`; the reward workers are processes as in
every run): a diverging run stops, a hanging reward is cut off."""

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
    with pytest.raises(RunError, match=r"step 2: 2 optimizer step\(s\) in a row were skipped because the loss or the "
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
