"""Whatever a masked token holds (NaN, +-inf) changes no advantage or return: the advantage hooks of the token-level
estimators (REINFORCE++, PPO's GAE) and the functions under them."""

from __future__ import annotations

import math

import pytest
import torch

from relax.algorithms import AdvantageInputs, get
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
