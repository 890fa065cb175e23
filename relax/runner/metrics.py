"""Rollout and evaluation metrics of a generated batch (names in relax.metrics)."""

from __future__ import annotations

import torch

from relax.backends.batch import Samples
from relax.metrics import (
    EVAL_RESPONSE_LEN,
    EVAL_REWARD,
    EVAL_REWARD_ERRORS,
    EVAL_TRUNCATED_FRAC,
    RAW_REWARD,
    RESPONSE_LEN,
    REWARD_DROPPED_FRAC,
    REWARD_ERRORS,
    SAMPLING_DROPPED_MASS,
    TRUNCATED_FRAC,
)
from relax.rewards.registry import Scores


def _basic(samples: Samples, rewards: torch.Tensor, scored: torch.Tensor) -> tuple[float, float, float]:
    """(mean reward of the `scored` responses (NaN if none), mean response length, truncated share)."""
    lengths = samples.response_mask.sum(1).float()
    truncated = sum(r == "length" for r in samples.finish_reason) / max(len(samples), 1)
    reward = float(rewards[scored].mean()) if bool(scored.any()) else float("nan")
    return reward, float(lengths.mean()), truncated


def rollout_metrics(samples: Samples, rewards: torch.Tensor, kept: torch.Tensor, errors: int) -> dict[str, float]:
    """`kept` [N] bool: responses of groups that train (the others had a failed reward call in their group);
    `rollout/raw_reward` is their mean."""
    reward, length, truncated = _basic(samples, rewards, kept)
    return {RAW_REWARD: reward, RESPONSE_LEN: length, TRUNCATED_FRAC: truncated, REWARD_ERRORS: float(errors),
            REWARD_DROPPED_FRAC: 1.0 - float(kept.float().mean()), SAMPLING_DROPPED_MASS: samples.dropped_mass}


def eval_metrics(samples: Samples, scores: Scores) -> dict[str, float]:
    rewards = torch.tensor(scores.rewards, dtype=torch.float32)
    ok = ~torch.tensor(scores.failed, dtype=torch.bool)
    reward, length, truncated = _basic(samples, rewards, ok)
    return {EVAL_REWARD: reward, EVAL_RESPONSE_LEN: length, EVAL_TRUNCATED_FRAC: truncated,
            EVAL_REWARD_ERRORS: float(scores.errors)}
