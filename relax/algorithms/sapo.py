"""SAPO: group-relative advantages with a smooth sigmoid gate instead of a hard clip."""

from __future__ import annotations

from dataclasses import dataclass

from relax.algorithms.base import Algorithm, AlgorithmConfig, PolicyLossOutput, positive, register
from relax.algorithms.hooks import group_relative_advantages
from relax.algorithms.lazy import lazy_module

torch = lazy_module("torch")  # imported by the first computation, not by the registry
F = lazy_module("relax.algorithms.functional")


@dataclass(frozen=True)
class SAPOConfig(AlgorithmConfig):
    name: str = "sapo"
    # the sigmoid gate's temperatures; finite: at tau = inf the gate (4/tau) * sigmoid(tau * (ratio - 1)) is
    # 0 * inf = NaN at ratio 1
    tau_pos: float = positive(1.0, says="must be a finite number > 0: it is the sigmoid gate's temperature where A > 0")
    tau_neg: float = positive(1.05, says="must be a finite number > 0: it is the sigmoid gate's temperature where "
                              "A <= 0 (higher: stronger suppression)")


def policy_loss(
    cfg: SAPOConfig, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> PolicyLossOutput:
    """`-(4/tau) * sigmoid(tau * (ratio - 1)) * A`; never hard-clips."""
    return PolicyLossOutput(loss=F.sapo_loss(logp, old_logp, advantages, cfg.tau_pos, cfg.tau_neg), clipped=None)


register(
    Algorithm(
        name="sapo",
        config_cls=SAPOConfig,
        compute_advantages=group_relative_advantages,
        policy_loss=policy_loss,
        ignores={
            "kl_coef": "reward-side KL shaping is not part of SAPO; use use_kl_loss with kl_loss_coef",
            "eps_clip": "SAPO gates the ratio with a sigmoid (tau_pos/tau_neg) instead of clipping it",
            "eps_clip_high": "SAPO gates the ratio with a sigmoid (tau_pos/tau_neg) instead of clipping it",
            "dual_clip_c": "the dual clip caps the PPO-Clip surrogate, which SAPO's loss is not: its sigmoid gate "
            "already bounds every token's loss by (4 / tau_neg) * |A| where A < 0, whatever the ratio",
        },
        summary="a soft, differentiable trust region; use it when hard clipping makes training unstable "
        "or wastes gradient",
    )
)
