"""RLOO: leave-one-out baseline, unclipped REINFORCE loss, one synchronous update per rollout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax.algorithms.base import (
    AdvantageInputs,
    AdvantageOutput,
    Algorithm,
    AlgorithmConfig,
    PolicyLossOutput,
    Violation,
    register,
)
from relax.algorithms.hooks import float_rewards, violation
from relax.algorithms.lazy import lazy_module
from relax.metrics import RLOO_METRICS

torch = lazy_module("torch")  # imported by the first computation, not by the registry
F = lazy_module("relax.algorithms.functional")


@dataclass(frozen=True)
class RLOOConfig(AlgorithmConfig):
    name: str = "rloo"


def compute_advantages(cfg: RLOOConfig, inputs: AdvantageInputs) -> AdvantageOutput:
    """`A_i = G/(G-1) * (R_i - mean_g)` on every valid token; the rollout/rloo/* diagnostics as metrics.

    A response is empty when it has no generated token before its stop token: its length (`inputs.lengths`, else
    its valid-token count) minus 1 where `inputs.stopped` (the mask counts the stop token). Without `stopped` a
    response is empty only when it has no token at all (a lone stop token then counts as a response of length 1).
    A response the mask leaves out (algorithm.mask_truncated) keeps its reward in its group's baseline and in the
    reward and advantage diagnostics; its tokens are out of `no_signal_frac`.
    """
    r = float_rewards(inputs)
    adv = F.broadcast_to_tokens(F.rloo_advantages(r, inputs.group_size), inputs.mask)
    G = inputs.group_size
    lengths = (inputs.mask != 0).sum(-1)
    generated = lengths
    if inputs.lengths is not None:
        generated = inputs.lengths.to(device=lengths.device, dtype=lengths.dtype)
    if inputs.stopped is not None:
        generated = generated - inputs.stopped.to(device=lengths.device, dtype=lengths.dtype)
    metrics = F.rloo_diagnostics(
        r,
        torch.arange(r.numel(), device=r.device) // G,
        lengths,
        G,
        generated_lengths=generated,
    )
    return AdvantageOutput(advantages=adv, metrics=metrics)


def policy_loss(
    cfg: RLOOConfig, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> PolicyLossOutput:
    """`-sg(A) * logp`; never clips (pg_clipfrac is 0)."""
    return PolicyLossOutput(loss=F.reinforce_loss(logp, advantages), clipped=None)


def check(cfg: Any) -> list[Violation]:
    a, train = cfg.algorithm, cfg.train
    out: list[Violation] = []
    if not a.normalize_rewards:
        out.append(
            violation(
                "algorithm.normalize_rewards",
                "normalize_rewards=false is not allowed: RLOO's leave-one-out transformation runs in the "
                "normalized-reward path",
            )
        )
    if a.normalize_advantages:
        out.append(
            violation(
                "algorithm.normalize_advantages",
                "normalize_advantages=true is not allowed: whitening would change RLOO's unbiased "
                "leave-one-out advantages and make them depend on the data-parallel partition",
            )
        )
    if train.use_dynamic_global_batch_size:
        out.append(
            violation(
                "train.use_dynamic_global_batch_size",
                "use_dynamic_global_batch_size=true is not allowed: RLOO needs fixed-size rollout batches "
                "(exactly one optimizer update per rollout)",
            )
        )
    if a.use_kl_loss and not train.ref_load:
        out.append(
            violation(
                "train.ref_load",
                f"ref_load={train.ref_load!r} must name a reference checkpoint when algorithm.use_kl_loss=true: "
                "RLOO's KL loss is measured against that checkpoint",
                "algorithm.use_kl_loss",
            )
        )
    return out


register(
    Algorithm(
        name="rloo",
        config_cls=RLOOConfig,
        compute_advantages=compute_advantages,
        policy_loss=policy_loss,
        ignores={
            "kl_coef": "reward-side KL shaping is not implemented for RLOO; use use_kl_loss with kl_loss_coef "
            "(and a train.ref_load checkpoint)",
            "eps_clip": "RLOO's loss has no importance ratio to clip",
            "eps_clip_high": "RLOO's loss has no importance ratio to clip",
            "dual_clip_c": "the dual clip caps the PPO-Clip surrogate, and RLOO's loss -A * logp has no ratio",
            "use_rollout_logprobs": "RLOO's loss has no ratio to an old policy",
            "std_normalization": "RLOO's leave-one-out advantage never divides by a std",
        },
        summary="unbiased leave-one-out baseline, no ratio or clipping; use it for strictly on-policy "
        "synchronous training with one update per rollout",
        supports_async=False,
        supports_multi_step=False,
        per_token_loss=True,
        per_token_loss_required=True,
        metrics=RLOO_METRICS,
        check=check,
    )
)
