"""GRPO: group-relative advantages with the PPO-Clip policy loss (the default algorithm); its hooks are shared
(`relax.algorithms.hooks`), as CISPO, GSPO, SAPO and M2PO reuse them."""

from __future__ import annotations

from dataclasses import dataclass

from relax.algorithms.base import Algorithm, AlgorithmConfig, register
from relax.algorithms.hooks import group_relative_advantages, ppo_clip_policy_loss


@dataclass(frozen=True)
class GRPOConfig(AlgorithmConfig):
    name: str = "grpo"


register(
    Algorithm(
        name="grpo",
        config_cls=GRPOConfig,
        compute_advantages=group_relative_advantages,
        policy_loss=ppo_clip_policy_loss,
        ignores={"kl_coef": "reward-side KL shaping is not part of GRPO; use use_kl_loss with kl_loss_coef"},
        summary="the default: group-relative rewards, PPO-Clip; use it when you have a verifiable reward "
        "and several samples per prompt",
    )
)
