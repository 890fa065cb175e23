"""Whatever a masked token holds (NaN, +-inf) changes no advantage, return or loss: the advantage hooks of the
token-level estimators (REINFORCE++, PPO's GAE) and the functions under them, and GSPO's policy loss called
directly, not only through `compute_loss` (which zeroes masked tokens itself)."""

from __future__ import annotations

import math

import pytest
import torch

from relax.algorithms import AdvantageInputs, LossBatch, compute_loss, get
from relax.algorithms import functional as F

D = torch.float64
# an interior gap (an episode's observation), a tail of padding, a response left out of the loss entirely
MASK = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=D)
GARBAGE = [math.nan, -math.inf, math.inf]


def finite_inputs(token_rewards: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    old = -torch.rand(3, 6, generator=g, dtype=D)
    rewards = torch.randn(3, 6, generator=g, dtype=D) if token_rewards else torch.tensor([1.0, -0.5, 0.0], dtype=D)
    return {"rewards": rewards, "old_logp": old, "ref_logp": old + 0.3 * torch.randn(3, 6, generator=g, dtype=D),
            "values": torch.randn(3, 6, generator=g, dtype=D)}


def on_masked(inputs: dict[str, torch.Tensor], value: float) -> dict[str, torch.Tensor]:
    """`inputs` with `value` on every masked token (a [B] reward: on the response without any valid token)."""
    out = {}
    for key, x in inputs.items():
        if x.dim() == 1:
            out[key] = torch.where(MASK.any(-1), x, value)
        else:
            out[key] = torch.where(MASK != 0, x, value)
    return out


CASES = [
    ("reinforce_pp", {}),
    ("reinforce_pp", {"gamma": 0.9}),
    ("ppo", {}),
    ("ppo", {"gamma": 0.9, "lambd": 0.8}),
    ("ppo", {"kl_coef": 0.1, "gamma": 0.9, "lambd": 0.8}),
    ("ppo", {"kl_coef": 0.1, "normalize_advantages": True}),
]


@pytest.mark.parametrize("token_rewards", [False, True])
@pytest.mark.parametrize("garbage", GARBAGE)
@pytest.mark.parametrize("name,options", CASES)
def test_nonfinite_masked_inputs_give_the_advantages_of_zeros(name, options, garbage, token_rewards):
    algo = get(name)
    cfg = algo.config_cls(**options)
    clean = on_masked(finite_inputs(token_rewards), 0.0)
    want = algo.compute_advantages(cfg, AdvantageInputs(mask=MASK, group_size=1, **clean))
    got = algo.compute_advantages(cfg, AdvantageInputs(mask=MASK, group_size=1, **on_masked(clean, garbage)))
    assert torch.isfinite(want.advantages).all()
    assert torch.equal(got.advantages, want.advantages)
    assert torch.all(got.advantages[MASK == 0] == 0)
    if want.returns is not None:
        assert torch.equal(got.returns, want.returns)
        assert torch.all(got.returns[MASK == 0] == 0)


def test_the_functions_themselves_ignore_nonfinite_masked_tokens():
    clean = on_masked(finite_inputs(False), 0.0)
    bad = on_masked(clean, math.nan)
    assert torch.equal(F.reinforce_pp_returns(bad["rewards"], MASK, bad["old_logp"], bad["ref_logp"], 0.05, 0.9),
                       F.reinforce_pp_returns(clean["rewards"], MASK, clean["old_logp"], clean["ref_logp"], 0.05, 0.9))
    for got, want in zip(F.gae(bad["rewards"], bad["values"], MASK, 0.9, 0.8),
                         F.gae(clean["rewards"], clean["values"], MASK, 0.9, 0.8), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(F.token_rewards(bad["rewards"], MASK), F.token_rewards(clean["rewards"], MASK))
    assert torch.equal(F.broadcast_to_tokens(bad["rewards"], MASK), F.broadcast_to_tokens(clean["rewards"], MASK))


# ------------------------------------------------------------------------------------------ GSPO's policy loss hook


def gspo_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(12)
    old = -torch.rand(3, 6, generator=g, dtype=D)
    logp = old + 0.1 * torch.randn(3, 6, generator=g, dtype=D)
    return logp, old, torch.randn(3, 6, generator=g, dtype=D)


@pytest.mark.parametrize("garbage", [-5.0, *GARBAGE])
def test_gspo_hook_masks_its_sequence_ratio_itself(garbage):
    # the policy-loss contract (base.PolicyLossFn) says nothing of what masked entries hold: a direct caller's
    # masked log-probs must not enter the sequence ratio of the response's valid tokens
    logp, old, adv = gspo_inputs()
    cfg = get("gspo").config_cls()
    zeros = [torch.where(MASK != 0, x, 0.0) for x in (logp, old, adv)]
    x = zeros[0].clone().requires_grad_()
    want = get("gspo").policy_loss(cfg, x, zeros[1], zeros[2], MASK)
    want.loss.sum().backward()
    y = torch.where(MASK != 0, logp, garbage).requires_grad_()
    got = get("gspo").policy_loss(cfg, y, torch.where(MASK != 0, old, garbage), zeros[2], MASK)
    got.loss.sum().backward()
    keep = MASK != 0
    assert torch.equal(got.loss[keep], want.loss[keep]) and torch.equal(got.clipped & keep, want.clipped & keep)
    assert torch.equal(y.grad[keep], x.grad[keep]) and torch.all(y.grad[~keep] == 0)
    # and that is the formula: s = exp(mean of the valid tokens' log-ratios), 1 for the empty response
    s = torch.stack([((logp[b] - old[b])[keep[b]].mean()).exp() if keep[b].any() else torch.tensor(1.0, dtype=D)
                     for b in range(3)])[:, None]
    formula = torch.maximum(-s * zeros[2], -s.clamp(1 - cfg.eps_clip, 1 + cfg.clip_high) * zeros[2])
    torch.testing.assert_close(got.loss[keep], formula.expand_as(got.loss)[keep], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("per_token", [True, False])
def test_gspo_compute_loss_is_unchanged(per_token):
    # control: compute_loss zeroes masked tokens before the hook, so its loss, metrics and gradient are those of
    # the fast path (zero_masked=True) that the hook used to take, whatever the masked tokens hold
    logp, old, adv = gspo_inputs()
    cfg = get("gspo").config_cls(eps_clip=0.05)
    x = torch.where(MASK != 0, logp, math.nan).requires_grad_()
    batch = LossBatch(logp=x, old_logp=torch.where(MASK != 0, old, math.inf), advantages=adv, mask=MASK)
    denominator = float(MASK.sum()) if per_token else float(MASK.any(-1).sum())
    loss, metrics = compute_loss(cfg, batch, per_token=per_token, denominator=denominator)
    loss.backward()
    keep = MASK != 0
    z = torch.where(keep, logp, 0.0).requires_grad_()
    fast, clipped = F.gspo_loss(z, torch.where(keep, old, 0.0), torch.where(keep, adv, 0.0), MASK, 0.05,
                                zero_masked=True)
    want = F.masked_sum_reduce(fast, keep, per_token, denominator)
    want.backward()
    assert torch.equal(loss, want) and torch.equal(x.grad, torch.where(keep, z.grad, 0.0))
    assert metrics["train/pg_clipfrac"] == torch.count_nonzero(clipped & keep) / MASK.sum()
    assert 0 < metrics["train/pg_clipfrac"] < 1  # both branches are exercised
