"""Rewards: `get_reward_fn(spec)` picks a function `fn(response: str, label: str) -> float`;
`score_responses` applies it to a batch and records which calls failed; `overlong_penalty` shapes a reward by
the response's length (DAPO).

Layer 2 of 0-9 (docs/design.md): imports Relax packages of lower layers only.
"""

from relax.rewards.digits import digits_reward
from relax.rewards.math_reward import arithmetic_reward, extract_boxed, math_reward
from relax.rewards.registry import (
    BUILTIN_REWARDS,
    RewardFn,
    RewardSpecError,
    Scores,
    accepts_prompt,
    get_reward_fn,
    score_responses,
)
from relax.rewards.shaping import overlong_penalty

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFn",
    "RewardSpecError",
    "Scores",
    "accepts_prompt",
    "arithmetic_reward",
    "digits_reward",
    "extract_boxed",
    "get_reward_fn",
    "math_reward",
    "overlong_penalty",
    "score_responses",
]
