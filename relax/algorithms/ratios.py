"""The probability ratio of two log-probabilities, `exp(logp - old_logp)`, clamped so that it neither overflows nor
gives NaN gradients: every algorithm computes its ratios here."""

from __future__ import annotations

from typing import Optional

import torch

# Log-ratios are clamped to [-20, 20] before exponentiating: exp(20) = 4.85e8 is finite in fp32 and bf16.
# k3 is unchanged by it (k3 > 10, i.e. clamped anyway, for every x < -2.7 and x > 11); see exp_log_ratio
# for the (vanishing) effect on the policy losses.
LOG_RATIO_CLAMP = 20.0


def exp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """`exp(clamp(log_ratio, -20, 20))`: a ratio that neither overflows nor gives NaN gradients.

    Without the clamp, `exp` overflows to inf for a log-ratio above 88.7 in fp32, and its backward computes
    `grad * inf`, which is NaN where `grad` is 0 (a masked token, a clipped branch, a saturated sigmoid).
    The clamp changes a value only where the ratio is outside [2.1e-9, 4.85e8], and there its gradient is 0:
    PPO-Clip and GSPO (the clipped term already wins unless A < 0 and ratio > 4.85e8, where the loss is
    capped at `4.85e8 * |A|` instead of overflowing, or ratio < 2.1e-9, a change below `2.1e-9 * |A|`),
    CISPO (its weight is clipped to `[1 - eps_clip, 1 + eps_clip_high]` anyway), SAPO (the sigmoid gate is
    saturated), TIS (the weight is capped at `tis_clip`).
    """
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def exp_log_ratio_(log_ratio: torch.Tensor) -> torch.Tensor:
    """`exp_log_ratio` in place, for a temporary that needs no gradient."""
    return log_ratio.clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp_()


def ratio_and_clamp_mask(log_ratio: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(`exp_log_ratio(log_ratio)` computed in place, where its clamp passes a gradient: a bool mask, False beyond
    the clamp and on NaN, or None when that is everywhere).

    On the CPU one min/max reduction (a host read is free there) skips the mask in the usual case where no
    log-ratio reaches the clamp; on other devices the mask is always built, without a sync.
    """
    if log_ratio.device.type == "cpu" and log_ratio.numel() > 0:
        low, high = torch.aminmax(log_ratio)
        if low >= -LOG_RATIO_CLAMP and high <= LOG_RATIO_CLAMP:  # False with a NaN
            return log_ratio.exp_(), None
    clamped = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    inside = clamped == log_ratio
    return clamped.exp_(), inside
