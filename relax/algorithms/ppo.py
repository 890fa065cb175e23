"""PPO: a learned critic, GAE advantages and returns, PPO-Clip for the actor, clipped value loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from relax.algorithms.base import (
    AdvantageInputs,
    AdvantageOutput,
    Algorithm,
    AlgorithmConfig,
    Violation,
    in_range,
    non_negative,
    positive,
    register,
)
from relax.algorithms.hooks import float_rewards, ppo_clip_policy_loss, violation
from relax.algorithms.lazy import lazy_module
from relax.metrics import VALUE_CLIPFRAC, VALUE_LOSS

torch = lazy_module("torch")  # imported by the first computation, not by the registry
F = lazy_module("relax.algorithms.functional")


@dataclass(frozen=True)
class PPOConfig(AlgorithmConfig):
    name: str = "ppo"
    # On by default, as verl's compute_gae_advantage_return always whitens (masked_whiten): raw GAE advantages of
    # a fresh critic are ~R, so every sampled response (the wrong ones too) would be pushed up until it catches up
    normalize_advantages: bool = True
    gamma: float = in_range(1.0, 0, 1, says="must be in [0, 1]: it is the GAE discount factor")
    lambd: float = in_range(1.0, 0, 1, says="must be in [0, 1]: it is the GAE lambda")
    value_clip: float = positive(0.2, says="must be a finite number > 0: the critic's clip range")
    num_critic_only_steps: int = non_negative(0, says="must be >= 0: it counts the initial critic-only steps")
    # finite: an lr of inf makes the critic's weights inf or NaN in its first step
    critic_lr: Optional[float] = positive(
        None, optional=True, says="must be a finite number > 0: it is a learning rate (null uses train.lr)")


def compute_advantages(cfg: PPOConfig, inputs: AdvantageInputs) -> AdvantageOutput:
    """GAE over token rewards: `R` on the last valid token, minus `kl_coef * (old_logp - ref_logp)` per
    token when `kl_coef > 0`. `normalize_advantages` (default true for PPO) whitens the advantages over every valid
    token of the batch (not the returns, which stay the critic's targets)."""
    if inputs.values is None:
        raise ValueError("PPO advantages need the critic's values (AdvantageInputs.values)")
    r = float_rewards(inputs).to(inputs.values.dtype)
    if cfg.kl_coef > 0:
        if inputs.old_logp is None or inputs.ref_logp is None:
            raise ValueError(f"kl_coef={cfg.kl_coef} needs AdvantageInputs.old_logp and ref_logp")
        # a `where`, not a product with the mask: a masked token's log-probs may be NaN or inf, and NaN * 0 is NaN
        k1 = torch.where(inputs.mask != 0, F.kl_estimate(inputs.old_logp, inputs.ref_logp, "k1"), 0.0)
        r = F.token_rewards(r, inputs.mask) - cfg.kl_coef * k1
    adv, returns = F.gae(r, inputs.values, inputs.mask, cfg.gamma, cfg.lambd)
    if cfg.normalize_advantages:
        adv = F.global_token_normalize(adv, inputs.mask)
    return AdvantageOutput(advantages=adv, returns=returns)


def check(cfg: Any) -> list[Violation]:
    out: list[Violation] = []
    if not cfg.cluster.colocate:
        out.append(
            violation(
                "cluster.colocate",
                "cluster.colocate=false is not supported: PPO runs synchronous colocate only (actor, rollout and "
                "critic share devices)",
            )
        )
    return out


register(
    Algorithm(
        name="ppo",
        config_cls=PPOConfig,
        compute_advantages=compute_advantages,
        policy_loss=ppo_clip_policy_loss,
        ignores={
            "normalize_rewards": "PPO's GAE uses the raw rewards",
            "std_normalization": "PPO's GAE uses the raw rewards",
        },
        summary="actor-critic with per-token credit assignment; use it when a learned value baseline helps "
        "(one sample per prompt, long responses) and you can afford a critic",
        requires_critic=True,
        critic_only_steps=lambda cfg: cfg.num_critic_only_steps,
        supports_async=False,
        group_relative=False,
        token_rewards=True,
        metrics=(VALUE_LOSS, VALUE_CLIPFRAC),
        check=check,
    )
)
