"""M2PO's adaptive clip bounds: the level `tau` that brings the second moment of the harmful log-ratios down to
the budget (water filling), computed without a full sort (`m2po_clip_bounds`)."""

from __future__ import annotations

import math
import struct

import torch

# Water filling without a full sort: the positive float64 `d^2` are bucketed by the high bits of their IEEE
# representation, which order positive floats like their values: bucket = (exponent, top `sub_bits` mantissa bits),
# i.e. 2**sub_bits buckets per octave, from the budget's bucket (the level tau^2 is never below the budget; bucket 0
# holds everything below) up to the largest value's. `sub_bits` is the largest (at most _M2PO_MAX_SUB_BITS) that
# keeps the bucket count within _M2PO_MAX_BUCKETS, so the per-bucket arrays stay small whatever the value range.
_M2PO_MAX_SUB_BITS = 10
_M2PO_MAX_BUCKETS = 1 << 14
_INF_BITS = 0x7FF0000000000000  # the int64 bits of float64 +inf


def _harmful_sq(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """The float64 `d^2` of the harmful tokens only (1-D), `d = logp - old_logp` computed in float64.

    A token is harmful when `sign(A) * sign(logp - old_logp) > 0` (a NaN never is): the difference in the inputs'
    dtype has the sign of the float64 one (it is 0 only when the two are equal), so only the harmful tokens are
    converted. Sign arithmetic costs less than four comparisons and three logical operations.
    """
    lp = logp.detach().reshape(-1)
    old = old_logp.detach().reshape(-1)
    same_sign = torch.sign(lp - old).mul_(torch.sign(advantages.detach().reshape(-1)))
    harmful = (same_sign > 0).logical_and_((mask != 0).reshape(-1))
    index = harmful.nonzero().squeeze(1)
    d = lp.index_select(0, index).to(torch.float64) - old.index_select(0, index).to(torch.float64)
    return d * d


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _water_level(sq: torch.Tensor, target: float, budget: float, top: float) -> torch.Tensor:
    """`tau^2` (0-d) with `sum min(sq, tau^2) = target`, for `sum sq > target > 0`, `tau^2 >= budget > 0` and
    `top = max(sq)`.

    Exactly the sorted water filling (first sorted `s_j` with `f_j = P_j + (k - j) s_j >= target`, then
    `tau^2 = (target - P_j) / (k - j)`), with the sort replaced by per-bucket counts and sums: `g(b) =
    sum min(sq, b)` at every bucket's lower edge gives the bucket that holds `tau^2`, and only its elements are
    sorted, the buckets below and above entering as a sum and a count.
    """
    octaves = (min(_float_bits(top), _INF_BITS) >> 52) - (_float_bits(budget) >> 52) + 1
    sub_bits = max(0, min(_M2PO_MAX_SUB_BITS, (_M2PO_MAX_BUCKETS // octaves).bit_length() - 1))
    shift = 52 - sub_bits
    first_key = (_float_bits(budget) >> shift) - 1  # bucket 1 starts at the budget's bucket
    n_buckets = (min(_float_bits(top), _INF_BITS) >> shift) - first_key + 1
    bucket = ((sq.view(torch.int64) >> shift) - first_key).clamp_(0, n_buckets - 1)
    counts = torch.bincount(bucket, minlength=n_buckets)
    sums = torch.bincount(bucket, weights=sq, minlength=n_buckets)
    below = torch.cumsum(sums, 0) - sums  # sum of the buckets below each bucket
    at_or_above = sq.numel() - (torch.cumsum(counts, 0) - counts)  # elements in this bucket and above
    edge_bits = (torch.arange(n_buckets, device=sq.device) + first_key) << shift
    edges = edge_bits.clamp_(min=0).view(torch.float64)  # lower edges (bucket 0's is unused)
    g = below + edges * at_or_above.to(torch.float64)  # g(edge) = sum below + edge * count at or above
    # tau^2 lies in the first bucket whose upper edge (the next lower edge) has g >= target; g(+inf) = sum sq > target
    reached = torch.cat([g[1:] >= target, torch.ones(1, dtype=torch.bool, device=sq.device)])
    b = int(torch.argmax(reached.to(torch.int8)))  # host sync: the bucket to sort
    level, above_all = _water_level_in_bucket(torch.sort(sq[bucket == b]).values, below[b], at_or_above[b], target)
    # above every element: `sum sq` exceeds `target` only by rounding, the level is the largest element
    return torch.where(above_all, top, level)


def _water_level_in_bucket(
    s: torch.Tensor, below: torch.Tensor, at_or_above: torch.Tensor, target: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted water filling over `s` (one bucket, ascending), with `below` the sum of the smaller elements and
    `at_or_above` the count of `s` and the larger ones -> (level, whether it is above every element).

    The solution is at one of `s` or above all of them, i.e. at the next larger element when there is one.
    """
    q = s.numel()
    prefix = torch.cumsum(s, 0) - s + below  # P_j
    rest = at_or_above - torch.arange(q, device=s.device)  # k - j
    f = torch.cat([prefix + rest * s, torch.full((1,), math.inf, dtype=s.dtype, device=s.device)])
    prefix = torch.cat([prefix, (below + s.sum()).reshape(1)])
    rest = torch.cat([rest, (at_or_above - q).reshape(1)])
    j = torch.argmax((f >= target).to(torch.int8))
    return ((target - prefix[j]) / rest[j].clamp(min=1)).clamp(min=0.0), rest[j] == 0


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
    `m2_after = sum_H min(d^2, tau^2) / |H|`. Computed in float64 over the harmful tokens only; the water level
    comes from bucket sums and a sort of the one bucket that holds it (`_water_level`), O(|H|). The inputs may be
    any shape (e.g. the concatenated valid tokens of a whole step).
    """
    with torch.no_grad():
        sq = _harmful_sq(logp, old_logp, advantages, mask)
        k = sq.numel()
        total, top = torch.stack([sq.sum(), sq.max()]).tolist() if k else (0.0, 0.0)  # host sync
        m2 = total / max(k, 1)
        if not m2 > kl2_budget:  # also a NaN M2 or budget: nothing is clipped
            return math.inf, math.inf, m2, m2
        target = k * kl2_budget
        if target > 0:
            tau2_t = _water_level(sq, target, kl2_budget, top)
        else:
            tau2_t = torch.zeros((), dtype=sq.dtype, device=sq.device)
        tau2, after = torch.stack([tau2_t, torch.minimum(sq, tau2_t).sum() / max(k, 1)]).tolist()  # host sync
    tau = math.sqrt(tau2)
    return max(1.0 - math.exp(-tau), miniclip_low), max(math.exp(tau) - 1.0, miniclip_high), m2, after
