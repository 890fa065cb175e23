"""GSPO: group-relative advantages, PPO-Clip on a per-sequence importance ratio."""

from __future__ import annotations

from dataclasses import dataclass

from relax.algorithms.base import Algorithm, AlgorithmConfig, PolicyLossOutput, register
from relax.algorithms.hooks import group_relative_advantages
from relax.algorithms.lazy import lazy_module

torch = lazy_module("torch")  # imported by the first computation, not by the registry
F = lazy_module("relax.algorithms.functional")


@dataclass(frozen=True)
class GSPOConfig(AlgorithmConfig):
    name: str = "gspo"


def policy_loss(
    cfg: GSPOConfig, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> PolicyLossOutput:
    """PPO-Clip with `s = exp(masked_mean_t(logp - old_logp))` for every token of a response."""
    # compute_loss hands a policy loss inputs that are 0 on masked tokens and a 0/1 mask
    loss, clipped = F.gspo_loss(logp, old_logp, advantages, mask, cfg.eps_clip, cfg.clip_high, zero_masked=True)
    return PolicyLossOutput(loss=loss, clipped=clipped)


register(
    Algorithm(
        name="gspo",
        config_cls=GSPOConfig,
        compute_advantages=group_relative_advantages,
        policy_loss=policy_loss,
        ignores={"kl_coef": "reward-side KL shaping is not part of GSPO; use use_kl_loss with kl_loss_coef"},
        summary="one importance ratio per response; use it when token-level ratios are noisy (long "
        "responses, mixture-of-experts policies)",
    )
)
