"""REINFORCE++: KL-shaped token returns, global token normalization, PPO-Clip."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax.algorithms.base import (
    AdvantageInputs,
    AdvantageOutput,
    Algorithm,
    AlgorithmConfig,
    Violation,
    in_range,
    positive,
    register,
)
from relax.algorithms.hooks import float_rewards, ppo_clip_policy_loss, violation
from relax.algorithms.lazy import lazy_module

F = lazy_module("relax.algorithms.functional")


@dataclass(frozen=True)
class ReinforcePPConfig(AlgorithmConfig):
    name: str = "reinforce_pp"
    kl_coef: float = positive(0.01, says="must be a finite number > 0: REINFORCE++ puts its KL penalty (k1) into "
                              "the token rewards")
    gamma: float = in_range(1.0, 0, 1, says="must be in [0, 1]: it is the return discount")
    normalize_advantages: bool = True  # always: the global token normalization is part of the estimator


def compute_advantages(cfg: ReinforcePPConfig, inputs: AdvantageInputs) -> AdvantageOutput:
    """`r_t = mask_t (-kl_coef (old_logp_t - ref_logp_t) + [last] R)`, `G_t` its return discounted over the valid
    tokens of the response (`functional.reinforce_pp_returns`: an episode's observations are not steps of the
    policy), then whitening over every valid token of the batch."""
    if inputs.old_logp is None or inputs.ref_logp is None:
        raise ValueError("REINFORCE++ advantages need AdvantageInputs.old_logp and ref_logp (KL-shaped rewards)")
    r = float_rewards(inputs).to(inputs.old_logp.dtype)
    returns = F.reinforce_pp_returns(r, inputs.mask, inputs.old_logp, inputs.ref_logp, cfg.kl_coef, cfg.gamma)
    return AdvantageOutput(advantages=F.global_token_normalize(returns, inputs.mask))


def check_always_normalized(cfg: Any, name: str) -> list[Violation]:
    """REINFORCE++ (both) whiten their advantages over the batch's valid tokens by definition."""
    if cfg.algorithm.normalize_advantages:
        return []
    return [violation("algorithm.normalize_advantages",
                      f"normalize_advantages=false is not allowed: {name} always applies the global token "
                      "normalization (it is part of the estimator)")]


def check(cfg: Any) -> list[Violation]:
    a = cfg.algorithm
    out: list[Violation] = check_always_normalized(cfg, "REINFORCE++")
    if a.use_kl_loss:
        out.append(
            violation(
                "algorithm.use_kl_loss",
                "use_kl_loss=true is not allowed: REINFORCE++ has its KL in the shaped reward (kl_coef); "
                "for a separate KL loss use reinforce_pp_baseline",
            )
        )
    return out


register(
    Algorithm(
        name="reinforce_pp",
        config_cls=ReinforcePPConfig,
        compute_advantages=compute_advantages,
        policy_loss=ppo_clip_policy_loss,
        ignores={
            "normalize_rewards": "REINFORCE++ shapes the raw reward into token returns",
            "std_normalization": "REINFORCE++ shapes the raw reward into token returns",
        },
        summary="critic-free, token-level KL-shaped returns with batch-wide normalization; use it when one "
        "sample per prompt is all you can afford",
        requires_reference=True,
        supports_async=False,
        group_relative=False,
        token_rewards=True,
        per_token_loss=False,
        per_token_loss_required=True,
        check=check,
    )
)
