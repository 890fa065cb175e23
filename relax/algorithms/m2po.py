"""M2PO: group-relative advantages, PPO-Clip with bounds solved from a second-moment budget."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from relax.algorithms import functional as F
from relax.algorithms.base import Algorithm, AlgorithmConfig, PolicyLossOutput, Violation, register
from relax.algorithms.grpo import group_relative_advantages, violation
from relax.metrics import M2_AFTER, M2_BEFORE


@dataclass(frozen=True)
class M2POConfig(AlgorithmConfig):
    name: str = "m2po"
    kl2_budget: float = 0.01  # second-moment budget per harmful token
    miniclip_low: float = 0.3  # the lower clip margin is never tighter than this
    miniclip_high: float = 0.5  # the upper clip margin is never tighter than this


def policy_loss(
    cfg: M2POConfig, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> PolicyLossOutput:
    """PPO-Clip with `m2po_clip_bounds` (solved over this micro-batch's valid tokens)."""
    eps_low, eps_high, before, after = F.m2po_clip_bounds(
        logp, old_logp, advantages, mask, cfg.kl2_budget, cfg.miniclip_low, cfg.miniclip_high
    )
    loss, clipped = F.ppo_clip_loss(logp, old_logp, advantages, eps_low, eps_high)
    metrics = {
        M2_BEFORE: torch.tensor(before, dtype=loss.dtype, device=loss.device),
        M2_AFTER: torch.tensor(after, dtype=loss.dtype, device=loss.device),
    }
    return PolicyLossOutput(loss=loss, clipped=clipped, metrics=metrics)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AlgorithmConfig)}


def check(cfg: Any) -> list[Violation]:
    a = cfg.algorithm
    out: list[Violation] = []
    for key in ("eps_clip", "eps_clip_high"):
        value = getattr(a, key)
        if value != _DEFAULTS[key]:
            out.append(
                violation(
                    f"algorithm.{key}",
                    f"{key}={value} has no effect: M2PO derives its clip bounds from kl2_budget and ignores "
                    f"eps_clip/eps_clip_high; leave it at {_DEFAULTS[key]} and set miniclip_low/miniclip_high "
                    "for the bounds' floors",
                    "algorithm.miniclip_low",
                    "algorithm.miniclip_high",
                )
            )
    if not a.kl2_budget > 0:
        out.append(
            violation(
                "algorithm.kl2_budget",
                f"kl2_budget={a.kl2_budget} must be > 0: it is the allowed mean squared log-ratio of harmful tokens",
            )
        )
    if not 0 <= a.miniclip_low < 1:
        out.append(
            violation(
                "algorithm.miniclip_low",
                f"miniclip_low={a.miniclip_low} must be in [0, 1): the ratio's lower bound is 1 - miniclip_low",
            )
        )
    if not a.miniclip_high >= 0:
        out.append(
            violation(
                "algorithm.miniclip_high",
                f"miniclip_high={a.miniclip_high} must be >= 0: the ratio's upper bound is 1 + miniclip_high",
            )
        )
    return out


register(
    Algorithm(
        name="m2po",
        config_cls=M2POConfig,
        compute_advantages=group_relative_advantages,
        policy_loss=policy_loss,
        summary="adaptive clipping from a second-moment budget; use it for off-policy data: fully-async "
        "training with large staleness or reusing a rollout for several updates",
        supports_context_parallel=False,
        rowwise_loss=False,  # clip bounds are solved over all tokens of a micro-batch
        metrics=(M2_BEFORE, M2_AFTER),
        check=check,
    )
)
