"""M2PO's bucketed water filling against the plain sort-based one, in float64, on random and edge-case inputs."""

from __future__ import annotations

import math

import pytest
import torch

from relax.algorithms import functional as F
from relax.algorithms.m2po_solver import _water_level

D = torch.float64


def sorted_water_filling(logp, old_logp, advantages, mask, budget, lo_floor, hi_floor):
    """The reference: harmful d^2 sorted in float64, prefix sums, the first s_j with P_j + (k - j) s_j >= k * budget."""
    d = logp.to(D).flatten() - old_logp.to(D).flatten()
    a = advantages.flatten()
    harmful = (mask.flatten() != 0) & (((a > 0) & (d > 0)) | ((a < 0) & (d < 0)))
    s = torch.sort(d[harmful] ** 2).values
    k = s.numel()
    if k == 0:
        return math.inf, math.inf, 0.0, 0.0
    m2 = s.sum().item() / k
    if not m2 > budget:
        return math.inf, math.inf, m2, m2
    target = k * budget
    prefix = torch.cumsum(s, 0) - s
    f = prefix + (k - torch.arange(k, dtype=D)) * s
    reached = (f >= target).nonzero()
    # none reached: the sum exceeds the target only by rounding, the level is the largest value
    tau2 = s[-1].item() if reached.numel() == 0 else ((target - prefix[reached[0, 0]]) / (k - reached[0, 0])).item()
    after = torch.minimum(s, torch.tensor(tau2, dtype=D)).sum().item() / k
    tau = math.sqrt(tau2)
    return max(1 - math.exp(-tau), lo_floor), max(math.exp(tau) - 1, hi_floor), m2, after


def level(eps_high):
    """tau^2 back from eps_high (without a floor), the well-conditioned direction."""
    return math.log1p(eps_high) ** 2


def make(n, seed, dtype=torch.float32, scale=0.1, ties=False, harmful="mixed"):
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(n, generator=g, dtype=D) * scale
    if ties:
        d = (d / scale * 4).round() * scale / 4  # few distinct |d|: many equal d^2
    old = (-torch.rand(n, generator=g, dtype=D) * 3).to(dtype)
    logp = (old.to(D) + d).to(dtype)
    a = torch.randn(n, generator=g, dtype=dtype)
    sign = torch.sign(logp.to(D) - old.to(D)).to(dtype)
    if harmful == "all":
        a = a.abs() * sign
    elif harmful == "none":
        a = -a.abs() * sign
    mask = (torch.rand(n, generator=g) > 0.3).to(dtype)
    if harmful == "all":
        mask = torch.ones_like(mask)
    return logp, old, a, mask


def m2_of(logp, old, a, mask):
    return sorted_water_filling(logp, old, a, mask, math.inf, 0.0, 0.0)[2]


def check(got, want, rel=1e-10):
    lo, hi, before, after = got
    w_lo, w_hi, w_before, w_after = want
    assert before == pytest.approx(w_before, rel=1e-12, abs=1e-300)
    if w_hi == math.inf:
        assert (lo, hi) == (math.inf, math.inf) and after == before
        return
    assert level(hi) == pytest.approx(level(w_hi), rel=rel)
    assert lo == pytest.approx(w_lo, rel=rel)
    assert after == pytest.approx(w_after, rel=1e-12)


@pytest.mark.parametrize("n", [1, 2, 7, 100, 5000, 60_000])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_sorted_water_filling(n, ties, dtype):
    for seed, scale in enumerate([1e-3, 0.1, 3.0]):
        logp, old, a, mask = make(n, seed, dtype, scale, ties)
        m2 = m2_of(logp, old, a, mask)
        for budget in [1e-6, 1e-4, 0.01, 1.0, m2 * 0.5, m2 * 0.01]:
            if budget <= 0:
                continue
            want = sorted_water_filling(logp, old, a, mask, budget, 0.0, 0.0)
            check(F.m2po_clip_bounds(logp, old, a, mask, budget, 0.0, 0.0), want)
            if want[0] != math.inf:  # the capped mean equals the budget
                assert want[3] == pytest.approx(budget, rel=1e-9)


@pytest.mark.parametrize("harmful", ["all", "none"])
def test_all_and_no_harmful_tokens(harmful):
    logp, old, a, mask = make(3000, 1, harmful=harmful)
    for budget in [1e-5, 1e-3, 0.1]:
        got = F.m2po_clip_bounds(logp, old, a, mask, budget, 0.0, 0.0)
        want = sorted_water_filling(logp, old, a, mask, budget, 0.0, 0.0)
        if harmful == "none":
            assert got == (math.inf, math.inf, 0.0, 0.0) == want
        else:
            check(got, want)


@pytest.mark.parametrize("factor", [1 - 1e-6, 1 - 1e-9, 1.0, 1 + 1e-9, 1 + 1e-6])
def test_budget_just_below_and_above_m2(factor):
    logp, old, a, mask = make(20_000, 2)
    m2 = m2_of(logp, old, a, mask)
    budget = m2 * factor
    got = F.m2po_clip_bounds(logp, old, a, mask, budget, 0.0, 0.0)
    if factor > 1:
        assert got[:2] == (math.inf, math.inf) and got[3] == got[2]
    elif factor < 1:
        want = sorted_water_filling(logp, old, a, mask, budget, 0.0, 0.0)
        # tau^2 is ill-conditioned here (only a few values lie above it): agree to a looser tolerance
        check(got, want, rel=1e-6)
        assert got[3] == pytest.approx(budget, rel=1e-12)
    # at the budget itself either answer is right up to rounding; neither may clip much
    lo, hi, before, after = got
    assert after == pytest.approx(before, rel=1e-6)
    d2 = ((logp.to(D) - old.to(D)) ** 2).max().item()
    assert hi == math.inf or level(hi) <= d2 * (1 + 1e-12)


def test_level_when_the_sum_exceeds_the_target_only_by_rounding():
    # no sorted prefix reaches the target: the level is the largest value (nothing is clipped), not ~0
    g = torch.Generator().manual_seed(4)
    sq = torch.rand(10_000, generator=g, dtype=D) ** 3 + 1e-3
    total = sq.sum().item()
    for target in [total, math.nextafter(total, 0.0)]:
        tau2 = _water_level(sq, target, 1e-4, sq.max().item()).item()
        assert tau2 == pytest.approx(sq.max().item(), rel=1e-9)


def test_bounds_floors_and_masked_garbage():
    logp, old, a, mask = make(4000, 3)
    want = sorted_water_filling(logp, old, a, mask, 1e-3, 0.3, 0.5)
    got = F.m2po_clip_bounds(logp, old, a, mask, 1e-3, 0.3, 0.5)
    assert got[:2] == (max(want[0], 0.3), max(want[1], 0.5))
    off = mask == 0
    logp2, old2, a2 = logp.clone(), old.clone(), a.clone()
    logp2[off], old2[off], a2[off] = math.nan, -math.inf, math.inf
    assert F.m2po_clip_bounds(logp2, old2, a2, mask, 1e-3, 0.3, 0.5) == got


def test_values_beyond_the_bucket_range_and_tiny_budgets():
    # d^2 spanning ~200 octaves: the top bucket overflows and the bottom one holds everything below the budget
    g = torch.Generator().manual_seed(5)
    d = torch.exp(torch.empty(5000, dtype=D).uniform_(-60, 10, generator=g))
    ones = torch.ones_like(d)
    for budget in [1e-40, 1e-12, 1e-3, 10.0]:
        want = sorted_water_filling(d, d * 0, ones, ones, budget, 0.0, 0.0)
        check(F.m2po_clip_bounds(d, d * 0, ones, ones, budget, 0.0, 0.0), want)
