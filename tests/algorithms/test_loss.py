"""compute_loss / compute_value_loss: reduction contract, shared terms, gradients, masking."""

from __future__ import annotations

import math

import pytest
import torch

from relax.algorithms import LossBatch, compute_loss, compute_value_loss, get
from relax.algorithms import functional as F
from relax.algorithms.loss import ENTROPY, KL_LOSS, LOSS, PG_CLIPFRAC, PG_LOSS, PPO_KL
from relax.algorithms.m2po import M2_AFTER, M2_BEFORE

D = torch.float64
ALL = ["grpo", "rloo", "ppo", "cispo", "gspo", "sapo", "m2po", "reinforce_pp", "reinforce_pp_baseline"]
KL_TYPES = ["k1", "k2", "k3"]


def make_batch(seed=0, B=6, T=5, dtype=D):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.3).to(dtype)
    mask[0, 0] = 1.0
    mask[2] = 0.0  # an empty response
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 2
    logp = old + 0.3 * torch.randn(B, T, generator=g, dtype=dtype)
    return LossBatch(
        logp=logp.clone().requires_grad_(),
        old_logp=old,
        advantages=torch.randn(B, T, generator=g, dtype=dtype),
        mask=mask,
        ref_logp=old + 0.2 * torch.randn(B, T, generator=g, dtype=dtype),
        rollout_logp=old + 0.5 * torch.randn(B, T, generator=g, dtype=dtype),
        entropy=torch.rand(B, T, generator=g, dtype=dtype),
    )


def cfg_for(name, **kw):
    return get(name).config_cls(**kw)


def rows(batch, idx, stats=None):
    out = {}
    for k in ("logp", "old_logp", "advantages", "mask", "ref_logp", "rollout_logp", "entropy"):
        v = getattr(batch, k)
        out[k] = None if v is None else v[idx]
    return LossBatch(**out, stats=stats)


def denominator(batch, per_token):
    return float(batch.mask.sum()) if per_token else float(batch.mask.shape[0])


def whole_step_stats(cfg, batch):
    """What a trainer's statistics pass hands every micro-batch (None for algorithms without one)."""
    algo = get(cfg.name)
    if not algo.needs_step_statistics:
        return None
    return algo.step_statistics(cfg, batch.logp.detach(), batch.old_logp, batch.advantages, batch.mask)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("per_token", [True, False])
def test_loss_and_metrics_invariant_to_micro_batch_split(name, per_token):
    cfg = cfg_for(name, use_tis=True, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01)
    batch = make_batch()
    den = denominator(batch, per_token)
    n = float(batch.mask.sum())
    stats = whole_step_stats(cfg, batch)
    whole, whole_m = compute_loss(cfg, batch, per_token=per_token, denominator=den, num_tokens=n)
    for split in ([slice(0, 2), slice(2, 6)], [slice(0, 1), slice(1, 3), slice(3, 6)]):
        parts = [
            compute_loss(cfg, rows(batch, s, stats), per_token=per_token, denominator=den, num_tokens=n)
            for s in split
        ]
        torch.testing.assert_close(sum(p[0] for p in parts), whole)
        for key, value in whole_m.items():
            torch.testing.assert_close(sum(p[1][key] for p in parts), value)


def test_m2po_micro_batches_use_the_step_statistics():
    cfg = cfg_for("m2po", kl2_budget=0.001, miniclip_low=0.0, miniclip_high=0.0)
    b = make_batch()
    n = float(b.mask.sum())
    stats = whole_step_stats(cfg, b)
    lo, hi, before, after = F.m2po_clip_bounds(b.logp, b.old_logp, b.advantages, b.mask, 0.001, 0.0, 0.0)
    assert stats == {"eps_low": lo, "eps_high": hi, M2_BEFORE: before, M2_AFTER: after}
    part = rows(b, slice(0, 2), stats)
    loss, metrics = compute_loss(cfg, part, per_token=True, denominator=n, num_tokens=n)
    pg, _ = F.ppo_clip_loss(part.logp, part.old_logp, part.advantages, lo, hi)
    torch.testing.assert_close(loss, (pg * part.mask).sum() / n)
    share = float(part.mask.sum()) / n  # the step's value, weighted by this micro-batch's share of tokens
    assert metrics[M2_BEFORE].item() == pytest.approx(before * share)
    # without the step's statistics a micro-batch solves its own (different) bounds
    alone, _ = compute_loss(cfg, rows(b, slice(0, 2)), per_token=True, denominator=n, num_tokens=n)
    assert not torch.allclose(alone, loss)


def test_diagnostics_are_token_means_whatever_the_reduction():
    # two responses of 1 and 3 valid tokens; only the first response's token is clipped
    l15, l11, l09 = math.log(1.5), math.log(1.1), math.log(0.9)
    b = LossBatch(
        logp=torch.tensor([[l15, 5.0, 5.0], [l11, l09, 0.0]], dtype=D, requires_grad=True),
        old_logp=torch.zeros(2, 3, dtype=D),
        advantages=torch.ones(2, 3, dtype=D),
        mask=torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=D),
        entropy=torch.tensor([[2.0, 9.0, 9.0], [1.0, 1.0, 7.0]], dtype=D),
    )
    want = {
        PG_CLIPFRAC: 1 / 4,  # per-response would be (1 + 0) / 2
        PPO_KL: -(l15 + l11 + l09 + 0.0) / 4,
        ENTROPY: (2.0 + 1.0 + 1.0 + 7.0) / 4,  # per-response would be (2 + 3) / 2
    }
    for per_token, den in ((True, 4.0), (False, 2.0)):
        _, whole = compute_loss(cfg_for("grpo"), b, per_token=per_token, denominator=den, num_tokens=4)
        parts = [
            compute_loss(cfg_for("grpo"), rows(b, s), per_token=per_token, denominator=den, num_tokens=4)[1]
            for s in (slice(0, 1), slice(1, 2))
        ]
        for key, value in want.items():
            assert whole[key].item() == pytest.approx(value), (per_token, key)
            assert sum(p[key] for p in parts).item() == pytest.approx(value), (per_token, key)
    # the loss itself keeps the per-response reduction: (-1.2 + (-1.1 - 0.9 - 1.0) / 3) / 2
    loss, _ = compute_loss(cfg_for("grpo"), b, per_token=False, denominator=2.0, num_tokens=4)
    assert loss.item() == pytest.approx((-1.2 + (-1.1 - 0.9 - 1.0) / 3) / 2)


def test_m2po_metrics_are_token_weighted_whatever_the_reduction():
    cfg = cfg_for("m2po", kl2_budget=0.001)
    b = make_batch()
    n = float(b.mask.sum())
    stats = whole_step_stats(cfg, b)
    parts = [
        compute_loss(cfg, rows(b, s, stats), per_token=False, denominator=6.0, num_tokens=n)[1]
        for s in (slice(0, 1), slice(1, 4), slice(4, 6))
    ]
    for key in (M2_BEFORE, M2_AFTER):
        assert sum(p[key] for p in parts).item() == pytest.approx(stats[key], rel=1e-12)


def test_per_token_reduction_formula_and_shared_terms():
    cfg = cfg_for("grpo", use_tis=True, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01)
    b = make_batch()
    n = float(b.mask.sum())
    loss, metrics = compute_loss(cfg, b, per_token=True, denominator=n)
    pg, clipped = F.ppo_clip_loss(b.logp, b.old_logp, b.advantages, 0.2, 0.2)
    w = torch.clamp(torch.exp(b.old_logp - b.rollout_logp), max=2.0)
    pg_loss = (pg * w * b.mask).sum() / n
    kl = (F.kl_estimate(b.logp, b.ref_logp, "k3") * b.mask).sum() / n
    ent = (b.entropy * b.mask).sum() / n
    torch.testing.assert_close(loss, pg_loss + 0.1 * kl - 0.01 * ent)
    torch.testing.assert_close(metrics[PG_LOSS], pg_loss.detach())
    torch.testing.assert_close(metrics[KL_LOSS], kl.detach())
    torch.testing.assert_close(metrics[ENTROPY], ent)
    torch.testing.assert_close(metrics[LOSS], loss.detach())
    torch.testing.assert_close(metrics[PG_CLIPFRAC], (clipped * b.mask).sum() / n)
    torch.testing.assert_close(metrics[PPO_KL], ((b.old_logp - b.logp.detach()) * b.mask).sum() / n)
    assert all(not v.requires_grad for v in metrics.values())


def test_per_sequence_reduction_formula():
    cfg = cfg_for("reinforce_pp_baseline")
    b = make_batch()
    loss, _ = compute_loss(cfg, b, per_token=False, denominator=6)
    pg, _ = F.ppo_clip_loss(b.logp, b.old_logp, b.advantages, 0.2, 0.2)
    want = 0.0
    for i in range(6):
        n_i = float(b.mask[i].sum())
        if n_i:
            want = want + (pg[i] * b.mask[i]).sum() / n_i
    torch.testing.assert_close(loss, want / 6)


def test_rloo_gradient_is_minus_advantage_over_n_eff():
    b = make_batch()
    n_eff = float(b.mask.sum())
    loss, metrics = compute_loss(cfg_for("rloo"), b, per_token=True, denominator=n_eff)
    loss.backward()
    torch.testing.assert_close(b.logp.grad, -b.advantages * b.mask / n_eff)
    assert metrics[PG_CLIPFRAC].item() == 0.0


def test_cispo_passes_no_gradient_through_its_weight():
    b = make_batch()
    n = float(b.mask.sum())
    loss, _ = compute_loss(cfg_for("cispo", eps_clip_high=0.1), b, per_token=True, denominator=n)
    loss.backward()
    w = torch.exp(b.old_logp - b.old_logp + (b.logp.detach() - b.old_logp)).clamp(0.8, 1.1)
    torch.testing.assert_close(b.logp.grad, -w * b.advantages * b.mask / n)


def test_tis_weight_multiplies_policy_loss_and_is_detached():
    b = make_batch()
    n = float(b.mask.sum())
    loss, _ = compute_loss(cfg_for("rloo", use_tis=True, tis_clip=1.5), b, per_token=True, denominator=n)
    loss.backward()
    w = torch.exp(b.old_logp - b.rollout_logp).clamp(max=1.5)
    torch.testing.assert_close(b.logp.grad, -w * b.advantages * b.mask / n)


def test_m2po_metrics_and_bounds():
    b = make_batch()
    n = float(b.mask.sum())
    cfg = cfg_for("m2po", kl2_budget=0.001, miniclip_low=0.0, miniclip_high=0.0)
    loss, metrics = compute_loss(cfg, b, per_token=True, denominator=n)
    lo, hi, before, after = F.m2po_clip_bounds(b.logp, b.old_logp, b.advantages, b.mask, 0.001, 0.0, 0.0)
    assert metrics[M2_BEFORE].item() == pytest.approx(before)
    assert metrics[M2_AFTER].item() == pytest.approx(0.001)
    pg, _ = F.ppo_clip_loss(b.logp, b.old_logp, b.advantages, lo, hi)
    torch.testing.assert_close(loss, (pg * b.mask).sum() / n)
    # with a generous budget M2PO is the unclipped ratio objective
    loss, metrics = compute_loss(cfg_for("m2po", kl2_budget=100.0), b, per_token=True, denominator=n)
    ratio = torch.exp(b.logp - b.old_logp)
    torch.testing.assert_close(loss, (-ratio * b.advantages * b.mask).sum() / n)
    assert metrics[PG_CLIPFRAC].item() == 0.0
    assert metrics[M2_AFTER].item() == pytest.approx(metrics[M2_BEFORE].item())


@pytest.mark.parametrize("garbage", [(3.0, -7.0), (math.nan, math.inf), (-math.inf, math.nan), (-1e4, 1e4)])
@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("per_token", [True, False])
def test_masked_tokens_never_change_anything(name, per_token, garbage):
    cfg = cfg_for(name, use_tis=True, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01)
    a, b = make_batch(), make_batch()
    off = b.mask == 0
    with torch.no_grad():
        b.logp[off] = garbage[0]
    for k in ("old_logp", "advantages", "ref_logp", "rollout_logp", "entropy"):
        getattr(b, k)[off] = garbage[1]
    den = denominator(a, per_token)
    la, ma = compute_loss(cfg, a, per_token=per_token, denominator=den)
    lb, mb = compute_loss(cfg, b, per_token=per_token, denominator=den)
    torch.testing.assert_close(la, lb)
    for key in ma:
        torch.testing.assert_close(ma[key], mb[key])
    la.backward()
    lb.backward()
    torch.testing.assert_close(a.logp.grad, b.logp.grad)
    assert torch.all(b.logp.grad[off] == 0)


def extreme_batch(dtype):
    """Log-ratios of +-100 (exp overflows fp32 above 88.7) against old, ref and rollout log-probs, on valid
    tokens (rows 0 and 2) and masked ones (rows 1 and 3), with advantages of both signs."""
    d = torch.tensor([100.0, -100.0, 0.1, 100.0, -100.0, 0.1, 50.0, -0.2], dtype=dtype)
    a = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 2.0, -3.0], dtype=dtype)
    logp = torch.where(d > 0, torch.full_like(d, -0.5), -0.5 + d)  # log-probs stay <= 0
    old = logp - d
    x = d.roll(1)  # logp - ref
    y = d.roll(2)  # old - rollout
    rows4 = lambda v: v.expand(4, -1).clone()  # noqa: E731
    mask = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=dtype)[:, None].expand(4, 8).clone()
    mask[2, 5:] = 0.0  # a partly valid row
    logp4 = rows4(logp)
    return LossBatch(
        logp=logp4.requires_grad_(),
        old_logp=rows4(old),
        advantages=rows4(a),
        mask=mask,
        ref_logp=rows4(logp - x),
        rollout_logp=rows4(old - y),
        entropy=rows4(torch.rand(8, generator=torch.Generator().manual_seed(0), dtype=dtype)),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kl", KL_TYPES)
@pytest.mark.parametrize("name", ALL)
def test_extreme_log_ratios_give_finite_losses_and_gradients(name, kl, dtype):
    cfg = cfg_for(name, use_tis=True, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type=kl, entropy_coef=0.01)
    for per_token in (True, False):
        b = extreme_batch(dtype)
        den = denominator(b, per_token)
        loss, metrics = compute_loss(cfg, b, per_token=per_token, denominator=den, num_tokens=float(b.mask.sum()))
        assert torch.isfinite(loss), (per_token, loss)
        assert all(torch.isfinite(v) for v in metrics.values()), metrics
        loss.backward()
        assert torch.isfinite(b.logp.grad).all(), b.logp.grad
        assert torch.all(b.logp.grad[b.mask == 0] == 0)


def test_k3_regression_masked_underflowing_logp():
    # x = logp - ref = -100 on the masked token: exp(-x) overflows fp32; its gradient used to be NaN
    b = LossBatch(
        logp=torch.tensor([[-0.5, -100.0]], requires_grad=True),
        old_logp=torch.tensor([[-0.5, -100.0]]),
        advantages=torch.zeros(1, 2),
        mask=torch.tensor([[1.0, 0.0]]),
        ref_logp=torch.tensor([[-0.6, 0.0]]),
    )
    cfg = cfg_for("grpo", use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k3")
    loss, metrics = compute_loss(cfg, b, per_token=True, denominator=1.0)
    loss.backward()
    # k3 = exp(-x) - 1 + x with x = 0.1 on the valid token; d k3 / d logp = 1 - exp(-x)
    assert loss.item() == pytest.approx(0.5 * (math.exp(-0.1) - 1 + 0.1), rel=1e-5)
    assert b.logp.grad[0, 0].item() == pytest.approx(0.5 * (1 - math.exp(-0.1)), rel=1e-5)
    assert b.logp.grad[0, 1].item() == 0.0


@pytest.mark.parametrize("name", ALL)
def test_all_masked_batch_gives_zero_and_finite_grads(name):
    b = make_batch()
    b.mask = torch.zeros_like(b.mask)
    cfg = cfg_for(name, use_kl_loss=True, kl_loss_coef=0.1)
    for per_token in (True, False):
        loss, metrics = compute_loss(cfg, b, per_token=per_token, denominator=0)
        assert loss.item() == 0.0
        assert all(math.isfinite(v.item()) for v in metrics.values())
        loss.backward()
        assert torch.all(b.logp.grad == 0)
        b.logp.grad = None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ALL)
def test_dtype_preserved(name, dtype):
    b = make_batch(dtype=dtype)
    loss, metrics = compute_loss(cfg_for(name), b, per_token=True, denominator=float(b.mask.sum()))
    assert loss.dtype == dtype
    assert all(v.dtype == dtype for v in metrics.values())


def test_missing_inputs_raise():
    b = make_batch()
    b.ref_logp = None
    with pytest.raises(ValueError, match="ref_logp"):
        compute_loss(cfg_for("grpo", use_kl_loss=True, kl_loss_coef=0.1), b, per_token=True, denominator=10)
    b.rollout_logp = None
    with pytest.raises(ValueError, match="rollout_logp"):
        compute_loss(cfg_for("grpo", use_tis=True), b, per_token=True, denominator=10)


def test_value_clipfrac_counts_only_tokens_beyond_the_clip():
    # |V - V_old| < value_clip everywhere: V_old + (V - V_old) != V after rounding used to count as clipped
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        values = torch.randn(256, 64, generator=g).to(dtype)
        old = values + (torch.rand(256, 64, generator=g).to(dtype) * 2 - 1) * 0.19
        ret = torch.randn(256, 64, generator=g).to(dtype)
        mask = torch.ones(256, 64, dtype=dtype)
        loss, m = compute_value_loss(cfg_for("ppo", value_clip=0.2), values, old, ret, mask, per_token=True,
                                     denominator=float(mask.sum()))
        assert m["critic/value_clipfrac"].item() == 0.0
        assert loss.item() == pytest.approx((0.5 * (values - ret) ** 2).mean().item(), rel=1e-6)
        assert torch.equal(F.value_loss(values, old, ret, 0.2), 0.5 * (values - ret) ** 2)


def test_value_clipfrac_is_a_token_mean_whatever_the_reduction():
    # rows of 1 and 3 valid tokens; only the first row's token is clipped and has the larger clipped error
    values = torch.tensor([[1.0, 0.0, 0.0], [0.1, 0.2, 0.3]], dtype=D)
    old = torch.tensor([[0.5, 0.0, 0.0], [0.0, 0.1, 0.2]], dtype=D)
    ret = torch.tensor([[0.9, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=D)
    # row 0: clipped value 0.7, errors (0.1)^2 < (0.2)^2 -> clipped; row 1: |V - V_old| = 0.1 <= 0.2
    for per_token, den in ((True, 4.0), (False, 2.0)):
        _, m = compute_value_loss(cfg_for("ppo", value_clip=0.2), values, old, ret, mask, per_token=per_token,
                                  denominator=den, num_tokens=4.0)
        assert m["critic/value_clipfrac"].item() == pytest.approx(1 / 4)


def test_value_loss_reduction_and_split():
    g = torch.Generator().manual_seed(5)
    B, T = 4, 3
    values = torch.randn(B, T, generator=g, dtype=D)
    old = values + 0.5 * torch.randn(B, T, generator=g, dtype=D)
    ret = torch.randn(B, T, generator=g, dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0]], dtype=D)
    cfg = cfg_for("ppo", value_clip=0.2)
    loss, m = compute_value_loss(cfg, values, old, ret, mask, per_token=True, denominator=6.0)
    torch.testing.assert_close(loss, (F.value_loss(values, old, ret, 0.2) * mask).sum() / 6)
    clip = F.value_clipped_mask(values, old, ret, 0.2)
    torch.testing.assert_close(m["critic/value_clipfrac"], (clip * mask).sum() / 6)
    parts = [
        compute_value_loss(cfg, values[s], old[s], ret[s], mask[s], per_token=False, denominator=4.0)
        for s in (slice(0, 1), slice(1, 4))
    ]
    whole = compute_value_loss(cfg, values, old, ret, mask, per_token=False, denominator=4.0)
    torch.testing.assert_close(parts[0][0] + parts[1][0], whole[0])
