"""Hooks and checks that several algorithms' registry entries share: the group-relative advantages (GRPO and the
algorithms built on it), the PPO-Clip policy loss, and the violations of their own checks."""

from __future__ import annotations

from typing import Any

from relax.algorithms.base import AdvantageInputs, AdvantageOutput, AlgorithmConfig, PolicyLossOutput, Violation
from relax.algorithms.lazy import lazy_module

torch = lazy_module("torch")  # imported by the first computation, not by the registry
F = lazy_module("relax.algorithms.functional")


def float_rewards(inputs: AdvantageInputs) -> torch.Tensor:
    """The rewards as a float tensor (float32 unless already floating) on the mask's device."""
    r = inputs.rewards
    if not torch.is_floating_point(r):
        r = r.to(torch.float32)
    return r.to(inputs.mask.device)


def group_relative_advantages(cfg: AlgorithmConfig, inputs: AdvantageInputs) -> AdvantageOutput:
    """GRPO-style advantages broadcast to tokens.

    With `normalize_rewards` the rewards become `(R - mean_g) / (std_g + 1e-6)` (no division when
    `std_normalization=false`); without it the raw rewards are used. `normalize_advantages` then
    whitens over the valid tokens of the whole batch.
    """
    r = float_rewards(inputs)
    a = F.grpo_advantages(r, inputs.group_size, cfg.std_normalization) if cfg.normalize_rewards else r
    adv = F.broadcast_to_tokens(a, inputs.mask)
    if cfg.normalize_advantages:
        adv = F.global_token_normalize(adv, inputs.mask)
    return AdvantageOutput(advantages=adv)


def ppo_clip_output(
    cfg: AlgorithmConfig, loss: torch.Tensor, clipped: torch.Tensor, advantages: torch.Tensor, **extra: Any
) -> PolicyLossOutput:
    """The `PolicyLossOutput` of a PPO-Clip loss (plain, GSPO's sequence ratio, M2PO's bounds): with
    `cfg.dual_clip_c` set, dual-clipped (`functional.dual_clip`) and its capped tokens in `dual_clipped`; the one
    place that applies the option, so every PPO-Clip algorithm honours it alike. `extra`: more output fields."""
    if cfg.dual_clip_c is None:
        return PolicyLossOutput(loss=loss, clipped=clipped, **extra)
    loss, dual_clipped = F.dual_clip(loss, advantages, cfg.dual_clip_c)
    return PolicyLossOutput(loss=loss, clipped=clipped, dual_clipped=dual_clipped, **extra)


def ppo_clip_policy_loss(
    cfg: AlgorithmConfig, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> PolicyLossOutput:
    """PPO-Clip with `eps_clip` / `eps_clip_high`, dual-clipped with `dual_clip_c` (`ppo_clip_output`)."""
    loss, clipped = F.ppo_clip_loss(logp, old_logp, advantages, cfg.eps_clip, cfg.clip_high)
    return ppo_clip_output(cfg, loss, clipped, advantages)


def violation(field: str, message: str, *more_fields: str) -> Violation:
    return Violation(fields=(field, *more_fields), message=message)
