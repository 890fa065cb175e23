"""Dynamic sampling's options (rollout.filter_groups, over_sampling_batch_size, max_filter_rounds): the derived round
size, and every rule, before start."""

from __future__ import annotations

import pytest

from relax import algorithms
from relax.config import ConfigError, load_config


def violations(overrides: list[str]) -> dict[str, str]:
    """field -> message of every violation of `overrides`."""
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    return {f: v.message for v in err.value.violations for f in v.fields}


def test_rounds_draw_rollout_batch_size_prompts_unless_told():
    assert load_config([]).rollout.over_sampling_batch_size is None  # no dynamic sampling: no rounds
    assert load_config(["rollout.filter_groups=true"]).rollout.over_sampling_batch_size == 8
    cfg = load_config(["rollout.filter_groups=true", "rollout.over_sampling_batch_size=12",
                       "rollout.max_filter_rounds=2"])
    assert (cfg.rollout.over_sampling_batch_size, cfg.rollout.max_filter_rounds) == (12, 2)


@pytest.mark.parametrize("name", algorithms.names())
def test_allowed_exactly_for_the_algorithms_with_a_group_baseline(name):
    overrides = [f"algorithm={name}", "rollout.filter_groups=true"]
    extra = {"rloo": ["train.global_batch_size=64"], "ppo": [], "reinforce_pp": ["algorithm.kl_coef=0.01"]}
    overrides += extra.get(name, [])
    if algorithms.get(name).group_relative:
        assert load_config(overrides).rollout.filter_groups  # rloo too: its batch stays fixed-size, one update
    else:
        found = violations(overrides)
        assert "rollout.filter_groups" in found
        assert "do not come from a group baseline" in found["rollout.filter_groups"]


def all_equal_group_advantage(name: str) -> float:
    """The largest |advantage| that `name`'s own advantage hook, with algorithm.normalize_rewards=false, gives a group
    whose rewards are all equal (1, 1), beside a mixed group (0, 1)."""
    import torch

    from relax.algorithms.base import AdvantageInputs

    algo = algorithms.get(name)
    inputs = AdvantageInputs(rewards=torch.tensor([1.0, 1.0, 0.0, 1.0]), mask=torch.ones(4, 3), group_size=2)
    out = algo.compute_advantages(algo.config_cls(normalize_rewards=False), inputs)
    return float(out.advantages[:2].abs().max())


# group-relative algorithms that read normalize_rewards (one that ignores it refuses a change: `_ignored`)
READ_NORMALIZE_REWARDS = [n for n in algorithms.names()
                          if algorithms.get(n).group_relative and "normalize_rewards" not in algorithms.get(n).ignores]


@pytest.mark.parametrize("name", READ_NORMALIZE_REWARDS)
def test_refused_with_raw_reward_advantages_where_an_all_equal_group_keeps_a_signal(name):
    assert {"grpo", "cispo", "gspo", "sapo", "m2po"} <= set(READ_NORMALIZE_REWARDS)
    overrides = [f"algorithm={name}", "rollout.filter_groups=true"]
    overrides += {"rloo": ["train.global_batch_size=64"]}.get(name, [])
    assert load_config(overrides).rollout.filter_groups  # normalize_rewards=true: a group baseline, allowed
    found = violations(overrides + ["algorithm.normalize_rewards=false"])
    if all_equal_group_advantage(name) > 0:  # raw rewards: dynamic sampling would drop groups with a signal
        message = found["rollout.filter_groups"]
        assert found["algorithm.normalize_rewards"] == message
        assert "not supported with algorithm.normalize_rewards=false" in message
        assert "still carry a learning signal" in message
    else:  # rloo: a leave-one-out baseline whatever the key; its own rule refuses normalize_rewards=false
        assert "rollout.filter_groups" not in found
        assert "normalize_rewards=false is not allowed" in found["algorithm.normalize_rewards"]


def test_bad_values_are_all_reported_at_once():
    found = violations(["rollout.filter_groups=true", "rollout.over_sampling_batch_size=4",
                        "rollout.max_filter_rounds=0"])
    assert "must be >= rollout.rollout_batch_size=8" in found["rollout.over_sampling_batch_size"]
    assert "must be >= 1" in found["rollout.max_filter_rounds"]


def test_round_options_without_filter_groups_are_rejected_as_having_no_effect():
    found = violations(["rollout.over_sampling_batch_size=16", "rollout.max_filter_rounds=2"])
    for key in ("rollout.over_sampling_batch_size", "rollout.max_filter_rounds"):
        assert "has no effect without rollout.filter_groups=true" in found[key]
