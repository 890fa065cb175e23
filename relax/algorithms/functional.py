"""Pure tensor math of the RL algorithms: advantages, policy losses, estimators, reductions.

Shapes: `[N]` one value per response, the `group_size` responses of a prompt consecutive;
`[B, T]` one value per token, `mask[b, t]` 1 on tokens that count (any dtype, compared with 0).
Every function works for float32 and float64 on any device and keeps the input's dtype and device.
Masked tokens never change any statistic, and every `[B, T]` result is 0 on masked tokens unless the
docstring says otherwise.

The fused autograd kernels of two losses live in `relax.algorithms.kernels`, the M2PO solver in
`relax.algorithms.m2po_solver`, the clamped ratio in `relax.algorithms.ratios`; this module keeps the formulas.

Numerical safeguards: every exponential of a log-ratio goes through `exp_log_ratio` (or its in-place forms
`exp_log_ratio_` and `ratio_and_clamp_mask`, `relax.algorithms.ratios`), which clamps the log-ratio to
`[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]` first, so `exp` never overflows (fp32 overflows above 88.7) and its backward
never computes `0 * inf = NaN`. Group statistics are computed in float64 and a group whose rewards are all equal
gets exactly 0.

Speed: PPO-Clip and SAPO (`relax.algorithms.kernels`: `PPOClip`, `SAPO`) compute `d loss / d logp` in their forward
pass, so that the backward is one multiply instead of autograd's data-dependent passes. A `torch.where` whose
condition has no structure (e.g. the sign of per-token advantages) mispredicts a branch per element on the CPU and
costs several arithmetic passes; such selections are written as arithmetic (`kernels.select_`). A `where` on the
loss mask (contiguous runs of valid tokens) is cheap.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from relax.algorithms.kernels import SAPO, PPOClip
from relax.algorithms.m2po_solver import m2po_clip_bounds
from relax.algorithms.ratios import LOG_RATIO_CLAMP, exp_log_ratio, exp_log_ratio_
from relax.metrics import (
    RLOO_ADV_ABS_MEAN,
    RLOO_BASELINE_MEAN,
    RLOO_DROPPED_GROUP_FRAC,
    RLOO_EMPTY_RESPONSE_FRAC,
    RLOO_METRICS,
    RLOO_NO_SIGNAL_FRAC,
    RLOO_ZERO_ADV_GROUP_FRAC,
)

__all__ = [
    "grpo_advantages",
    "rloo_advantages",
    "group_mean_baseline",
    "reinforce_pp_returns",
    "global_token_normalize",
    "gae",
    "ppo_clip_loss",
    "dual_clip",
    "reinforce_loss",
    "cispo_loss",
    "cispo_loss_and_clipped",
    "gspo_loss",
    "sapo_loss",
    "m2po_clip_bounds",
    "value_loss",
    "kl_estimate",
    "reduce_loss",
    "rloo_diagnostics",
    "broadcast_to_tokens",
    "last_token_index",
    "token_rewards",
    "masked_sum_reduce",
    "value_clipped_mask",
    "clipped_values",
    "exp_log_ratio",
    "LOG_RATIO_CLAMP",
]

GRPO_STD_EPS = 1e-6
NORM_VAR_EPS = 1e-8
K3_CLAMP = 10.0


# --------------------------------------------------------------------------------------------------
# helpers


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of {group_size}")
    return rewards.view(-1, group_size)


def _row_counts(keep: torch.Tensor) -> torch.Tensor:
    """Valid tokens per row of a bool mask (int64): a byte sum, which costs less than `count_nonzero` per row."""
    return keep.view(torch.uint8).sum(-1)


def _valid(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The mask as 0/1 in `like`'s dtype."""
    return (mask != 0).to(like.dtype)


def _group_stat_input(rewards: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(groups [N/G, G] in float64, [N/G, 1] bool: the group's rewards are all equal)."""
    g = _groups(rewards, group_size).to(torch.float64)
    return g, (g.amax(dim=1, keepdim=True) == g.amin(dim=1, keepdim=True))


def _centered(g: torch.Tensor, constant: torch.Tensor) -> torch.Tensor:
    """`g - mean_g`, exactly 0 in groups whose values are all equal (float64 in, float64 out)."""
    return torch.where(constant, torch.zeros_like(g), g - g.mean(dim=1, keepdim=True))


def broadcast_to_tokens(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`out[b, t] = values[b]` on valid tokens, 0 on masked ones: a per-response scalar on every valid token (a
    `where`, not a product with the mask: a response left out of the loss may carry a NaN reward, and NaN * 0 is
    NaN)."""
    return torch.where(mask != 0, values.unsqueeze(-1), torch.zeros((), dtype=values.dtype, device=values.device))


def last_token_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of the last valid token of each row, whether the row has any valid token)."""
    valid = mask != 0
    T = mask.shape[-1]
    last = T - 1 - valid.flip(-1).to(torch.int8).argmax(-1)
    return last, valid.any(-1)


def token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] rewards placed on the last valid token of each row; [B, T] rewards are masked as given. Masked tokens,
    and rows without a valid token, get exactly 0 whatever the reward there holds (NaN included)."""
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    if rewards.dim() == 2:
        return torch.where(mask != 0, rewards, zero)
    last, has_any = last_token_index(mask)
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    out.scatter_(-1, last.unsqueeze(-1), torch.where(has_any, rewards, zero).unsqueeze(-1))
    return out


# --------------------------------------------------------------------------------------------------
# advantages


def grpo_advantages(rewards: torch.Tensor, group_size: int, std_normalization: bool = True) -> torch.Tensor:
    """GRPO: `A_i = (R_i - mean_g) / (std_g + 1e-6)`, std with Bessel's correction (N-1).

    `std_normalization=False` gives Dr. GRPO's advantage, `A_i = R_i - mean_g` (Dr. GRPO also drops the loss's
    per-response `1/|o_i|` for a constant; that is the reduction's business, not this function's, and
    docs/algorithms.md says which setting comes closest). A group of one has std 0. Computed in
    float64 (returned in the input's dtype); a group whose rewards are all equal gets exactly 0 (in fp32 the
    rounding of the mean would otherwise be divided by a std of ~1e-8 plus 1e-6).
    """
    g, constant = _group_stat_input(rewards, group_size)
    centered = _centered(g, constant)
    if std_normalization:
        if group_size > 1:
            std = g.std(dim=1, keepdim=True, correction=1)
        else:
            std = torch.zeros_like(centered)
        centered = centered / (std + GRPO_STD_EPS)
    return centered.reshape(-1).to(rewards.dtype)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: `A_i = R_i - mean_{j != i} R_j = G/(G-1) * (R_i - mean_g)`, no std division.

    Computed in float64 (returned in the input's dtype); exactly 0 in a group whose rewards are all equal.
    """
    if group_size < 2:
        raise ValueError(f"RLOO needs group_size >= 2, got {group_size}")
    g, constant = _group_stat_input(rewards, group_size)
    return (group_size / (group_size - 1) * _centered(g, constant)).reshape(-1).to(rewards.dtype)


def group_mean_baseline(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE++-baseline: `C_i = R_i - mean_g` (the mean includes R_i itself), no std division.

    Computed in float64 (returned in the input's dtype); exactly 0 in a group whose rewards are all equal.
    """
    g, constant = _group_stat_input(rewards, group_size)
    return _centered(g, constant).reshape(-1).to(rewards.dtype)


def _discounted_returns(rewards_t: torch.Tensor, gamma: float, valid: torch.Tensor) -> torch.Tensor:
    """`G_t = sum_{u >= t, u valid} gamma^(k(u) - k(t)) r_u` with k counting valid positions only (vectorised over
    rows): masked positions (an episode's observations, padding) are not time steps; the recursion carries across
    them. `rewards_t` must be 0 where `valid` is 0."""
    T = rewards_t.shape[-1]
    if gamma == 1.0:
        return rewards_t.flip(-1).cumsum(-1).flip(-1)
    out = torch.empty_like(rewards_t)
    running = torch.zeros_like(rewards_t[..., 0])
    for t in range(T - 1, -1, -1):
        m = valid[..., t]
        running = m * (rewards_t[..., t] + gamma * running) + (1 - m) * running
        out[..., t] = running
    return out


def reinforce_pp_returns(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    kl_coef: float,
    gamma: float,
) -> torch.Tensor:
    """REINFORCE++ returns (before the global token normalization).

    `r_t = mask_t * (-kl_coef * (old_logp_t - ref_logp_t) + [t is the last valid token] * R)` and, over the valid
    tokens of a row only, `G_t = sum_{u >= t, u valid} gamma^(k(u) - k(t)) r_u` with `k` the index of a token among
    the row's valid tokens: the discount counts the policy's own tokens, not positions. The masked tokens inside a
    row are an episode's observations (tool output, the user's turn), which the policy did not choose: they are not
    steps of its decision process, so the return carries across them undiscounted. Without such gaps (a single
    turn) this is the positional `sum_{u >= t} gamma^(u - t) r_u`. The result is 0 on masked tokens, whatever
    `old_logp`, `ref_logp` or `rewards` hold there (NaN and inf included).
    """
    keep = mask != 0
    valid = keep.to(old_logp.dtype)
    kl = torch.where(keep, old_logp - ref_logp, torch.zeros((), dtype=old_logp.dtype, device=old_logp.device))
    r = token_rewards(rewards.to(old_logp.dtype), mask) - kl_coef * kl
    return _discounted_returns(r, gamma, valid) * valid


def distillation_advantages(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor, clip: Optional[float] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation's per-token advantage, the negative reverse-KL estimate of each sampled token:

    `a[b, t] = logp_teacher[b, t] - logp_student[b, t]`, with `clip`: `clamp(a, -clip, clip)`; 0 on masked tokens.
    Returns (advantages, clipped [B, T] bool: valid tokens whose value the clip changed). Values under the mask
    (non-finite ones included) never reach the result.
    """
    keep = mask != 0
    a = torch.where(keep, teacher_logp - student_logp, torch.zeros((), dtype=student_logp.dtype,
                                                                   device=student_logp.device))
    if clip is None:
        return a, torch.zeros_like(keep)
    clipped = keep & (a.abs() > clip)
    return a.clamp(-clip, clip), clipped


def global_token_normalize(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Whitening over every valid token of the batch, population statistics:

    `mu = mean_valid(v)`, `var = mean_valid((v - mu)^2)`, `out = mask * (v - mu) / sqrt(max(var, 1e-8))`.
    Computed in float64 (returned in the input's dtype). An all-masked batch, or one whose valid values are
    all equal, gives exactly zeros.
    """
    keep = mask != 0
    valid = keep.to(torch.float64)
    n = valid.sum().clamp(min=1.0)
    v = torch.where(keep, values, torch.zeros_like(values)).to(torch.float64)  # NaN/inf under the mask never leak
    mu = v.sum() / n
    centered = (v - mu) * valid
    constant = torch.where(keep, v, math.inf).amin() == torch.where(keep, v, -math.inf).amax()
    centered = torch.where(constant, torch.zeros_like(centered), centered)
    var = (centered**2).sum() / n
    return (centered / var.clamp(min=NORM_VAR_EPS).sqrt()).to(values.dtype)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lambd: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation -> (advantages [B, T], returns [B, T]).

    `rewards` [B] is placed on the last valid token of each row (a [B, T] tensor is taken as token
    rewards). Over the valid tokens of a row, in order, with `V = 0` past the last one:
    `delta_t = r_t + gamma * V_next - V_t`, `A_t = delta_t + gamma * lambd * A_next`,
    `returns = A + V`, where "next" is the next valid token, not the next position: masked tokens inside a row
    (an episode's observations, which the policy did not choose) are not steps of its decision process, so the
    recursion carries across them without a discount. Masked tokens are 0 in both results, whatever `values` or
    `rewards` hold there (NaN and inf included).
    """
    keep = mask != 0
    valid = keep.to(values.dtype)
    r = token_rewards(rewards.to(values.dtype), mask)
    v = torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))
    T = values.shape[-1]
    adv = torch.zeros_like(v)
    next_value = torch.zeros_like(v[..., 0])
    next_adv = torch.zeros_like(v[..., 0])
    for t in range(T - 1, -1, -1):
        m = valid[..., t]
        delta = r[..., t] + gamma * next_value - v[..., t]
        a = delta + gamma * lambd * next_adv
        adv[..., t] = a * m
        next_adv = a * m + next_adv * (1 - m)
        next_value = v[..., t] * m + next_value * (1 - m)
    return adv, (adv + v) * valid


# --------------------------------------------------------------------------------------------------
# policy losses (per token, before reduction)


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-Clip: `max(-ratio * A, -clip(ratio, 1 - eps_clip, 1 + eps_clip_high) * A)`, `ratio = exp(logp - old_logp)`.

    Returns (loss, clipped) where `clipped` marks tokens whose clipped term is strictly the larger.
    `eps_clip_high=None` means `eps_clip`; `math.inf` bounds never clip. The ratio is `exp_log_ratio`'s.
    The inputs broadcast (GSPO passes one log-ratio per row). Only `logp` gets a gradient here (`kernels.PPOClip`); when
    `old_logp` or `advantages` need one too, the plain autograd formula (`_ppo_clip_autograd`) runs instead.
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    low_bound, high_bound = 1.0 - eps_clip, 1.0 + high
    needs_other_grads = torch.is_grad_enabled() and (old_logp.requires_grad or advantages.requires_grad)
    if needs_other_grads or not low_bound <= high_bound:  # (PPOClip clamps -ratio, which needs ordered bounds)
        return _ppo_clip_autograd(logp, old_logp, advantages, low_bound, high_bound)
    return PPOClip.apply(logp, old_logp, advantages, low_bound, high_bound)


def _ppo_clip_autograd(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, low_bound: float, high_bound: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ppo_clip_loss` as plain tensor operations, differentiable in every input."""
    ratio = exp_log_ratio(logp - old_logp)
    unclipped = -ratio * advantages
    clipped_term = -ratio.clamp(min=low_bound, max=high_bound) * advantages
    return torch.maximum(unclipped, clipped_term), clipped_term > unclipped


def dual_clip(loss: torch.Tensor, advantages: torch.Tensor, c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-clip PPO (Ye et al., "Mastering Complex Control in MOBA Games with Deep RL", 2020) on a PPO-Clip loss:
    `min(loss, -c * A)` where `A < 0`, `loss` unchanged where `A >= 0` (verl's `clip_ratio_c`, slime's `--eps-clip-c`).

    Returns (loss, dual_clipped: tokens where `-c * A` is strictly the smaller, i.e. `A < 0` and `ratio > c`, up to
    the rounding of the two products). Written without a branch on the sign of `A`: the cap is `c * |A|`, which is
    `-c * A` where `A < 0`, and where `A >= 0` a PPO-Clip loss `-A * min(ratio, clip(ratio))` is `<= 0 <= c * |A|`
    (ratios and clip bounds are positive), so the cap never binds there. `loss` must be a PPO-Clip loss of
    `advantages` (`ppo_clip_loss`'s, GSPO's, M2PO's) and `c > 1` (validated on `algorithm.dual_clip_c`). Where the cap
    binds the loss is the constant `-c * A` (no gradient to `logp`); elsewhere, ties included, it is `loss` with its
    gradient. A NaN `loss` stays NaN.
    """
    cap = advantages.abs() * c
    dual_clipped = loss > cap
    return torch.where(dual_clipped, cap, loss), dual_clipped


def reinforce_loss(logp: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """REINFORCE (RLOO): `-sg(A) * logp`; no ratio, no clipping."""
    return -advantages.detach() * logp


def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: Optional[float] = None,
) -> torch.Tensor:
    """CISPO: `-sg(clip(ratio, 1 - eps_clip, 1 + eps_clip_high)) * sg(A) * logp`; the gradient flows only via logp."""
    weight, _ = _cispo_weight(logp, old_logp, eps_clip, eps_clip_high, with_clipped=False)
    return (weight * advantages.detach()).neg_() * logp


def cispo_loss_and_clipped(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`cispo_loss`, tokens whose weight was capped: `ratio` outside `[1 - eps_clip, 1 + eps_clip_high]`)."""
    weight, clipped = _cispo_weight(logp, old_logp, eps_clip, eps_clip_high, with_clipped=True)
    return (weight * advantages.detach()).neg_() * logp, clipped


def _cispo_weight(
    logp: torch.Tensor, old_logp: torch.Tensor, eps_clip: float, eps_clip_high: Optional[float], with_clipped: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(the CISPO weight `clip(ratio, 1 - eps_clip, 1 + eps_clip_high)`, detached, a new tensor; the clip flags
    `ratio < 1 - eps_clip or ratio > 1 + eps_clip_high` when `with_clipped`, else None)."""
    high = eps_clip if eps_clip_high is None else eps_clip_high
    low_bound, high_bound = 1.0 - eps_clip, 1.0 + high
    with torch.no_grad():
        ratio = exp_log_ratio_(logp - old_logp)
        clipped = (ratio < low_bound).logical_or_(ratio > high_bound) if with_clipped else None
        return ratio.clamp_(min=low_bound, max=high_bound), clipped


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    eps_clip_high: Optional[float] = None,
    *,
    zero_masked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: sequence ratio `s_b = exp(masked_mean_t(logp - old_logp))` used by every token of row b in
    the PPO-Clip form `max(-s * A, -clip(s, 1 - eps_clip, 1 + eps_clip_high) * A)`.

    Gradients flow through `logp` (via `s`). An empty row has `s = 1`. Returns (loss, clipped). The ratio is
    computed once per row and broadcast against the per-token advantages. `zero_masked=True` says that `logp`
    and `old_logp` are already 0 on masked tokens and `mask` is 0/1 (what `compute_loss` hands a policy loss):
    the masked mean is then a plain sum, with the same value.
    """
    if zero_masked:
        diff, counts = logp - old_logp, mask.sum(-1)
    else:
        keep = mask if mask.dtype == torch.bool else mask != 0
        diff, counts = torch.where(keep, logp - old_logp, 0.0), _row_counts(keep)
    log_s = diff.sum(-1) / counts.clamp(min=1)
    zero = torch.zeros((), dtype=log_s.dtype, device=log_s.device)
    return ppo_clip_loss(log_s.unsqueeze(-1), zero, advantages, eps_clip, eps_clip_high)


def sapo_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, tau_pos: float, tau_neg: float
) -> torch.Tensor:
    """SAPO: `-(4 / tau) * sigmoid(tau * (ratio - 1)) * A`, `tau = tau_pos` where `A > 0`, else `tau_neg`.

    The gate's slope `d/dratio (4/tau) sigmoid(tau (ratio - 1))` is 1 at ratio 1, like the plain ratio.
    The ratio is `exp_log_ratio`'s (beyond its clamp the gate is saturated). Only `logp` gets a gradient here
    (`kernels.SAPO`); when `old_logp` or `advantages` need one too, the plain autograd formula runs instead.
    """
    if torch.is_grad_enabled() and (old_logp.requires_grad or advantages.requires_grad):
        return _sapo_autograd(logp, old_logp, advantages, tau_pos, tau_neg)
    return SAPO.apply(logp, old_logp, advantages, tau_pos, tau_neg)


def _sapo_autograd(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, tau_pos: float, tau_neg: float
) -> torch.Tensor:
    """`sapo_loss` as plain tensor operations, differentiable in every input."""
    ratio = exp_log_ratio(logp - old_logp)
    tau = torch.where(advantages > 0, torch.full_like(ratio, float(tau_pos)), torch.full_like(ratio, float(tau_neg)))
    return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * advantages


def clipped_values(values: torch.Tensor, old_values: torch.Tensor, value_clip: float) -> torch.Tensor:
    """`V_old + clip(V - V_old, -c, c)`, and exactly `V` where `|V - V_old| <= c`.

    Taking `V` itself where nothing is clipped keeps `V_old + (V - V_old)`'s rounding out of the loss and
    of the clip statistics; the gradient with respect to `V` is 1 there either way.
    """
    delta = values - old_values
    clipped = old_values + delta.clamp(-value_clip, value_clip)
    return torch.where(delta.abs() > value_clip, clipped, values)


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float
) -> torch.Tensor:
    """Clipped critic loss: `0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)` (see `clipped_values`)."""
    clipped = clipped_values(values, old_values, value_clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def value_clipped_mask(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float
) -> torch.Tensor:
    """Clipped tokens (bool [B, T]): `|V - V_old| > c` and the clipped error is strictly the larger term."""
    clipped = clipped_values(values, old_values, value_clip)
    return ((values - old_values).abs() > value_clip) & ((clipped - returns) ** 2 > (values - returns) ** 2)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """KL estimators with `x = logp - ref_logp`: k1 = x; k2 = x^2 / 2; k3 = exp(-x) - 1 + x clamped to [-10, 10].

    k3 exponentiates `exp_log_ratio(-x)`, i.e. `x` clamped to [-20, 20] first. That changes no value and no
    gradient (k3 >= 10 already for x <= -2.7 and x >= 11, where the output clamp sets the gradient to 0),
    but `exp(-x)` can no longer overflow to inf, whose backward gives NaN even on a masked token.
    """
    x = logp - ref_logp
    if kind == "k1":
        return x
    if kind == "k2":
        return 0.5 * x * x
    if kind == "k3":
        return (exp_log_ratio(-x) - 1.0 + x).clamp(-K3_CLAMP, K3_CLAMP)
    raise ValueError(f"unknown KL estimator {kind!r}; expected k1, k2 or k3")


# --------------------------------------------------------------------------------------------------
# reduction


def masked_sum_reduce(values: torch.Tensor, mask: torch.Tensor, per_token: bool, denominator: float) -> torch.Tensor:
    """`sum(mask * v) / denominator` (per token) or `sum_b(token mean of row b) / denominator`.

    Masked entries never contribute (even NaN). An empty row's token mean is 0. `mask` may be bool (used as is).
    """
    keep = mask if mask.dtype == torch.bool else mask != 0
    v = torch.where(keep, values, 0.0)
    if per_token:
        return v.sum() / denominator
    row = v.sum(-1) / _row_counts(keep).clamp(min=1)
    return row.sum() / denominator


def reduce_loss(
    loss: torch.Tensor, mask: torch.Tensor, per_token: bool, num_tokens: Optional[float] = None
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    `per_token=True`: `sum(mask * loss) / N_eff`, `N_eff = num_tokens` (the global valid-token count)
    or this batch's valid-token count when None. `per_token=False`: mean of each row's token mean
    `sum_t mask * loss / sum_t mask` over the rows that have a valid token, `N_resp` of them: a row without one
    (a response left out of the loss) adds nothing and is not counted, as in the trainer's denominator
    (`relax.train.trainer.step_denominators`), so this is what `compute_loss` gives a batch that is the whole step.
    """
    keep = mask != 0
    if per_token:
        n = float(num_tokens) if num_tokens is not None else keep.sum().item()
    else:
        n = keep.any(-1).sum().item() if keep.dim() > 1 else float(keep.any().item())
    return masked_sum_reduce(loss, mask, per_token, max(float(n), 1.0))


# --------------------------------------------------------------------------------------------------
# RLOO diagnostics


def rloo_diagnostics(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_lengths: torch.Tensor,
    group_size: int,
    generated_lengths: Optional[torch.Tensor] = None,
) -> dict[str, float]:
    """The six `rollout/rloo/*` metrics over complete groups (exactly `group_size` responses).

    `response_lengths` are valid-token counts; `generated_lengths` the tokens generated before the stop
    token (None: `response_lengths`). `baseline_mean` = mean of `b_i = mean_{j != i} R_j`;
    `adv_abs_mean` = mean `|A_i|`, `A_i = R_i - b_i`; `no_signal_frac` = valid tokens of responses with
    `A == 0` / valid tokens; `empty_response_frac` = responses with generated length 0 / responses;
    `zero_adv_group_frac` = groups with all `A == 0` / groups; `dropped_group_frac` = incomplete groups /
    all observed groups. `A == 0` is tested with a relative tolerance of 1e-9 (computed in float64).
    """
    r = rewards.detach().to(torch.float64).reshape(-1).cpu()
    gi = group_index.detach().reshape(-1).cpu()
    lengths = response_lengths.detach().reshape(-1).cpu().to(torch.float64)
    generated = lengths if generated_lengths is None else generated_lengths.detach().reshape(-1).cpu()
    out = dict.fromkeys(RLOO_METRICS, 0.0)
    if r.numel() == 0:
        return out
    uniq, inverse, counts = torch.unique(gi, return_inverse=True, return_counts=True)
    complete_group = counts == group_size
    keep = complete_group[inverse]
    num_groups = uniq.numel()
    out[RLOO_DROPPED_GROUP_FRAC] = float((~complete_group).sum().item()) / num_groups
    if group_size < 2 or not bool(keep.any()):
        return out
    r, inv, lengths, generated = r[keep], inverse[keep], lengths[keep], generated[keep]
    group_sum = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inv, r)
    group_max = torch.zeros(num_groups, dtype=torch.float64).scatter_reduce_(0, inv, r.abs(), "amax")
    baseline = (group_sum[inv] - r) / (group_size - 1)
    adv = r - baseline
    zero = adv.abs() <= 1e-9 * (1.0 + group_max[inv])
    out[RLOO_BASELINE_MEAN] = baseline.mean().item()
    out[RLOO_ADV_ABS_MEAN] = torch.where(zero, torch.zeros_like(adv), adv).abs().mean().item()
    tokens = lengths.sum().item()
    out[RLOO_NO_SIGNAL_FRAC] = (lengths * zero).sum().item() / tokens if tokens > 0 else 0.0
    out[RLOO_EMPTY_RESPONSE_FRAC] = (generated <= 0).to(torch.float64).mean().item()
    nonzero_per_group = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inv, (~zero).to(torch.float64))
    complete_ids = complete_group.nonzero().reshape(-1)
    out[RLOO_ZERO_ADV_GROUP_FRAC] = (nonzero_per_group[complete_ids] == 0).to(torch.float64).mean().item()
    return out
