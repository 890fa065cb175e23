"""CISPO: group-relative advantages, a clipped and stop-gradient importance weight on `A * logp`."""

from __future__ import annotations

from dataclasses import dataclass

from relax.algorithms.base import Algorithm, AlgorithmConfig, PolicyLossOutput, in_range, register
from relax.algorithms.hooks import group_relative_advantages
from relax.algorithms.lazy import lazy_module

torch = lazy_module("torch")  # imported by the first computation, not by the registry
F = lazy_module("relax.algorithms.functional")


@dataclass(frozen=True)
class CISPOConfig(AlgorithmConfig):
    name: str = "cispo"
    # (0, 1]: unlike PPO-Clip's, 1 is a setting here: the weight clip(ratio, 0, 1 + eps_clip_high) is then capped
    # from above only, MiniMax-M1's one-sided clip
    eps_clip: float = in_range(
        0.2, 0, 1, lo_open=True,
        says="must be in (0, 1]: the weight is clipped to [1 - eps_clip, 1 + eps_clip_high]; 1 puts the lower "
        "bound at 0 (no lower clip, MiniMax-M1's one-sided clip), and a larger value would change nothing more")


def policy_loss(
    cfg: CISPOConfig, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> PolicyLossOutput:
    """`-sg(clip(ratio, 1 - eps_clip, 1 + eps_clip_high)) * A * logp`.

    `clipped` marks tokens whose weight was capped (for pg_clipfrac); their gradient is not zeroed.
    """
    loss, clipped = F.cispo_loss_and_clipped(logp, old_logp, advantages, cfg.eps_clip, cfg.clip_high)
    return PolicyLossOutput(loss=loss, clipped=clipped)


register(
    Algorithm(
        name="cispo",
        config_cls=CISPOConfig,
        compute_advantages=group_relative_advantages,
        policy_loss=policy_loss,
        ignores={
            "kl_coef": "reward-side KL shaping is not part of CISPO; use use_kl_loss with kl_loss_coef",
            "dual_clip_c": "the dual clip caps the PPO-Clip surrogate, which CISPO's loss -sg(w) * A * logp is not: "
            "its detached weight w is already clipped to at most 1 + eps_clip_high, which bounds every token's "
            "gradient (lower eps_clip_high for a tighter bound)",
        },
        summary="keeps a bounded gradient for tokens outside the trust region; use it when PPO clipping "
        "discards too much signal (often with eps_clip_high=10, use_tis and a small KL loss)",
        # The seed's objective divides the group's summed token terms by 1 / sum_i |o_i|: the global token mean.
        per_token_loss=True,
    )
)
