"""Overlong reward shaping (data.overlong_buffer_len, data.overlong_penalty_factor) and algorithm.mask_truncated in
the runner: the mask step and advantages on a hand-built batch against hand-computed values, then a short run."""

from __future__ import annotations

import math

import pytest
import torch

from relax import algorithms
from relax.batch import Samples
from relax.config import load_config
from relax.runner.rollout_driver.scoring import overlong_penalties
from relax.runner.train import loss_rows, train_batch

G, T = 4, 4
# two groups of G responses, max_response_len = T: lengths in tokens (the stop token included) and finish reasons
LENGTHS = [2, 4, 4, 1, 3, 4, 2, 4]
FINISH = ["stop", "length", "length", "stop", "stop", "length", "stop", "length"]
REWARDS = [1.0, 0.5, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0]


def samples() -> Samples:
    n = len(LENGTHS)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    return Samples(prompt_ids=torch.full((n, 2), 5), prompt_mask=torch.ones(n, 2, dtype=torch.long),
                   response_ids=torch.full((n, T), 6) * mask, response_mask=mask, rollout_logp=torch.zeros(n, T),
                   finish_reason=list(FINISH))


def config(*extra: str):
    return load_config(["rollout.rollout_batch_size=2", f"rollout.n_samples_per_prompt={G}",
                        f"rollout.max_response_len={T}", "tracking.enabled=false", *extra])


class Plan:
    reference_on_actor = False

    def has(self, role: str) -> bool:
        return False


class Cluster:
    """The one call `train_batch` makes of the cluster for these on-policy batches: the algorithm's advantages."""

    def advantages(self, algo_cfg, inputs):
        return algorithms.get(algo_cfg.name).compute_advantages(algo_cfg, inputs)


def batch_of(cfg, keep: list[bool]):
    return train_batch(cfg, Plan(), Cluster(), samples(), torch.tensor(REWARDS), torch.tensor(keep), step=0)


KEEP_FIRST = [True] * G + [False] * G  # the second group left out (a failed reward call)


def test_truncated_rows_get_a_zero_mask_and_others_are_unchanged():
    s = samples()
    batch, _ = batch_of(config("algorithm.mask_truncated=true"), KEEP_FIRST)
    expected = s.response_mask.clone()
    expected[[1, 2]] = 0  # truncated, in the kept group
    expected[G:] = 0  # the left-out group, whatever its finish reasons
    assert torch.equal(batch.response_mask, expected)
    assert torch.equal(batch.advantages[[1, 2]], torch.zeros(2, T))
    off, _ = batch_of(config(), KEEP_FIRST)  # the default: truncated rows train
    assert torch.equal(off.response_mask[:G], s.response_mask[:G])


def test_truncated_rewards_stay_in_the_group_baseline_grpo():
    batch, _ = batch_of(config("algorithm.mask_truncated=true"), KEEP_FIRST)
    # group 0 rewards 1, 0.5, 0, 0: mean 0.375, Bessel std sqrt(((.625)^2 + (.125)^2 + 2 (.375)^2) / 3)
    std = math.sqrt((0.625 ** 2 + 0.125 ** 2 + 2 * 0.375 ** 2) / 3)
    a0, a3 = 0.625 / (std + 1e-6), -0.375 / (std + 1e-6)
    assert batch.advantages[0].tolist() == pytest.approx([a0, a0, 0.0, 0.0], rel=1e-6)
    assert batch.advantages[3].tolist() == pytest.approx([a3, 0.0, 0.0, 0.0], rel=1e-6)


def test_truncated_rewards_stay_in_the_group_baseline_rloo_and_its_diagnostics():
    batch, metrics = batch_of(config("algorithm=rloo", "algorithm.mask_truncated=true"), KEEP_FIRST)
    # A_i = G/(G-1) (R_i - mean_g), mean_g = 0.375 over all four responses
    assert batch.advantages[0, 0].item() == pytest.approx(4 / 3 * 0.625)
    assert batch.advantages[3, 0].item() == pytest.approx(4 / 3 * -0.375)
    assert batch.advantages[[1, 2]].abs().sum() == 0
    # the masked truncated responses hold 4 tokens each: not empty; only row 3 (a lone stop token) is
    assert metrics["rollout/rloo/empty_response_frac"] == pytest.approx(1 / 4)
    assert metrics["rollout/rloo/baseline_mean"] == pytest.approx(0.375)  # mean_i (4 * 0.375 - R_i) / 3


def test_token_statistics_leave_truncated_rows_out():
    """REINFORCE++-baseline's global token normalization runs over the tokens that train: mean 0, variance 1."""
    batch, _ = batch_of(config("algorithm=reinforce_pp_baseline", "algorithm.mask_truncated=true"), [True] * 2 * G)
    valid = batch.response_mask.bool()
    assert torch.equal(valid.any(1), torch.tensor([f == "stop" for f in FINISH]))
    a = batch.advantages[valid].double()
    assert a.mean().item() == pytest.approx(0.0, abs=1e-6)  # float32 advantages
    assert a.var(unbiased=False).item() == pytest.approx(1.0, rel=1e-6)


def test_loss_rows_and_overlong_penalties():
    s = samples()
    keep = torch.tensor(KEEP_FIRST)
    assert torch.equal(loss_rows(config(), s, keep), keep)
    assert loss_rows(config("algorithm.mask_truncated=true"), s, keep).tolist() == [True, False, False, True] + \
        [False] * G
    assert overlong_penalties(config(), s) is None
    # T = 4, buffer 2, factor 0.5: lengths <= 2 free, 3 -> (2 - 3) / 2 * 0.5 = -0.25, 4 -> -0.5
    penalty = overlong_penalties(config("data.overlong_buffer_len=2", "data.overlong_penalty_factor=0.5"), s)
    assert penalty.tolist() == [0.0, -0.5, -0.5, 0.0, -0.25, -0.5, 0.0, -0.5]


@pytest.mark.parametrize("overrides,problem", [
    (["data.overlong_buffer_len=4"], "data.overlong_buffer_len=4 must be in [0, rollout.max_response_len=4)"),
    (["data.overlong_buffer_len=-1"], "data.overlong_buffer_len=-1 must be in"),
    (["data.overlong_buffer_len=2", "data.overlong_penalty_factor=0"], "data.overlong_penalty_factor=0.0 must be > 0"),
    (["data.overlong_penalty_factor=2"],
     "data.overlong_penalty_factor=2.0 has no effect with data.overlong_buffer_len=0"),
])
def test_invalid_overlong_settings_are_rejected(overrides, problem):
    from relax.config import ConfigError

    with pytest.raises(ConfigError) as exc:
        config(*overrides)
    assert problem in str(exc.value)


@pytest.mark.slow
def test_a_short_run_logs_the_penalty_and_the_masked_share(small_run, tmp_path, in_process):
    """max_response_len=2 with the tiny random model: most responses are cut off, and in some steps all of them.
    Every step logs the penalty and the masked share in range; a step whose every response was masked takes no
    optimizer step; evaluation scores the task alone (a shaped eval reward would be negative with this factor and
    that many truncated responses)."""
    from mlflow.tracking import MlflowClient

    from relax.runner.train import run

    factor = 10.0
    cfg = load_config(small_run("rollout.max_response_len=2", "data.overlong_buffer_len=1",
                                f"data.overlong_penalty_factor={factor}", "algorithm.mask_truncated=true",
                                "rollout.rollout_batch_size=2", "train.micro_batch_size=4",
                                "train.eval_interval=4", "data.num_eval_prompts=4", "rollout.eval_temperature=1.0",
                                "model.dtype=float32", "cluster.cpus_per_node=1", steps=4))
    result = run(cfg, output_dir=tmp_path / "out")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")

    def history(name: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(result.run_id, name), key=lambda m: m.step)]

    penalty, penalised = history("rollout/overlong_penalty"), history("rollout/overlong_penalized_frac")
    masked, truncated = history("rollout/truncated_masked_frac"), history("rollout/truncated_frac")
    raw = history("rollout/raw_reward")
    assert len(penalty) == len(penalised) == len(masked) == len(raw) == 4
    for p, f, m, t, r in zip(penalty, penalised, masked, truncated, raw, strict=True):
        assert -factor <= p <= 0 and 0 <= f <= 1 and 0 <= r <= 1  # raw_reward: the task's reward, unshaped
        assert m == pytest.approx(t)  # no reward errors: every truncated response is masked
        assert f >= t and p <= -factor * t  # a truncated response has 2 tokens: the full penalty
    assert any(t > 0 for t in truncated)
    # the steps trained, then step 4: the evaluation of the weights of 4 steps, alone
    steps, (last, evaluation) = result.history[:-1], result.history[-1]
    assert [s for s, _ in steps] == [0, 1, 2, 3] and last == 4
    assert evaluation and all(k.startswith("eval/") for k in evaluation)
    # seed 1: steps 0 and 3 have every response cut off, steps 1 and 2 have one that stopped
    assert {m["rollout/truncated_masked_frac"] < 1 for _, m in steps} == {True, False}
    for step, metrics in steps:
        trains = metrics["rollout/truncated_masked_frac"] < 1
        assert ("train/loss" in metrics) == trains, (step, metrics)
        assert all(math.isfinite(v) for k, v in metrics.items() if k.startswith("train/"))
    evaluated = {k: v for _, m in result.history for k, v in m.items() if k.startswith("eval/")}
    assert any("truncated_frac" in k and v > 0.5 for k, v in evaluated.items()), evaluated
    assert all(v >= 0 for v in evaluated.values()), evaluated
