"""REINFORCE++-baseline: group-mean baseline, global token normalization, PPO-Clip, KL as a k2 loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax.algorithms.base import AdvantageInputs, AdvantageOutput, Algorithm, AlgorithmConfig, Violation, register
from relax.algorithms.hooks import float_rewards, ppo_clip_policy_loss, violation
from relax.algorithms.lazy import lazy_module
from relax.algorithms.reinforce_pp import check_always_normalized

F = lazy_module("relax.algorithms.functional")


@dataclass(frozen=True)
class ReinforcePPBaselineConfig(AlgorithmConfig):
    name: str = "reinforce_pp_baseline"
    normalize_advantages: bool = True  # always: the global token normalization is part of the estimator
    kl_loss_type: str = "k2"  # the only KL this estimator supports (as a loss, never in the advantage)


def compute_advantages(cfg: ReinforcePPBaselineConfig, inputs: AdvantageInputs) -> AdvantageOutput:
    """`C = R - mean_g` on every valid token, then whitening over every valid token of the batch."""
    c = F.group_mean_baseline(float_rewards(inputs), inputs.group_size)
    return AdvantageOutput(advantages=F.global_token_normalize(F.broadcast_to_tokens(c, inputs.mask), inputs.mask))


def check(cfg: Any) -> list[Violation]:
    a = cfg.algorithm
    out: list[Violation] = check_always_normalized(cfg, "REINFORCE++-baseline")
    if a.use_kl_loss and a.kl_loss_type != "k2":
        out.append(
            violation(
                "algorithm.kl_loss_type",
                f"kl_loss_type={a.kl_loss_type!r} must be 'k2': REINFORCE++-baseline's KL loss is the k2 estimator",
                "algorithm.use_kl_loss",
            )
        )
    return out


register(
    Algorithm(
        name="reinforce_pp_baseline",
        config_cls=ReinforcePPBaselineConfig,
        compute_advantages=compute_advantages,
        policy_loss=ppo_clip_policy_loss,
        ignores={
            "kl_coef": "REINFORCE++-baseline keeps KL out of the advantage; use use_kl_loss with kl_loss_type=k2",
            "normalize_rewards": "REINFORCE++-baseline's baseline is the plain group mean",
            "std_normalization": "REINFORCE++-baseline never divides by a std",
        },
        summary="group-mean baseline with batch-wide normalization; use it as a critic-free alternative "
        "to GRPO that does not divide by a per-group std",
        supports_async=False,
        per_token_loss=False,
        per_token_loss_required=True,
        check=check,
    )
)
