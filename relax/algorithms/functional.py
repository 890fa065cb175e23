"""Pure tensor math of the RL algorithms: advantages, policy losses, estimators, reductions.

Shapes: `[N]` one value per response, the `group_size` responses of a prompt consecutive;
`[B, T]` one value per token, `mask[b, t]` 1 on tokens that count (any dtype, compared with 0).
Every function works for float32 and float64 on any device and keeps the input's dtype and device.
Masked tokens never change any statistic, and every `[B, T]` result is 0 on masked tokens unless the
docstring says otherwise.

Numerical safeguards: every exponential of a log-ratio goes through `exp_log_ratio`, which clamps the
log-ratio to `[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]` first, so `exp` never overflows (fp32 overflows above
88.7) and its backward never computes `0 * inf = NaN`. Group statistics are computed in float64 and a
group whose rewards are all equal gets exactly 0.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

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
    "reinforce_loss",
    "cispo_loss",
    "gspo_loss",
    "sapo_loss",
    "m2po_clip_bounds",
    "value_loss",
    "kl_estimate",
    "tis_weights",
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
# Log-ratios are clamped to [-20, 20] before exponentiating: exp(20) = 4.85e8 is finite in fp32 and bf16.
# k3 is unchanged by it (k3 > 10, i.e. clamped anyway, for every x < -2.7 and x > 11); see exp_log_ratio
# for the (vanishing) effect on the policy losses.
LOG_RATIO_CLAMP = 20.0


# --------------------------------------------------------------------------------------------------
# helpers


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of {group_size}")
    return rewards.view(-1, group_size)


def _valid(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The mask as 0/1 in `like`'s dtype."""
    return (mask != 0).to(like.dtype)


def exp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """`exp(clamp(log_ratio, -20, 20))`: a ratio that neither overflows nor gives NaN gradients.

    Without the clamp, `exp` overflows to inf for a log-ratio above 88.7 in fp32, and its backward computes
    `grad * inf`, which is NaN where `grad` is 0 (a masked token, a clipped branch, a saturated sigmoid).
    The clamp changes a value only where the ratio is outside [2.1e-9, 4.85e8], and there its gradient is 0:
    PPO-Clip and GSPO (the clipped term already wins unless A < 0 and ratio > 4.85e8, where the loss is
    capped at `4.85e8 * |A|` instead of overflowing, or ratio < 2.1e-9, a change below `2.1e-9 * |A|`),
    CISPO (its weight is clipped to `[1 - eps_clip, 1 + eps_clip_high]` anyway), SAPO (the sigmoid gate is
    saturated), TIS (the weight is capped at `tis_clip`).
    """
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _group_stat_input(rewards: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(groups [N/G, G] in float64, [N/G, 1] bool: the group's rewards are all equal)."""
    g = _groups(rewards, group_size).to(torch.float64)
    return g, (g.amax(dim=1, keepdim=True) == g.amin(dim=1, keepdim=True))


def _centered(g: torch.Tensor, constant: torch.Tensor) -> torch.Tensor:
    """`g - mean_g`, exactly 0 in groups whose values are all equal (float64 in, float64 out)."""
    return torch.where(constant, torch.zeros_like(g), g - g.mean(dim=1, keepdim=True))


def broadcast_to_tokens(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`out[b, t] = values[b] * valid[b, t]`: a per-response scalar on every valid token."""
    return values.unsqueeze(-1) * _valid(mask, values)


def last_token_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of the last valid token of each row, whether the row has any valid token)."""
    valid = mask != 0
    T = mask.shape[-1]
    last = T - 1 - valid.flip(-1).to(torch.int8).argmax(-1)
    return last, valid.any(-1)


def token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] rewards placed on the last valid token of each row; [B, T] rewards are masked as given."""
    if rewards.dim() == 2:
        return rewards * _valid(mask, rewards)
    last, has_any = last_token_index(mask)
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    out.scatter_(-1, last.unsqueeze(-1), (rewards * has_any.to(rewards.dtype)).unsqueeze(-1))
    return out


# --------------------------------------------------------------------------------------------------
# advantages


def grpo_advantages(rewards: torch.Tensor, group_size: int, std_normalization: bool = True) -> torch.Tensor:
    """GRPO: `A_i = (R_i - mean_g) / (std_g + 1e-6)`, std with Bessel's correction (N-1).

    `std_normalization=False` gives Dr. GRPO: `A_i = R_i - mean_g`. A group of one has std 0. Computed in
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


def _discounted_returns(rewards_t: torch.Tensor, gamma: float) -> torch.Tensor:
    """`G_t = sum_{u >= t} gamma^(u-t) r_u` over positions (vectorised over rows)."""
    T = rewards_t.shape[-1]
    if gamma == 1.0:
        return rewards_t.flip(-1).cumsum(-1).flip(-1)
    out = torch.empty_like(rewards_t)
    running = torch.zeros_like(rewards_t[..., 0])
    for t in range(T - 1, -1, -1):
        running = rewards_t[..., t] + gamma * running
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

    `r_t = mask_t * (-kl_coef * (old_logp_t - ref_logp_t) + [t is the last valid token] * R)`,
    `G_t = sum_{u >= t} gamma^(u - t) r_u`; the result is 0 on masked tokens.
    """
    valid = _valid(mask, old_logp)
    r = token_rewards(rewards.to(old_logp.dtype), mask) - kl_coef * (old_logp - ref_logp) * valid
    return _discounted_returns(r, gamma) * valid


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
    `returns = A + V`. Masked tokens are skipped (the recursion carries across them) and are 0.
    """
    valid = _valid(mask, values)
    r = token_rewards(rewards.to(values.dtype), mask)
    v = values * valid
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
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = exp_log_ratio(logp - old_logp)
    unclipped = -ratio * advantages
    clipped_term = -ratio.clamp(min=1.0 - eps_clip, max=1.0 + high) * advantages
    return torch.maximum(unclipped, clipped_term), clipped_term > unclipped


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
    high = eps_clip if eps_clip_high is None else eps_clip_high
    weight = exp_log_ratio(logp - old_logp).clamp(min=1.0 - eps_clip, max=1.0 + high).detach()
    return -weight * advantages.detach() * logp


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    eps_clip_high: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: sequence ratio `s_b = exp(masked_mean_t(logp - old_logp))` used by every token of row b in
    the PPO-Clip form `max(-s * A, -clip(s, 1 - eps_clip, 1 + eps_clip_high) * A)`.

    Gradients flow through `logp` (via `s`). An empty row has `s = 1`. Returns (loss, clipped).
    """
    valid = _valid(mask, logp)
    diff = torch.where(valid > 0, logp - old_logp, torch.zeros_like(logp))
    log_s = diff.sum(-1) / valid.sum(-1).clamp(min=1.0)
    seq_logp = log_s.unsqueeze(-1).expand_as(logp)
    return ppo_clip_loss(seq_logp, torch.zeros_like(seq_logp), advantages, eps_clip, eps_clip_high)


def sapo_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, tau_pos: float, tau_neg: float
) -> torch.Tensor:
    """SAPO: `-(4 / tau) * sigmoid(tau * (ratio - 1)) * A`, `tau = tau_pos` where `A > 0`, else `tau_neg`.

    The gate's slope `d/dratio (4/tau) sigmoid(tau (ratio - 1))` is 1 at ratio 1, like the plain ratio.
    The ratio is `exp_log_ratio`'s (beyond its clamp the gate is saturated).
    """
    ratio = exp_log_ratio(logp - old_logp)
    tau = torch.where(
        advantages > 0,
        torch.full_like(ratio, float(tau_pos)),
        torch.full_like(ratio, float(tau_neg)),
    )
    return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * advantages


def m2po_clip_bounds(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    kl2_budget: float,
    miniclip_low: float,
    miniclip_high: float,
) -> tuple[float, float, float, float]:
    """M2PO's adaptive clip bounds -> (eps_low, eps_high, m2_before, m2_after).

    Harmful tokens `H`: valid tokens with (`A > 0` and `ratio > 1`) or (`A < 0` and `ratio < 1`);
    `d = logp - old_logp`; `M2 = mean_H(d^2)` (0 when H is empty). If `M2 <= kl2_budget` nothing is
    clipped: `eps_low = eps_high = math.inf` and `m2_after = M2`. Otherwise `tau` solves
    `sum_H min(d^2, tau^2) = |H| * kl2_budget` exactly (water filling over the sorted `d^2`),
    `eps_low = max(1 - exp(-tau), miniclip_low)`, `eps_high = max(exp(tau) - 1, miniclip_high)`, and
    `m2_after = sum_H min(d^2, tau^2) / |H|`. Sort + prefix sums, O(n log n), one host sync at the end.
    Computed in float64. The inputs may be any shape (e.g. the concatenated valid tokens of a whole step).
    """
    with torch.no_grad():
        d = (logp.detach().to(torch.float64) - old_logp.detach().to(torch.float64)).reshape(-1)
        a = advantages.detach().reshape(-1)
        valid = (mask != 0).reshape(-1)
        harmful = valid & (((a > 0) & (d > 0)) | ((a < 0) & (d < 0)))
        sq = torch.where(harmful, d * d, torch.zeros_like(d))
        k = harmful.sum()
        kf = k.to(d.dtype)
        total = sq.sum()
        m2 = total / kf.clamp(min=1.0)
        budget = torch.as_tensor(kl2_budget, dtype=d.dtype, device=d.device)
        target = kf * budget
        # Water filling: harmful d^2 sorted ascending, the others pushed to the end.
        s = torch.sort(torch.where(harmful, sq, torch.full_like(sq, math.inf))).values
        finite = torch.isfinite(s)
        s0 = torch.where(finite, s, torch.zeros_like(s))
        prefix = torch.cumsum(s0, 0) - s0  # P_j: sum of the j smallest
        j = torch.arange(s.numel(), device=d.device)
        # f(s_j) = sum_H min(d^2, s_j) = P_j + (k - j) s_j is nondecreasing in j.
        f = torch.where(finite, prefix + (kf - j.to(d.dtype)) * s0, torch.full_like(s0, math.inf))
        if s.numel() > 0:
            jstar = torch.argmax((f >= target).to(torch.int8))
            rest = (kf - jstar.to(d.dtype)).clamp(min=1.0)
            tau2 = ((target - prefix[jstar]) / rest).clamp(min=0.0)
        else:
            tau2 = torch.zeros((), dtype=d.dtype, device=d.device)
        after = torch.minimum(sq, tau2).sum() / kf.clamp(min=1.0)
        tau = tau2.sqrt()
        eps_low = torch.clamp(1.0 - torch.exp(-tau), min=miniclip_low)
        eps_high = torch.clamp(torch.exp(tau) - 1.0, min=miniclip_high)
        clip = m2 > budget
        inf = torch.full_like(eps_low, math.inf)
        packed = torch.stack(
            [torch.where(clip, eps_low, inf), torch.where(clip, eps_high, inf), m2, torch.where(clip, after, m2)]
        ).tolist()
    return packed[0], packed[1], packed[2], packed[3]


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


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, tis_clip: float) -> torch.Tensor:
    """Truncated importance sampling: `w = min(exp(old_logp - rollout_logp), tis_clip)`, detached (`exp_log_ratio`)."""
    return exp_log_ratio(old_logp - rollout_logp).clamp(max=tis_clip).detach()


# --------------------------------------------------------------------------------------------------
# reduction


def masked_sum_reduce(values: torch.Tensor, mask: torch.Tensor, per_token: bool, denominator: float) -> torch.Tensor:
    """`sum(mask * v) / denominator` (per token) or `sum_b(token mean of row b) / denominator`.

    Masked entries never contribute (even NaN). An empty row's token mean is 0.
    """
    valid = _valid(mask, values)
    v = torch.where(valid > 0, values, torch.zeros_like(values))
    if per_token:
        return v.sum() / denominator
    row = v.sum(-1) / valid.sum(-1).clamp(min=1.0)
    return row.sum() / denominator


def reduce_loss(
    loss: torch.Tensor, mask: torch.Tensor, per_token: bool, num_tokens: Optional[float] = None
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    `per_token=True`: `sum(mask * loss) / N_eff`, `N_eff = num_tokens` (the global valid-token count)
    or this batch's valid-token count when None. `per_token=False`: mean over the rows of each row's
    token mean `sum_t mask * loss / sum_t mask` (an empty row counts with mean 0).
    """
    if per_token:
        n = float(num_tokens) if num_tokens is not None else (mask != 0).sum().item()
    else:
        n = loss.shape[0] if loss.dim() > 1 else 1
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
