"""Rollout correction: the policy loss reweighted and filtered for the mismatch between the rollout engine and the
trainer (docs/algorithms.md, "Rollout correction"). Pure functions of the trainer's log-probs of the generating
weights (`old_logp`), the engine's (`rollout_logp`) and the loss mask, shared by every algorithm.

With `r_t = exp(old_logp_t - rollout_logp_t)` over the tokens of a response that count in the loss (the model's
tokens: observations of an episode are not in it), each `level` reads a ratio per token:

- `token`: `r_t`;
- `sequence`: the product over the response, `R = prod_t r_t` (every token of the response gets it);
- `geometric`: the per-token geometric mean, `R_geo = exp(mean_t log r_t)`.

Importance sampling (`algorithm.use_tis`, `algorithm.tis_level`): the weight is the level's ratio truncated from
above, `min(ratio, tis_clip)`, detached. Rejection (`algorithm.rollout_mask`, bounds `rollout_mask_low`,
`rollout_mask_high`): tokens (token level) or whole responses (sequence, geometric) whose ratio is outside
`[low, high]` get weight 0 and leave the loss (its denominator stays, so the loss keeps its scale and a split into
micro-batches changes nothing). Both together multiply. IcePop's two-sided token masking is token IS with token
rejection, `[low, high] = [0.5, 2.0]` (its default bounds).

Ratios are formed in log space and exponentiated through `exp_log_ratio` (clamped at exp(+-20)), so a long
response's product neither overflows nor underflows into a NaN.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from relax.algorithms.ratios import exp_log_ratio
from relax.metrics import (
    CONSTRAINED_TOKEN_FRAC,
    MISMATCH_K1,
    MISMATCH_K3,
    MISMATCH_LOG_PPL_DIFF,
    MISMATCH_RATIO_QUANTILES,
    RS_MASKED_SEQ_FRAC,
    RS_MASKED_TOKEN_FRAC,
    TIS_TRUNCATED_FRAC,
    TRAIN_ROLLOUT_LOGP_ABS_DIFF,
    TRAIN_ROLLOUT_LOGP_ABS_DIFF_CONSTRAINED,
    TRAIN_ROLLOUT_RATIO_MAX,
)

LEVELS = ("token", "sequence", "geometric")
QUANTILES = (0.05, 0.5, 0.95)


def constrained_split(mask: torch.Tensor,
                      constrained: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(free, held), bool like `mask`: its valid tokens no grammar constrained (`constrained`: 1 on those one did,
    `relax.batch.Samples.constrained`; None: none), whose rollout log-prob is the model's own, and those one did,
    whose rollout log-prob is of the grammar's masked distribution. The one place the split is made (the trainer's
    first-step mismatch and the runner's, `free_token_sums`)."""
    valid = mask != 0
    if constrained is None:
        return valid, torch.zeros_like(valid)
    held = valid & (constrained != 0)
    return valid & ~held, held


def free_token_sums(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                    constrained: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float64 [5] on the CPU, what `free_token_metrics` reads: [sum |old_logp - rollout_logp| over the free tokens
    (`constrained_split`), their count, the sum over the constrained ones, their count, the max ratio
    `exp(old_logp - rollout_logp)` over the free tokens (0: none)]. The first four add over micro-batches and
    data-parallel ranks, the last one takes their max."""
    free, held = constrained_split(mask, constrained)
    diff = old_logp.detach().double() - rollout_logp.detach().double()
    d, c = diff[free], diff[held]
    top = float(exp_log_ratio(d).max()) if d.numel() else 0.0
    return torch.tensor([float(d.abs().sum()), d.numel(), float(c.abs().sum()), c.numel(), top],
                        dtype=torch.float64)


def free_token_metrics(sums: torch.Tensor) -> dict[str, float]:
    """From `free_token_sums`' values: `TRAIN_ROLLOUT_LOGP_ABS_DIFF` (mean |difference|) and
    `TRAIN_ROLLOUT_RATIO_MAX` over the free tokens, only where there are any (a step of constrained tokens only has
    no reading of them, not a 0.0 that would look like perfect parity); `TRAIN_ROLLOUT_LOGP_ABS_DIFF_CONSTRAINED` and
    `CONSTRAINED_TOKEN_FRAC` (their share of the valid tokens) only where a grammar constrained some."""
    free_sum, free, held_sum, held, top = (float(x) for x in sums)
    out = {}
    if free:
        out[TRAIN_ROLLOUT_LOGP_ABS_DIFF] = free_sum / free
        out[TRAIN_ROLLOUT_RATIO_MAX] = top
    if held:  # a step with constrained tokens (the OpenAI gateway's calls under a grammar)
        out[TRAIN_ROLLOUT_LOGP_ABS_DIFF_CONSTRAINED] = held_sum / held
        out[CONSTRAINED_TOKEN_FRAC] = held / (free + held)
    return out


def level_log_ratio(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                    level: str) -> torch.Tensor:
    """[B, T] the log of the level's ratio at each token (0 where `mask` is 0)."""
    keep = mask != 0
    log_r = torch.where(keep, old_logp.detach().double() - rollout_logp.detach().double(), 0.0)
    if level == "token":
        return log_r
    total = log_r.sum(-1, keepdim=True)
    if level == "geometric":
        total = total / keep.sum(-1, keepdim=True).clamp(min=1)
    elif level != "sequence":
        raise ValueError(f"unknown rollout correction level {level!r}; expected one of {', '.join(LEVELS)}")
    return torch.where(keep, total.expand_as(log_r), 0.0)


def is_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: str,
               clip: float) -> torch.Tensor:
    """[B, T] truncated importance weights `min(ratio, clip)` of `level` (detached; 0 where `mask` is 0)."""
    with torch.no_grad():
        log_r = level_log_ratio(old_logp, rollout_logp, mask, level)
        w = exp_log_ratio(log_r).clamp(max=clip)
        return torch.where(mask != 0, w, 0.0).to(old_logp.dtype)


def rejection_mask(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: str,
                   low: float, high: float) -> torch.Tensor:
    """[B, T] 1 where `mask` is 1 and the level's ratio is within `[low, high]`, else 0."""
    with torch.no_grad():
        log_r = level_log_ratio(old_logp, rollout_logp, mask, level)
        inside = (log_r >= math.log(low)) & (log_r <= math.log(high)) & (mask != 0)
        return inside.to(old_logp.dtype)


def correction_weights(cfg: Any, old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                       mask: torch.Tensor) -> Optional[torch.Tensor]:
    """[B, T] the factor on each token's policy loss that `cfg` (an AlgorithmConfig) asks for, or None."""
    m = None
    if cfg.rollout_mask != "none":
        m = rejection_mask(old_logp, rollout_logp, mask, cfg.rollout_mask, cfg.rollout_mask_low, cfg.rollout_mask_high)
    if not cfg.use_tis:
        return m
    w = is_weights(old_logp, rollout_logp, mask, cfg.tis_level, cfg.tis_clip)
    return w if m is None else w * m


@torch.no_grad()
def log_ratios(old_logp: torch.Tensor, rollout_logp: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the log-ratios `old_logp - rollout_logp` of the tokens of `mask`, their mean per response that has any),
    float64 on the CPU: what `mismatch_summary` reads (a trainer gathers them over its micro-batches)."""
    keep = mask != 0
    d = torch.where(keep, old_logp.detach().double() - rollout_logp.detach().double(), 0.0)
    rows = keep.any(-1)
    row_means = d.sum(-1)[rows] / keep.sum(-1)[rows]
    return d[keep].cpu(), row_means.cpu()


def mismatch_summary(tokens: torch.Tensor, row_means: torch.Tensor) -> dict[str, float]:
    """k1, k3, the log-ppl difference and the ratio quantiles of `mismatch_metrics` from `log_ratios`' values."""
    if tokens.numel() == 0:
        return {}
    out = {MISMATCH_K1: float((-tokens).mean()),
           MISMATCH_K3: float((exp_log_ratio(tokens) - 1.0 - tokens).mean()),
           # mean_t (rollout - old) = log-ppl(trainer) - log-ppl(rollout), per response
           MISMATCH_LOG_PPL_DIFF: float((-row_means).mean())}
    q = torch.quantile(exp_log_ratio(tokens), torch.tensor(QUANTILES, dtype=torch.float64))
    for name, value in zip(MISMATCH_RATIO_QUANTILES, q.tolist(), strict=True):
        out[name] = value
    return out


@torch.no_grad()
def mismatch_metrics(cfg: Any, old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's log-probs are from the trainer's over the tokens of `mask` (whatever correction is
    on), and what the configured correction truncates and masks:

    - `MISMATCH_K1`: mean of `rollout_logp - old_logp` (k1 estimate of KL(rollout || trainer), tokens drawn from
      the rollout); `MISMATCH_K3`: mean of `r - 1 - log r` (k3, never negative);
    - `MISMATCH_LOG_PPL_DIFF`: mean over responses of `log-ppl(trainer) - log-ppl(rollout)`, with
      `log-ppl = -mean_t logp_t`;
    - `MISMATCH_RATIO_QUANTILES`: the 5%, 50% and 95% quantiles of the token ratio `r`;
    - with `use_tis`: `TIS_TRUNCATED_FRAC`, the share of tokens (token level) or responses (sequence, geometric)
      whose ratio is above `tis_clip`; with `rollout_mask`: `RS_MASKED_TOKEN_FRAC` and `RS_MASKED_SEQ_FRAC`, the
      shares of tokens masked and of responses with a masked token.
    """
    keep = mask != 0
    if not bool(keep.any()):
        return {}
    rows = keep.any(-1)
    tokens, row_means = log_ratios(old_logp, rollout_logp, mask)
    out = mismatch_summary(tokens, row_means)
    if cfg.use_tis:
        over = level_log_ratio(old_logp, rollout_logp, mask, cfg.tis_level) > math.log(cfg.tis_clip)
        if cfg.tis_level == "token":
            out[TIS_TRUNCATED_FRAC] = float(over[keep].double().mean())
        else:
            out[TIS_TRUNCATED_FRAC] = float((over & keep).any(-1)[rows].double().mean())
    if cfg.rollout_mask != "none":
        masked = (rejection_mask(old_logp, rollout_logp, mask, cfg.rollout_mask, cfg.rollout_mask_low,
                                 cfg.rollout_mask_high) == 0) & keep
        out[RS_MASKED_TOKEN_FRAC] = float(masked[keep].double().mean())
        out[RS_MASKED_SEQ_FRAC] = float(masked.any(-1)[rows].double().mean())
    return out
