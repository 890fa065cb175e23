"""Non-finite optimizer steps are skipped without a trace in the trainer's state; non-finite logits are never sampled;
the loop stops after train.max_skipped_steps skips in a row."""

from __future__ import annotations

import copy
import logging
import math
import types

import pytest
import torch
from faults_common import PAD, TINY, VOCAB, random_batch

from relax.algorithms import GRPOConfig, PPOConfig
from relax.config import ConfigError, load_config
from relax.config.schema import TrainConfig
from relax.metrics import (
    CRITIC_SKIPPED_STEPS,
    GRAD_NORM,
    LOSS,
    LR,
    NONFINITE_BATCH_VALUES,
    NONFINITE_GRAD_TENSORS,
    SKIPPED_STEPS,
)
from relax.rollout.sampling import NonFiniteLogitsError, sample_tokens
from relax.runner.errors import RunError
from relax.runner.optimizer_steps import SkippedSteps
from relax.train.torch_critic import TorchCritic
from relax.train.torch_policy import TorchPolicy

# a schedule that moves every step (warmup then cosine), so that a skipped schedule step would show
TRAIN = TrainConfig(lr=1e-2, clip_grad=1.0, num_rollout=10, lr_schedule="cosine", warmup_steps=3)


def policy() -> TorchPolicy:
    return TorchPolicy(TINY, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=0, device="cpu", num_threads=1)


def snapshot(trainer) -> dict:
    """Everything a step may change: weights, optimizer state (Adam moments and step counts), lr schedule."""
    return {"model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
            "scheduler": copy.deepcopy(trainer.scheduler.state_dict()), "step": trainer.step}


def assert_same(a, b, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, path


def nan_row(batch, row: int = 1):
    adv = batch.advantages.clone()
    adv[row] = float("nan")
    return batch.with_(advantages=adv)


def test_a_nonfinite_loss_skips_the_step_and_leaves_weights_adam_and_schedule_unchanged(caplog):
    p = policy()
    algo = GRPOConfig()
    first = p.train_step(random_batch(seed=0), algo, per_token=True, micro_batch_size=4)
    assert first[SKIPPED_STEPS] == 0.0 and NONFINITE_GRAD_TENSORS not in first
    before = snapshot(p)
    assert before["optimizer"]["state"], "Adam has moments after one step"
    bad = nan_row(random_batch(seed=1))
    with caplog.at_level(logging.WARNING, logger="relax.train.trainer"):
        out = p.train_step(bad, algo, per_token=True, micro_batch_size=4)
    assert out[SKIPPED_STEPS] == 1.0
    assert math.isnan(out[LOSS])  # NaN: logged as the tracker logs non-finite values (skipped, counted in a tag)
    assert out[NONFINITE_BATCH_VALUES] == float(bad.response_mask[1].sum())
    assert out[NONFINITE_GRAD_TENSORS] > 0
    assert_same(snapshot(p), before)
    assert all(q.grad is None for q in p.model.parameters())
    assert "policy: optimizer step skipped (1 in a row, 1 applied so far)" in caplog.text
    assert f"{int(out[NONFINITE_BATCH_VALUES])} non-finite value(s) in the batch" in caplog.text
    # the next good step is the run's second applied step: the lr the skipped step reported, then a moved schedule
    good = p.train_step(random_batch(seed=2), algo, per_token=True, micro_batch_size=4)
    assert good[SKIPPED_STEPS] == 0.0 and good[LR] == out[LR] and p.step == 2
    assert not torch.equal(p.model.state_dict()["lm_head.weight"], before["model"]["lm_head.weight"])


def test_nonfinite_gradients_under_a_finite_loss_are_skipped_and_named(caplog):
    p = policy()
    algo = GRPOConfig()
    p.train_step(random_batch(seed=0), algo, per_token=True, micro_batch_size=8)
    before = snapshot(p)
    name = "model.layers.1.mlp.up_proj.weight"
    handle = dict(p.model.named_parameters())[name].register_hook(lambda g: g * float("inf"))
    with caplog.at_level(logging.WARNING, logger="relax.train.trainer"):
        out = p.train_step(random_batch(seed=1), algo, per_token=True, micro_batch_size=8)
    handle.remove()
    assert math.isfinite(out[LOSS]) and not math.isfinite(out[GRAD_NORM])
    assert out[SKIPPED_STEPS] == 1.0 and out[NONFINITE_BATCH_VALUES] == 0.0
    assert_same(snapshot(p), before)
    assert f"(first: {name})" in caplog.text


def test_the_critic_skips_a_nonfinite_step_the_same_way():
    c = TorchCritic(TINY, TRAIN, PPOConfig(), vocab_size=VOCAB, pad_token_id=PAD, seed=0, device="cpu", num_threads=1)
    c.train_step(random_batch(seed=0), PPOConfig(), per_token=True, micro_batch_size=8)
    before = snapshot(c)
    bad = random_batch(seed=1)
    returns = bad.returns.clone()
    returns[0, 0] = float("inf")
    out = c.train_step(bad.with_(returns=returns), PPOConfig(), per_token=True, micro_batch_size=8)
    assert out[CRITIC_SKIPPED_STEPS] == 1.0 and out[NONFINITE_BATCH_VALUES] == 1.0
    assert_same(snapshot(c), before)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_the_sampler_refuses_nonfinite_logits(temperature, bad):
    logits = torch.randn(3, 11)
    logits[2, 4] = bad
    with pytest.raises(NonFiniteLogitsError, match=r"1 of 3 rows: its weights are broken"):
        sample_tokens(logits, temperature=temperature, top_k=-1, top_p=1.0, uniforms=torch.rand(3))


def test_the_sampler_still_takes_minus_inf_logits_and_refuses_a_row_of_only_minus_inf():
    logits = torch.randn(2, 11)
    logits[0, :5] = float("-inf")  # masked tokens: a distribution over the rest
    out = sample_tokens(logits, temperature=1.0, top_k=3, top_p=0.9, uniforms=torch.rand(2))
    assert int(out.tokens[0]) >= 5 and torch.isfinite(out.logp).all()
    logits[1] = float("-inf")
    with pytest.raises(NonFiniteLogitsError):
        sample_tokens(logits, temperature=1.0, top_k=-1, top_p=1.0, uniforms=torch.rand(2))


@pytest.mark.parametrize("fast_path", [True, False])
def test_the_rollout_engine_stops_on_broken_weights_and_the_loop_says_so(fast_path):
    from relax.models.hf import build_model
    from relax.rollout.embedded import EmbeddedEngine
    from relax.runner.train import _refusing_broken_weights

    model = build_model(TINY, VOCAB, PAD, seed=0)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    eng = EmbeddedEngine(model, eos_token_ids=[], pad_token_id=PAD, fast_path=fast_path)
    with pytest.raises(NonFiniteLogitsError) as err:
        eng.generate([[1, 2, 3], [4, 5]], n_samples_per_prompt=2, max_new_tokens=3, seed=0)

    class RayTaskErrorLike(NonFiniteLogitsError):  # what ray.get raises: an instance of the cause's class
        cause = err.value

    with pytest.raises(RunError, match=r"^step 5: the rollout engine stopped: the policy's logits are not finite .* "
                                       r"4 of 4 rows: its weights are broken"):
        with _refusing_broken_weights(4):  # the loop's index 4: the fifth step, named 1-based
            raise RayTaskErrorLike("a remote traceback")


def no_checkpoints():
    return types.SimpleNamespace(uses_dir=False, save_dir=None)


def test_skipped_steps_counts_and_stops_after_the_limit_in_a_row():
    s = SkippedSteps(limit=3)
    m = {SKIPPED_STEPS: 1.0, LOSS: 0.1, GRAD_NORM: float("nan")}  # average_over_steps sums the steps' 0/1
    s.count(m, steps=2)  # one of two steps skipped: taken to be the last one
    assert s.in_a_row == 1
    s.check(0, m, no_checkpoints())
    m = {SKIPPED_STEPS: 0.0}
    s.count(m, steps=2)
    assert s.in_a_row == 0
    m = {SKIPPED_STEPS: 2.0, LOSS: float("nan"), GRAD_NORM: float("nan")}
    s.count(m, steps=2)
    s.check(5, m, no_checkpoints())  # 2 in a row < 3
    m = {CRITIC_SKIPPED_STEPS: 2.0, "critic/value_loss": 0.3, "critic/grad_norm": float("inf")}
    s.count(m, steps=2)  # PPO's critic-only steps count too
    assert s.in_a_row == 4
    with pytest.raises(RunError, match=r"step 7: 4 optimizer step\(s\) in a row were skipped .*critic/grad_norm=inf.*"
                                       r"train\.max_skipped_steps=3.*no checkpoint was committed"):
        s.check(6, m, no_checkpoints())


def test_the_new_limits_are_validated():
    for override in ("train.max_skipped_steps=0", "data.reward_timeout_s=0", "data.reward_timeout_s=-1"):
        with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
            load_config([override])
    assert load_config(["data.reward_timeout_s=null"]).data.reward_timeout_s is None
    cfg = load_config([])
    assert cfg.train.max_skipped_steps == 3 and cfg.data.reward_timeout_s == 60.0
