"""M2PO: group-relative advantages, PPO-Clip with bounds solved from a second-moment budget."""

from __future__ import annotations

from dataclasses import dataclass

from relax.algorithms.base import (
    Algorithm,
    AlgorithmConfig,
    PolicyLossOutput,
    StepStatistics,
    in_range,
    non_negative,
    positive,
    register,
)
from relax.algorithms.hooks import group_relative_advantages, ppo_clip_output
from relax.algorithms.lazy import lazy_module
from relax.metrics import M2_AFTER, M2_BEFORE

torch = lazy_module("torch")  # imported by the first computation, not by the registry
F = lazy_module("relax.algorithms.functional")


@dataclass(frozen=True)
class M2POConfig(AlgorithmConfig):
    name: str = "m2po"
    kl2_budget: float = positive(0.01, says="must be a finite number > 0: it is the allowed mean squared log-ratio "
                                 "of harmful tokens")
    # the clip margins are never tighter than these
    miniclip_low: float = in_range(0.3, 0, 1, hi_open=True, says="must be in [0, 1): the ratio's lower bound is "
                                   "1 - miniclip_low")
    miniclip_high: float = non_negative(0.5, says="must be a finite number >= 0: the ratio's upper bound is "
                                        "1 + miniclip_high")


EPS_LOW = "eps_low"
EPS_HIGH = "eps_high"


def step_statistics(
    cfg: M2POConfig, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> StepStatistics:
    """`m2po_clip_bounds` over every valid token of the whole optimizer step: the harmful set, the water
    filling and both M2 metrics -> {eps_low, eps_high, train/ppo_kl_m2_before, train/ppo_kl_m2_after}."""
    eps_low, eps_high, before, after = F.m2po_clip_bounds(
        logp, old_logp, advantages, mask, cfg.kl2_budget, cfg.miniclip_low, cfg.miniclip_high
    )
    return {EPS_LOW: eps_low, EPS_HIGH: eps_high, M2_BEFORE: before, M2_AFTER: after}


def policy_loss(
    cfg: M2POConfig,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    stats: StepStatistics,
) -> PolicyLossOutput:
    """PPO-Clip with the bounds of `stats` (`step_statistics` of the whole step), dual-clipped with `dual_clip_c`
    (`hooks.ppo_clip_output`: the cap `c * |A|` of a token with A < 0 does not depend on the solved bounds); the M2
    metrics are the step's."""
    loss, clipped = F.ppo_clip_loss(logp, old_logp, advantages, stats[EPS_LOW], stats[EPS_HIGH])
    metrics = {name: torch.tensor(stats[name], dtype=loss.dtype, device=loss.device) for name in (M2_BEFORE, M2_AFTER)}
    return ppo_clip_output(cfg, loss, clipped, advantages, metrics=metrics)


register(
    Algorithm(
        name="m2po",
        config_cls=M2POConfig,
        compute_advantages=group_relative_advantages,
        policy_loss=policy_loss,
        ignores={
            "kl_coef": "reward-side KL shaping is not part of M2PO; use use_kl_loss with kl_loss_coef",
            "eps_clip": "M2PO derives its clip bounds from kl2_budget; set miniclip_low/miniclip_high for their floors",
            "eps_clip_high": "M2PO derives its clip bounds from kl2_budget; set miniclip_low/miniclip_high for their "
            "floors",
        },
        summary="adaptive clipping from a second-moment budget; use it for off-policy data: fully-async "
        "training with large staleness or reusing a rollout for several updates",
        supports_context_parallel=False,
        step_statistics=step_statistics,  # the harmful set and bounds are the whole optimizer step's
        metrics=(M2_BEFORE, M2_AFTER),
    )
)
