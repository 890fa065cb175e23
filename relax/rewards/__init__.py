"""Rewards: `get_reward_fn(spec)` picks a function `fn(response: str, label: str) -> float`;
`score_responses` applies it to a batch, turning failures into 0 and a count."""

from relax.rewards.digits import digits_reward
from relax.rewards.math_reward import arithmetic_reward, extract_boxed, math_reward
from relax.rewards.registry import (
    BUILTIN_REWARDS,
    REWARD_ERRORS_METRIC,
    RewardFn,
    RewardSpecError,
    accepts_prompt,
    get_reward_fn,
    score_responses,
)

__all__ = [
    "BUILTIN_REWARDS",
    "REWARD_ERRORS_METRIC",
    "RewardFn",
    "RewardSpecError",
    "accepts_prompt",
    "arithmetic_reward",
    "digits_reward",
    "extract_boxed",
    "get_reward_fn",
    "math_reward",
    "score_responses",
]
