"""GSPO: group-relative advantages, PPO-Clip on a per-sequence importance ratio."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from relax.algorithms.base import Algorithm, AlgorithmConfig, PolicyLossOutput, register
from relax.algorithms.hooks import group_relative_advantages, ppo_clip_output
from relax.algorithms.lazy import lazy_module

torch = lazy_module("torch")  # imported by the first computation, not by the registry
F = lazy_module("relax.algorithms.functional")


@dataclass(frozen=True)
class GSPOConfig(AlgorithmConfig):
    """GSPO's own clip range (the ranges stay the base class's): the GSPO paper's (Zheng et al. 2025, sec. 5.1; also
    verl's GSPO recipes, clip_ratio_low 3e-4 / clip_ratio_high 4e-4). The sequence ratio is the geometric mean of
    the token ratios, whose log is a mean over |o| tokens and spreads ~1/sqrt(|o|) as much as a token's: the
    token-level 0.2 would clip a response only when its mean token log-ratio passed ln 1.2, i.e. almost never."""

    name: str = "gspo"
    eps_clip: float = 3e-4
    eps_clip_high: Optional[float] = 4e-4


def policy_loss(
    cfg: GSPOConfig, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> PolicyLossOutput:
    """PPO-Clip with `s = exp(masked_mean_t(logp - old_logp))` for every token of a response, dual-clipped with
    `dual_clip_c` (`hooks.ppo_clip_output`)."""
    # Masked by the mask itself, not `zero_masked=True`: `PolicyLossFn` does not promise inputs that are 0 on masked
    # tokens (compute_loss zeroes them, a direct caller need not), and a masked token in the sequence mean would
    # change the ratio of every valid token of its response. Same value and gradient when they are 0.
    loss, clipped = F.gspo_loss(logp, old_logp, advantages, mask, cfg.eps_clip, cfg.clip_high)
    # dual_clip_c: a token with A < 0 of a response whose sequence ratio s exceeds c gets the loss c * |A|
    return ppo_clip_output(cfg, loss, clipped, advantages)


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
