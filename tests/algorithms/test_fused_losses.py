"""The policy losses that compute their gradient in the forward pass (PPO-Clip, SAPO) and the other fast paths of
relax.algorithms.functional, against the plain autograd formulas."""

from __future__ import annotations

import math

import pytest
import torch

from relax.algorithms import functional as F
from relax.algorithms.kernels import select_

DTYPES = [torch.float32, torch.float64]


def clipped_ratio_reference(logp, old_logp, advantages, low, high):
    """PPO-Clip through autograd: max(-ratio * A, -clip(ratio) * A), ratio = exp(clamp(logp - old, -20, 20))."""
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    unclipped = -ratio * advantages
    clipped_term = -ratio.clamp(min=1.0 - low, max=1.0 + high) * advantages
    return torch.maximum(unclipped, clipped_term), clipped_term > unclipped


def sapo_reference(logp, old_logp, advantages, tau_pos, tau_neg):
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * advantages


def inputs(dtype, n=4000, seed=0, beyond=True):
    """Log-ratios of every kind: small, on the clip bounds (ties), beyond the +-20 clamp (unless not `beyond`:
    then the clamp's mask is not built on the CPU); zero advantages."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    kinds = [0.0, math.log(1.2), math.log(0.8), math.log(1.28)] + ([25.0, -25.0, 20.0, -20.0] if beyond else [])
    kinds = torch.tensor(kinds, dtype=torch.float64)
    d = kinds[torch.randint(0, len(kinds), (n,), generator=g)] + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    d[: n // 2] = kinds[torch.randint(0, len(kinds), (n // 2,), generator=g)]  # exactly on the kinds
    a = torch.randn(n, generator=g, dtype=torch.float64)
    a[::7] = 0.0
    return (old + d).to(dtype), old.to(dtype), a.to(dtype)


def grads(fn, logp, *args):
    x = logp.clone().requires_grad_()
    out = fn(x, *args)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward(torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype).view_as(loss))
    return out, x.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", [(0.2, None), (0.2, 0.28), (math.inf, math.inf), (0.6, 0.1), (0.5, -0.8)])
@pytest.mark.parametrize("beyond", [True, False])
def test_ppo_clip_matches_autograd(dtype, eps, beyond):
    logp, old, a = inputs(dtype, beyond=beyond)
    low, high = eps[0], eps[0] if eps[1] is None else eps[1]
    (loss, clipped), grad = grads(F.ppo_clip_loss, logp, old, a, *eps)
    (want, want_clipped), want_grad = grads(clipped_ratio_reference, logp, old, a, low, high)
    assert torch.equal(loss, want) and torch.equal(clipped, want_clipped)
    # an exact tie of the two terms outside the clip range: autograd splits the gradient, the fused loss passes it
    ratio = torch.exp((logp - old).clamp(-20, 20))
    outside = (ratio < 1 - low) | (ratio > 1 + high)
    tie = (-ratio * a == -ratio.clamp(1 - low, 1 + high) * a) & outside & (a != 0)
    tie &= low + high >= 0  # crossed bounds (1 - low > 1 + high) take the autograd formula itself
    torch.testing.assert_close(grad[~tie], want_grad[~tie])  # up to the rounding of the product's order
    torch.testing.assert_close(grad[tie], 2 * want_grad[tie])
    outside_clamp = (logp - old).abs() > 20
    assert outside_clamp.any() == beyond and torch.all(grad[outside_clamp] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ppo_clip_broadcast_log_ratio_and_nan(dtype):
    # one log-ratio per row (GSPO), including rows beyond the clamp, and NaN inputs
    g = torch.Generator().manual_seed(1)
    log_s = torch.tensor([[0.05], [0.3], [-0.4], [30.0], [-30.0], [math.nan]], dtype=dtype)
    a = torch.randn(6, 5, generator=g, dtype=dtype)
    a[:, 0] = -1.0
    (loss, clipped), grad = grads(lambda x: F.ppo_clip_loss(x, torch.zeros((), dtype=dtype), a, 0.2), log_s)
    (want, want_clipped), want_grad = grads(lambda x: clipped_ratio_reference(x, torch.zeros((), dtype=dtype), a,
                                                                              0.2, 0.2), log_s)
    assert torch.equal(loss.nan_to_num(), want.nan_to_num()) and torch.equal(clipped, want_clipped)
    assert loss.shape == (6, 5) and grad.shape == (6, 1)
    torch.testing.assert_close(grad, want_grad, equal_nan=True)
    assert grad[3].item() == 0.0 and grad[4].item() == 0.0


def test_ppo_clip_differentiates_every_input_when_asked():
    logp, old, a = inputs(torch.float64, n=50)
    a = a.clone().requires_grad_()
    old = old.clone().requires_grad_()
    loss, _ = F.ppo_clip_loss(logp, old, a, 0.2)
    loss.sum().backward()
    want_a, want_old = a.grad.clone(), old.grad.clone()
    a.grad, old.grad = None, None
    clipped_ratio_reference(logp, old, a, 0.2, 0.2)[0].sum().backward()
    assert torch.equal(a.grad, want_a) and torch.equal(old.grad, want_old)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("taus", [(1.0, 1.05), (0.5, 7.0), (3.0, 0.1), (1e-9, 2.0)])
@pytest.mark.parametrize("beyond", [True, False])
def test_sapo_matches_autograd(dtype, taus, beyond):
    logp, old, a = inputs(dtype, seed=2, beyond=beyond)
    loss, grad = grads(F.sapo_loss, logp, old, a, *taus)
    want, want_grad = grads(sapo_reference, logp, old, a, *taus)
    assert torch.equal(loss, want)
    # the gradient is written as -4 s (1 - s) ratio A instead of autograd's -(4 / tau) s (1 - s) tau ratio A
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    torch.testing.assert_close(grad, want_grad, rtol=tol, atol=tol * want_grad.abs().max().item())
    outside_clamp = (logp - old).abs() > 20
    assert outside_clamp.any() == beyond and torch.all(grad[outside_clamp] == 0)


@pytest.mark.parametrize("dtype", DTYPES + [torch.bfloat16])
def test_branch_free_select_is_exact(dtype):
    positive = torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=dtype)
    g = torch.Generator().manual_seed(3)
    pairs = [(1.0, 1.05), (0.1, 3.0), (1e-30, 1e30), (5.0, 0.2)]
    pairs += [tuple((torch.rand(2, generator=g, dtype=torch.float64) * 10 ** torch.randint(-8, 8, (2,),
                                                                                      generator=g)).tolist())
              for _ in range(50)]
    for if_positive, otherwise in pairs:
        want = torch.where(positive > 0, torch.tensor(if_positive, dtype=dtype), torch.tensor(otherwise, dtype=dtype))
        assert torch.equal(select_(positive.clone(), if_positive, otherwise), want), (if_positive, otherwise)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cispo_weight_and_clip_flags(dtype):
    logp, old, a = inputs(dtype, seed=4)
    x = logp.clone().requires_grad_()
    loss, clipped = F.cispo_loss_and_clipped(x, old, a, 0.2, 0.28)
    ratio = torch.exp((logp - old).clamp(-20, 20))
    want = -ratio.clamp(0.8, 1.28) * a * logp
    assert torch.equal(loss.detach(), want)
    assert torch.equal(clipped, (ratio < 0.8) | (ratio > 1.28))
    assert torch.equal(F.cispo_loss(logp, old, a, 0.2, 0.28), want)
    loss.sum().backward()
    assert torch.equal(x.grad, -ratio.clamp(0.8, 1.28) * a)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gspo_zero_masked_inputs_give_the_same_loss(dtype):
    g = torch.Generator().manual_seed(5)
    mask = (torch.rand(8, 6, generator=g) > 0.3).to(dtype)
    mask[2] = 0.0
    logp = (torch.randn(8, 6, generator=g, dtype=dtype) * 0.2 - 1) * mask
    old = (torch.randn(8, 6, generator=g, dtype=dtype) * 0.2 - 1) * mask
    a = torch.randn(8, 6, generator=g, dtype=dtype) * mask
    (loss, clipped), grad = grads(lambda x: F.gspo_loss(x, old, a, mask, 0.1), logp)
    (fast, fast_clipped), fast_grad = grads(lambda x: F.gspo_loss(x, old, a, mask, 0.1, zero_masked=True), logp)
    assert torch.equal(loss, fast) and torch.equal(clipped, fast_clipped)
    torch.testing.assert_close(grad * mask, fast_grad * mask)


def test_masked_sum_reduce_takes_a_bool_mask():
    g = torch.Generator().manual_seed(6)
    values = torch.randn(5, 7, generator=g)
    mask = (torch.rand(5, 7, generator=g) > 0.4).float()
    values[mask == 0] = math.nan
    for per_token in (True, False):
        want = F.masked_sum_reduce(values, mask, per_token, 3.0)
        assert torch.isfinite(want)
        assert torch.equal(F.masked_sum_reduce(values, mask != 0, per_token, 3.0), want)
