"""The loss a train backend calls per micro-batch: the algorithm's policy loss plus the shared terms.

`compute_loss` looks the algorithm up by `cfg.name`, takes its per-token policy loss and applies,
identically for every algorithm: the rollout correction (`use_tis`, `rollout_mask`), the KL loss
(`use_kl_loss`), the entropy bonus (`entropy_coef`) and the reduction. The caller passes the loss
denominator and the valid-token count of the whole optimizer step, so that the returned losses and
metrics of the micro-batches add up to the loss and metrics of the whole batch however it is split.
Masked tokens are replaced by zeros before any arithmetic, so whatever they hold (even NaN or inf)
never reaches a loss, a gradient or a metric.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from relax.algorithms import functional as F
from relax.algorithms.base import AlgorithmConfig, LossBatch, get, loss_agg_mode
from relax.algorithms.rollout_correction import correction_weights
from relax.metrics import (
    ENTROPY,
    KL_LOSS,
    LOSS,
    PG_CLIPFRAC,
    PG_CLIPFRAC_LOWER,
    PG_LOSS,
    PPO_KL,
    VALUE_CLIPFRAC,
    VALUE_LOSS,
)

__all__ = [
    "compute_loss",
    "compute_value_loss",
    "PG_LOSS",
    "PG_CLIPFRAC",
    "PG_CLIPFRAC_LOWER",
    "PPO_KL",
    "KL_LOSS",
    "ENTROPY",
    "LOSS",
    "VALUE_LOSS",
    "VALUE_CLIPFRAC",
]


def _positive(count: float) -> float:
    d = float(count)
    return d if d > 0 else 1.0


def _step_tokens(mask: torch.Tensor, per_token: bool, denominator: float, num_tokens: Optional[float]) -> float:
    """The step's valid-token count: `num_tokens`, else `denominator` (per token), else this batch's count."""
    if num_tokens is not None:
        return _positive(num_tokens)
    if per_token:
        return _positive(denominator)
    return _positive((mask != 0).sum().item())


def _reducer(cfg: Any, keep: torch.Tensor, per_token: bool, denom: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """The loss reduction of `cfg.loss_agg_mode` (auto: the one `per_token` names) over this batch's valid tokens
    `keep`, `denom` the step's denominator (`relax.train.trainer.step_denominators`: its valid tokens when
    `per_token`, else its responses that have one). token-mean and seq-mean-token-sum both add every valid token;
    they differ in the denominator the caller passes, and seq-mean-token-sum-norm also divides by
    `cfg.loss_scale_factor`."""
    mode = loss_agg_mode(cfg, per_token)
    if (mode == "token-mean") != per_token:
        raise ValueError(f"algorithm.loss_agg_mode={mode} needs train.calculate_per_token_loss="
                         f"{str(not per_token).lower()}: the step's denominator is "
                         f"{'its valid tokens' if per_token else 'its responses'}")
    if mode == "seq-mean-token-mean":
        return lambda x: F.masked_sum_reduce(x, keep, False, denom)
    if mode == "seq-mean-token-sum-norm":
        factor = getattr(cfg, "loss_scale_factor", None)
        if factor is None or not factor > 0:
            raise ValueError(f"algorithm.loss_agg_mode=seq-mean-token-sum-norm needs algorithm.loss_scale_factor > 0, "
                             f"got {factor}")
        denom = denom * float(factor)
    return lambda x: F.masked_sum_reduce(x, keep, True, denom)


def _zero_masked(x: Optional[torch.Tensor], keep: torch.Tensor) -> Optional[torch.Tensor]:
    """`x` with 0 on masked tokens (gradient exactly 0 there, whatever they held)."""
    return None if x is None else torch.where(keep, x, 0.0)


def compute_loss(
    cfg: AlgorithmConfig,
    batch: LossBatch,
    *,
    per_token: bool,
    denominator: float,
    num_tokens: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch and its metrics (detached, pre-weighted so they add over micro-batches).

    Losses: `per_token=True`: `denominator` is the number of valid tokens of the whole optimizer step and
    each term is `sum(mask * x) / denominator` (token-mean). `per_token=False`: `denominator` is the number of
    responses of the step that have a valid token (`relax.train.trainer.step_denominators`) and each term is, by
    `cfg.loss_agg_mode`: `sum_b(token mean of row b) / denominator` (auto or seq-mean-token-mean),
    `sum_b(token sum of row b) / denominator` (seq-mean-token-sum) or that divided by `cfg.loss_scale_factor`
    (seq-mean-token-sum-norm). A mode that disagrees with `per_token` is a ValueError.

    `loss = reduce(w * pg) + kl_loss_coef * reduce(kl) - entropy_coef * reduce(entropy)` where `pg` is the
    algorithm's per-token policy loss, `w` the rollout correction's weight (detached; truncated importance sampling
    with `use_tis`, times the rejection mask with `rollout_mask`; `relax.algorithms.rollout_correction`) else 1,
    and `kl = kl_estimate(logp, ref_logp, kl_loss_type)` when `use_kl_loss`. Metrics
    `train/pg_loss`, `train/kl_loss`, `train/loss` are these (reduced) terms.

    Diagnostics, whatever the reduction, are means over the valid tokens of the whole step:
    `sum(mask * x) / num_tokens` for `train/pg_clipfrac` (x = clipped), `train/pg_clipfrac_lower` (x =
    dual_clipped; only with `dual_clip_c`), `train/ppo_kl` (x = old_logp - logp), `train/entropy`; the
    algorithm's own metrics are weighted by `(valid tokens of this batch) / num_tokens`. `num_tokens` is the
    valid-token count of the whole step (every micro-batch and rank); None means `denominator` when `per_token`,
    else this batch's count (this batch is the whole step).

    Algorithms with `step_statistics` (M2PO) use `batch.stats`, the statistics of the whole step; when it
    is None they are computed from this batch alone (correct only when this batch is the whole step).
    """
    algorithm = get(cfg.name)
    denom = _positive(denominator)
    tokens = _step_tokens(batch.mask, per_token, denominator, num_tokens)
    keep = batch.mask != 0
    mask = keep.to(batch.logp.dtype)
    logp = _zero_masked(batch.logp, keep)
    old_logp = _zero_masked(batch.old_logp, keep)
    advantages = _zero_masked(batch.advantages, keep)

    reduce = _reducer(cfg, keep, per_token, denom)

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return F.masked_sum_reduce(x, keep, True, tokens)

    if algorithm.needs_step_statistics:
        stats = batch.stats
        if stats is None:
            stats = algorithm.step_statistics(cfg, logp.detach(), old_logp, advantages, mask)
        out = algorithm.policy_loss(cfg, logp, old_logp, advantages, mask, stats=stats)
    else:
        out = algorithm.policy_loss(cfg, logp, old_logp, advantages, mask)
    pg = out.loss
    if cfg.use_tis or cfg.rollout_mask != "none":
        if batch.rollout_logp is None:
            raise ValueError("use_tis / rollout_mask need LossBatch.rollout_logp (the rollout engine's log-probs)")
        pg = pg * correction_weights(cfg, old_logp, _zero_masked(batch.rollout_logp, keep), keep)
    pg_loss = reduce(pg)
    total = pg_loss

    metrics: dict[str, torch.Tensor] = {PG_LOSS: pg_loss.detach()}
    with torch.no_grad():
        if out.clipped is not None:  # token counts, exact
            metrics[PG_CLIPFRAC] = torch.count_nonzero(out.clipped & keep).to(pg.dtype) / tokens
        else:
            metrics[PG_CLIPFRAC] = torch.zeros((), dtype=pg.dtype, device=pg.device)
        if out.dual_clipped is not None:  # algorithm.dual_clip_c set: the capped tokens, counted as pg_clipfrac's
            metrics[PG_CLIPFRAC_LOWER] = torch.count_nonzero(out.dual_clipped & keep).to(pg.dtype) / tokens
        # both are 0 on masked tokens: the plain sum is the masked one
        metrics[PPO_KL] = (old_logp - logp.detach()).sum() / tokens
        share = torch.count_nonzero(keep).to(pg.dtype) / tokens
        for name, value in out.metrics.items():
            metrics[name] = torch.as_tensor(value, dtype=pg.dtype, device=pg.device).detach() * share

    if cfg.use_kl_loss:
        if batch.ref_logp is None:
            raise ValueError("use_kl_loss=true needs LossBatch.ref_logp (the reference model's log-probs)")
        kl = reduce(F.kl_estimate(logp, _zero_masked(batch.ref_logp, keep), cfg.kl_loss_type))
        total = total + cfg.kl_loss_coef * kl
        metrics[KL_LOSS] = kl.detach()

    if batch.entropy is not None:
        entropy = _zero_masked(batch.entropy, keep)
        if cfg.entropy_coef:
            total = total - cfg.entropy_coef * reduce(entropy)
        metrics[ENTROPY] = token_mean(entropy.detach())
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
    num_tokens: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO critic loss of one micro-batch: `reduce(0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2))`.

    `c = cfg.value_clip`; same reduction (`cfg.loss_agg_mode` included), denominator and `num_tokens` contract as
    `compute_loss`. Metrics:
    `critic/value_loss` (reduced like the loss) and `critic/value_clipfrac`, the share of the step's valid
    tokens with `|V - V_old| > c` whose clipped error is the larger (a diagnostic: `/ num_tokens`).
    """
    denom = _positive(denominator)
    tokens = _step_tokens(mask, per_token, denominator, num_tokens)
    keep = mask != 0
    valid = keep.to(values.dtype)
    values, old_values, returns = (_zero_masked(x, keep) for x in (values, old_values, returns))
    clip = float(cfg.value_clip)
    loss = _reducer(cfg, keep, per_token, denom)(F.value_loss(values, old_values, returns, clip))
    with torch.no_grad():
        clipped = F.value_clipped_mask(values, old_values, returns, clip).to(values.dtype)
        clipfrac = F.masked_sum_reduce(clipped, valid, True, tokens)
    return loss, {VALUE_LOSS: loss.detach(), VALUE_CLIPFRAC: clipfrac}
