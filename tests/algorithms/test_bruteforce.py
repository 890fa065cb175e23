"""Python-loop reference implementations of M2PO's solver, GAE and REINFORCE++ returns."""

from __future__ import annotations

import math

import pytest
import torch

from relax.algorithms import functional as F

D = torch.float64


def brute_m2po(d, a, mask, budget, lo_floor, hi_floor):
    sq = []
    for di, ai, mi in zip(d.flatten().tolist(), a.flatten().tolist(), mask.flatten().tolist(), strict=True):
        if mi and ((ai > 0 and di > 0) or (ai < 0 and di < 0)):
            sq.append(di * di)
    if not sq:
        return math.inf, math.inf, 0.0, 0.0
    m2 = sum(sq) / len(sq)
    if m2 <= budget:
        return math.inf, math.inf, m2, m2
    lo, hi = 0.0, max(sq)
    for _ in range(200):  # bisection on tau^2
        mid = (lo + hi) / 2
        if sum(min(x, mid) for x in sq) < len(sq) * budget:
            lo = mid
        else:
            hi = mid
    tau = math.sqrt((lo + hi) / 2)
    after = sum(min(x, tau * tau) for x in sq) / len(sq)
    return max(1 - math.exp(-tau), lo_floor), max(math.exp(tau) - 1, hi_floor), m2, after


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("budget", [0.001, 0.01, 0.05, 10.0])
def test_m2po_solver_matches_brute_force(seed, budget):
    g = torch.Generator().manual_seed(seed)
    B, T = 5, 7
    d = torch.randn(B, T, generator=g, dtype=D) * 0.3
    if seed % 2:
        d = d.round(decimals=1)  # ties in d^2
    a = torch.randn(B, T, generator=g, dtype=D)
    a[0] = 0.0  # zero advantages are never harmful
    mask = (torch.rand(B, T, generator=g) > 0.3).to(D)
    mask[1] = 0.0
    got = F.m2po_clip_bounds(d, torch.zeros_like(d), a, mask, budget, 0.01, 0.02)
    want = brute_m2po(d, a, mask, budget, 0.01, 0.02)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    if want[0] != math.inf:
        assert got[3] == pytest.approx(budget, rel=1e-9)  # the capped mean equals the budget


def test_m2po_masked_tokens_never_matter():
    g = torch.Generator().manual_seed(3)
    d = torch.randn(4, 6, generator=g, dtype=D)
    a = torch.randn(4, 6, generator=g, dtype=D)
    mask = (torch.rand(4, 6, generator=g) > 0.4).to(D)
    base = F.m2po_clip_bounds(d, torch.zeros_like(d), a, mask, 0.01, 0.1, 0.1)
    d2 = torch.where(mask > 0, d, torch.full_like(d, 7.0))
    a2 = torch.where(mask > 0, a, torch.full_like(a, 3.0))
    assert F.m2po_clip_bounds(d2, torch.zeros_like(d), a2, mask, 0.01, 0.1, 0.1) == base


def test_m2po_float32():
    d = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    lo, hi, before, after = F.m2po_clip_bounds(
        d, torch.zeros_like(d), torch.ones_like(d), torch.ones_like(d), 0.05, 0, 0
    )
    assert before == pytest.approx(0.075, rel=1e-5)
    assert after == pytest.approx(0.05, rel=1e-5)
    assert lo == pytest.approx(1 - math.exp(-math.sqrt(0.075)), rel=1e-5)


def brute_gae(rewards, values, mask, gamma, lambd):
    B, T = values.shape
    adv = torch.zeros(B, T, dtype=D)
    ret = torch.zeros(B, T, dtype=D)
    for b in range(B):
        idx = [t for t in range(T) if mask[b, t] != 0]
        if not idx:
            continue
        r = {t: 0.0 for t in idx}
        r[idx[-1]] = float(rewards[b])
        next_a, next_v = 0.0, 0.0
        for t in reversed(idx):
            v = float(values[b, t])
            delta = r[t] + gamma * next_v - v
            next_a = delta + gamma * lambd * next_a
            next_v = v
            adv[b, t] = next_a
            ret[b, t] = next_a + v
    return adv, ret


@pytest.mark.parametrize("gamma,lambd", [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0), (0.99, 1.0)])
def test_gae_matches_brute_force(gamma, lambd):
    g = torch.Generator().manual_seed(1)
    B, T = 4, 6
    rewards = torch.randn(B, generator=g, dtype=D)
    values = torch.randn(B, T, generator=g, dtype=D)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [1, 0, 1, 1, 0, 0]], dtype=D)
    adv, ret = F.gae(rewards, values, mask, gamma, lambd)
    want_adv, want_ret = brute_gae(rewards, values, mask, gamma, lambd)
    torch.testing.assert_close(adv, want_adv)
    torch.testing.assert_close(ret, want_ret)


def brute_reinforce_pp(rewards, mask, old, ref, kl_coef, gamma):
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=D)
    for b in range(B):
        valid = [t for t in range(T) if mask[b, t] != 0]
        last = valid[-1] if valid else None
        r = [0.0] * T
        for t in valid:
            r[t] = -kl_coef * float(old[b, t] - ref[b, t]) + (float(rewards[b]) if t == last else 0.0)
        for t in valid:
            out[b, t] = sum(gamma ** (u - t) * r[u] for u in range(t, T))
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_reinforce_pp_returns_match_brute_force(gamma):
    g = torch.Generator().manual_seed(2)
    B, T = 4, 6
    rewards = torch.randn(B, generator=g, dtype=D)
    old = torch.randn(B, T, generator=g, dtype=D)
    ref = torch.randn(B, T, generator=g, dtype=D)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]], dtype=D)
    got = F.reinforce_pp_returns(rewards, mask, old, ref, 0.05, gamma)
    torch.testing.assert_close(got, brute_reinforce_pp(rewards, mask, old, ref, 0.05, gamma))
