"""The loss a train backend calls per micro-batch: the algorithm's policy loss plus the shared terms.

`compute_loss` looks the algorithm up by `cfg.name`, takes its per-token policy loss and applies,
identically for every algorithm: truncated importance sampling (`use_tis`), the KL loss
(`use_kl_loss`), the entropy bonus (`entropy_coef`) and the reduction. The caller passes the
denominator of the whole optimizer step, so that the returned losses and metrics of the micro-batches
add up to the loss and metrics of the whole batch however it is split.
"""

from __future__ import annotations

from typing import Any

import torch

from relax.algorithms import functional as F
from relax.algorithms.base import AlgorithmConfig, LossBatch, get
from relax.metrics import ENTROPY, KL_LOSS, LOSS, PG_CLIPFRAC, PG_LOSS, PPO_KL, VALUE_CLIPFRAC, VALUE_LOSS

__all__ = [
    "compute_loss",
    "compute_value_loss",
    "micro_batch_share",
    "PG_LOSS",
    "PG_CLIPFRAC",
    "PPO_KL",
    "KL_LOSS",
    "ENTROPY",
    "LOSS",
    "VALUE_LOSS",
    "VALUE_CLIPFRAC",
]


def _denominator(denominator: float) -> float:
    d = float(denominator)
    return d if d > 0 else 1.0


def micro_batch_share(mask: torch.Tensor, *, per_token: bool, denominator: float) -> float:
    """This micro-batch's weight in the step: valid tokens (per token) or responses, over `denominator`."""
    n = float((mask != 0).sum().item()) if per_token else float(mask.shape[0])
    return n / _denominator(denominator)


def compute_loss(
    cfg: AlgorithmConfig, batch: LossBatch, *, per_token: bool, denominator: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch and its metrics (detached, pre-weighted so they add over micro-batches).

    `per_token=True`: `denominator` is the number of valid tokens of the whole optimizer step and each
    term is `sum(mask * x) / denominator`. `per_token=False`: `denominator` is the number of responses
    of the step and each term is `sum_b(token mean of row b) / denominator`.

    `loss = reduce(w * pg) + kl_loss_coef * reduce(kl) - entropy_coef * reduce(entropy)` where `pg` is the
    algorithm's per-token policy loss, `w = min(exp(old_logp - rollout_logp), tis_clip)` (detached) when
    `use_tis` else 1, and `kl = kl_estimate(logp, ref_logp, kl_loss_type)` when `use_kl_loss`.
    """
    algorithm = get(cfg.name)
    denom = _denominator(denominator)
    mask = batch.mask

    def reduce(x: torch.Tensor) -> torch.Tensor:
        return F.masked_sum_reduce(x, mask, per_token, denom)

    out = algorithm.policy_loss(cfg, batch.logp, batch.old_logp, batch.advantages, mask)
    pg = out.loss
    if cfg.use_tis:
        if batch.rollout_logp is None:
            raise ValueError("use_tis=true needs LossBatch.rollout_logp (the rollout engine's log-probs)")
        pg = pg * F.tis_weights(batch.old_logp, batch.rollout_logp, cfg.tis_clip)
    pg_loss = reduce(pg)
    total = pg_loss

    metrics: dict[str, torch.Tensor] = {PG_LOSS: pg_loss.detach()}
    with torch.no_grad():
        if out.clipped is not None:
            metrics[PG_CLIPFRAC] = reduce(out.clipped.to(pg.dtype))
        else:
            metrics[PG_CLIPFRAC] = torch.zeros((), dtype=pg.dtype, device=pg.device)
        metrics[PPO_KL] = reduce((batch.old_logp - batch.logp).detach())
        if out.metrics:
            share = micro_batch_share(mask, per_token=per_token, denominator=denom)
            for name, value in out.metrics.items():
                metrics[name] = torch.as_tensor(value, dtype=pg.dtype, device=pg.device).detach() * share

    if cfg.use_kl_loss:
        if batch.ref_logp is None:
            raise ValueError("use_kl_loss=true needs LossBatch.ref_logp (the reference model's log-probs)")
        kl = reduce(F.kl_estimate(batch.logp, batch.ref_logp, cfg.kl_loss_type))
        total = total + cfg.kl_loss_coef * kl
        metrics[KL_LOSS] = kl.detach()

    if batch.entropy is not None:
        entropy = reduce(batch.entropy)
        if cfg.entropy_coef:
            total = total - cfg.entropy_coef * entropy
        metrics[ENTROPY] = entropy.detach()
    elif cfg.entropy_coef:
        raise ValueError(f"entropy_coef={cfg.entropy_coef} needs LossBatch.entropy")

    metrics[LOSS] = total.detach()
    return total, metrics


def compute_value_loss(
    cfg: Any,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    per_token: bool,
    denominator: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO critic loss of one micro-batch: `reduce(0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2))`.

    `c = cfg.value_clip`; same reduction and denominator contract as `compute_loss`. Metrics:
    `critic/value_loss` and `critic/value_clipfrac` (share of valid tokens where the clipped error is larger).
    """
    denom = _denominator(denominator)
    clip = float(cfg.value_clip)
    loss = F.masked_sum_reduce(F.value_loss(values, old_values, returns, clip), mask, per_token, denom)
    with torch.no_grad():
        clipped = F.value_clipped_mask(values, old_values, returns, clip).to(values.dtype)
        clipfrac = F.masked_sum_reduce(clipped, mask, per_token, denom)
    return loss, {VALUE_LOSS: loss.detach(), VALUE_CLIPFRAC: clipfrac}
