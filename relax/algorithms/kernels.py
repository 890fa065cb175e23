"""Fused autograd kernels of two policy losses (`relax.algorithms.functional.ppo_clip_loss` and `sapo_loss` use
them): each computes `d loss / d logp` in its forward pass, so that the backward is one multiply instead of
autograd's data-dependent passes. Their values are those of the plain formulas in `functional`
(`_ppo_clip_autograd`, `_sapo_autograd`), which tests compare them with."""

from __future__ import annotations

import torch

from relax.algorithms.ratios import ratio_and_clamp_mask


class PPOClip(torch.autograd.Function):
    """`ppo_clip_loss` with `d loss / d logp` computed in the forward pass; the backward is one multiply.

    The forward values are `_ppo_clip_autograd`'s (`-clip(ratio, low, high) = clip(-ratio, -high, -low)` exactly).
    The gradient is autograd's through `maximum`, both clamps and `exp`: `d loss / d logp = -A * ratio`
    (the unclipped term) where `clipped` is False and the log-ratio is inside `exp_log_ratio`'s clamp, else 0.
    One difference: on an exact tie of the two terms with the ratio outside the clip range (the ratio within
    rounding of a bound, or A = 0) autograd passes half the gradient, this the whole. Autograd's backward costs
    several data-dependent passes (`maximum`'s tie handling, the clamp masks); this one saves a single tensor.
    """

    @staticmethod
    def forward(ctx, logp, old_logp, advantages, low_bound, high_bound):
        ratio, inside = ratio_and_clamp_mask(logp - old_logp)
        neg_ratio = ratio.neg_()
        unclipped = neg_ratio * advantages
        clipped_term = neg_ratio.clamp_(min=-high_bound, max=-low_bound) * advantages
        loss = torch.maximum(unclipped, clipped_term)
        clipped = clipped_term > unclipped
        if ctx.needs_input_grad[0]:
            # d unclipped / d logp = -A * ratio = unclipped; a NaN term is not clipped and keeps its NaN gradient
            blocked = clipped
            # one log-ratio per row (GSPO): the clamp's mask applies to the reduced gradient, in the backward
            broadcast = inside is not None and inside.shape != clipped.shape
            if inside is not None and not broadcast:
                blocked = inside.logical_not_().logical_or_(clipped)
            ctx.save_for_backward(torch.where(blocked, 0.0, unclipped), inside if broadcast else None)
        ctx.mark_non_differentiable(clipped)
        return loss, clipped

    @staticmethod
    def backward(ctx, grad_loss, grad_clipped):
        d_loss_d_logp, inside = ctx.saved_tensors
        grad = grad_loss * d_loss_d_logp
        if inside is not None:
            grad = torch.where(inside, grad.sum_to_size(inside.shape), 0.0)
        return grad, None, None, None, None


def select_(positive: torch.Tensor, if_positive: float, otherwise: float) -> torch.Tensor:
    """`if_positive` where `positive` (a 0/1 float tensor, overwritten when possible) is 1, else `otherwise`, both
    rounded to its dtype.

    Without branches (a `where` on a condition without structure, e.g. the sign of per-token advantages, mispredicts
    a branch per element): `positive * (if_positive - otherwise) + otherwise`, exact when that difference is (always
    for values within a factor 2 of each other), else `lerp`, which returns its ends exactly at weights 0 and 1.
    """
    ends = torch.tensor([otherwise, if_positive], dtype=positive.dtype)  # on the CPU: no device sync below
    step = ends[1] - ends[0]
    if bool(ends[0] + step == ends[1]):
        return positive.mul_(step.item()).add_(ends[0].item())
    ends = ends.to(positive.device)
    return torch.lerp(ends[0], ends[1], positive)


def mul_(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`x * y`, in place in `x` (a temporary) when that keeps the promoted dtype and shape."""
    if torch.result_type(x, y) == x.dtype and torch.broadcast_shapes(x.shape, y.shape) == x.shape:
        return x.mul_(y)
    return x * y


class SAPO(torch.autograd.Function):
    """`sapo_loss` with `d loss / d logp` computed in the forward pass; the backward is one multiply.

    The forward values are `_sapo_autograd`'s, operation for operation. The gradient is autograd's chain
    `-(4 / tau) * s (1 - s) * tau * ratio * A` (`s` the gate's sigmoid) written as `(1 - s) * ratio * tau * loss`
    (the two agree up to rounding) inside `exp_log_ratio`'s clamp, and 0 outside it.
    """

    @staticmethod
    def forward(ctx, logp, old_logp, advantages, tau_pos, tau_neg):
        ratio, inside = ratio_and_clamp_mask(logp - old_logp)
        positive = torch.sign(advantages).clamp_(min=0.0).to(ratio.dtype)  # 1 where A > 0, else 0
        tau = select_(positive, float(tau_pos), float(tau_neg))
        # -(4 / tau), divided in the ratio's dtype like the formula
        neg_coef = torch.div(torch.tensor(-4.0, dtype=tau.dtype, device=tau.device), tau)
        gate = torch.sigmoid_(mul_(ratio - 1.0, tau))
        loss = mul_(neg_coef.mul_(gate), advantages)
        if ctx.needs_input_grad[0]:
            # -4 s (1 - s) ratio A = (1 - s) ratio tau * loss
            slope = mul_(mul_((1.0 - gate).mul_(ratio), tau), loss)
            ctx.save_for_backward(slope if inside is None else torch.where(inside, slope, 0.0))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (d_loss_d_logp,) = ctx.saved_tensors
        return grad_loss * d_loss_d_logp, None, None, None, None
