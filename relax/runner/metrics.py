"""Rollout and evaluation metrics: names defined here, once."""

from __future__ import annotations

import torch

from relax.algorithms import functional as F
from relax.backends.batch import Samples
from relax.metrics import (
    EVAL_RESPONSE_LEN,
    EVAL_REWARD,
    EVAL_REWARD_ERRORS,
    EVAL_TRUNCATED_FRAC,
    RAW_REWARD,
    RESPONSE_LEN,
    REWARD_ERRORS,
    TRUNCATED_FRAC,
)


def _basic(samples: Samples, rewards: torch.Tensor) -> tuple[float, float, float]:
    lengths = samples.response_mask.sum(1).float()
    truncated = sum(r == "length" for r in samples.finish_reason) / max(len(samples), 1)
    return float(rewards.mean()), float(lengths.mean()), truncated


def rollout_metrics(samples: Samples, rewards: torch.Tensor, errors: int, group_size: int,
                    algorithm: str) -> dict[str, float]:
    reward, length, truncated = _basic(samples, rewards)
    out = {RAW_REWARD: reward, RESPONSE_LEN: length, TRUNCATED_FRAC: truncated, REWARD_ERRORS: float(errors)}
    if algorithm == "rloo":  # training rollouts only: the diagnostics of the RLOO signal
        group_index = torch.arange(len(samples)) // group_size
        out.update(F.rloo_diagnostics(rewards, group_index, samples.response_mask.sum(1), group_size))
    return out


def eval_metrics(samples: Samples, rewards: torch.Tensor, errors: int) -> dict[str, float]:
    reward, length, truncated = _basic(samples, rewards)
    return {EVAL_REWARD: reward, EVAL_RESPONSE_LEN: length, EVAL_TRUNCATED_FRAC: truncated,
            EVAL_REWARD_ERRORS: float(errors)}
