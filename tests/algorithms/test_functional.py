"""Hand-computed cases for every function of relax.algorithms.functional."""

from __future__ import annotations

import math

import pytest
import torch

from relax.algorithms import functional as F

D = torch.float64


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


def close(a, b, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grpo_advantages(dtype):
    a = F.grpo_advantages(t([0.0, 1.0, 2.0, 5.0, 5.0, 5.0], dtype), 3)
    assert a.dtype == dtype
    close(a, [-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6), 0.0, 0.0, 0.0])  # mean 1, Bessel std 1
    # two samples: mean 0.5, std sqrt(0.5)
    close(F.grpo_advantages(t([1.0, 0.0]), 2), [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6)])
    close(F.grpo_advantages(t([0.0, 1.0, 2.0]), 3, std_normalization=False), [-1.0, 0.0, 1.0])


def test_grpo_zero_variance_group_gives_zero():
    a = F.grpo_advantages(t([3.0, 3.0, 3.0, 3.0, 0.0, 1.0, 0.0, 1.0]), 4)
    assert torch.all(a[:4] == 0)
    assert torch.all(a[4:] != 0)


@pytest.mark.parametrize("value", [0.1, 5.3])
def test_equal_rewards_give_exactly_zero_advantages_in_fp32(value):
    # fp32 rounding of the mean used to give -0.0074 (0.1) and +0.316 (5.3) after the std division
    r = torch.full((8,), value)
    for a in (F.grpo_advantages(r, 8), F.grpo_advantages(r, 4, std_normalization=False),
              F.rloo_advantages(r, 8), F.group_mean_baseline(r, 2)):
        assert a.dtype == torch.float32
        assert torch.equal(a, torch.zeros(8))
    # a group with signal next to a constant one: exact zeros there, the float64 formula here
    mixed = torch.tensor([value] * 4 + [0.0, 1.0, 0.0, 1.0])
    a = F.grpo_advantages(mixed, 4)
    assert torch.equal(a[:4], torch.zeros(4))
    std = math.sqrt(1 / 3)  # Bessel std of [0, 1, 0, 1]
    close(a[4:], [-0.5 / (std + 1e-6), 0.5 / (std + 1e-6)] * 2, tol=1e-6)
    close(F.rloo_advantages(mixed, 4)[4:], [-2 / 3, 2 / 3] * 2)


def test_global_token_normalize_constant_fp32_is_exactly_zero():
    values = torch.full((3, 5), 0.1)
    mask = torch.ones(3, 5)
    mask[1, 3:] = 0
    assert torch.equal(F.global_token_normalize(values, mask), torch.zeros(3, 5))


def test_grpo_single_group_and_group_of_one():
    close(F.grpo_advantages(t([1.0, 3.0]), 2), [-1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6)])
    close(F.grpo_advantages(t([1.0, 3.0]), 1), [0.0, 0.0])


def test_grpo_rejects_partial_groups():
    with pytest.raises(ValueError):
        F.grpo_advantages(t([1.0, 2.0, 3.0]), 2)


def test_rloo_advantages_hand():
    # baselines (leave one out): 1.5, 1.0, 0.5
    close(F.rloo_advantages(t([0.0, 1.0, 2.0]), 3), [-1.5, 0.0, 1.5])


def test_rloo_properties():
    g = torch.Generator().manual_seed(0)
    r = torch.rand(20, generator=g, dtype=D)
    a = F.rloo_advantages(r, 5)
    close(a.view(4, 5).sum(1), torch.zeros(4))
    for i in range(20):
        grp = (i // 5) * 5
        others = [r[j].item() for j in range(grp, grp + 5) if j != i]
        close(a[i], r[i].item() - sum(others) / len(others))
    with pytest.raises(ValueError):
        F.rloo_advantages(r, 1)


def test_group_mean_baseline_hand():
    close(F.group_mean_baseline(t([0.0, 1.0, 2.0, 4.0, 4.0, 4.0]), 3), [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0])


def test_reinforce_pp_returns_hand():
    # r = [-0.5*0.1, -0.5*0.2 + 1, 0 (masked)], G_0 = r_0 + 0.9 * G_1
    out = F.reinforce_pp_returns(
        t([1.0]), t([[1, 1, 0]]), t([[0.1, 0.2, 5.0]]), t([[0.0, 0.0, 0.0]]), kl_coef=0.5, gamma=0.9
    )
    close(out, [[-0.05 + 0.9 * 0.9, 0.9, 0.0]])


def test_global_token_normalize_hand():
    close(F.global_token_normalize(t([[1.0, 3.0, 100.0]]), t([[1, 1, 0]])), [[-1.0, 1.0, 0.0]])
    # constant values: variance floor 1e-8 -> zeros, no NaN
    close(F.global_token_normalize(t([[2.0, 2.0]]), t([[1, 1]])), [[0.0, 0.0]])
    close(F.global_token_normalize(t([[2.0, 7.0]]), t([[0, 0]])), [[0.0, 0.0]])


def test_gae_hand():
    # delta_1 = 1 - 0.25 = 0.75 ; delta_0 = 0.9*0.25 - 0.5 = -0.275 ; A_0 = -0.275 + 0.72*0.75 = 0.265
    adv, ret = F.gae(t([1.0]), t([[0.5, 0.25, 9.0]]), t([[1, 1, 0]]), gamma=0.9, lambd=0.8)
    close(adv, [[0.265, 0.75, 0.0]])
    close(ret, [[0.765, 1.0, 0.0]])


def test_gae_gamma_lambda_one_is_reward_minus_value():
    adv, ret = F.gae(t([2.0]), t([[0.5, 0.25, 0.1]]), t([[1, 1, 1]]), gamma=1.0, lambd=1.0)
    close(adv, [[1.5, 1.75, 1.9]])
    close(ret, [[2.0, 2.0, 2.0]])


def test_ppo_clip_loss_hand():
    lr = math.log(1.5)
    lo = math.log(0.5)
    logp = t([[lr, lr, lo, lo, 0.0]])
    a = t([[1.0, -1.0, 1.0, -1.0, 3.0]])
    loss, clipped = F.ppo_clip_loss(logp, torch.zeros_like(logp), a, 0.2, None)
    close(loss, [[-1.2, 1.5, -0.5, 0.8, -3.0]])
    assert clipped.tolist() == [[True, False, False, True, False]]
    # asymmetric high bound
    loss, clipped = F.ppo_clip_loss(logp, torch.zeros_like(logp), a, 0.2, 0.4)
    close(loss[0, 0], -1.4)
    # infinite bounds never clip
    loss, clipped = F.ppo_clip_loss(logp, torch.zeros_like(logp), a, math.inf, math.inf)
    close(loss, [[-1.5, 1.5, -0.5, 0.5, -3.0]])
    assert not clipped.any()


def test_reinforce_loss_value_and_grad():
    logp = t([[-1.0, -2.0]]).requires_grad_()
    a = t([[2.0, -1.0]]).requires_grad_()
    loss = F.reinforce_loss(logp, a)
    close(loss, [[2.0, -2.0]])
    loss.sum().backward()
    close(logp.grad, [[-2.0, 1.0]])
    assert a.grad is None or torch.all(a.grad == 0)


def test_cispo_value_and_no_gradient_through_weight():
    old = t([[-1.0 - math.log(1.5), -1.0 - math.log(1.1)]])
    logp = t([[-1.0, -1.0]]).requires_grad_()
    a = t([[2.0, 2.0]])
    loss = F.cispo_loss(logp, old, a, 0.2, 0.2)
    close(loss, [[-1.2 * 2 * -1.0, -1.1 * 2 * -1.0]])
    loss.sum().backward()
    # d/dlogp of -w*A*logp with w a constant: -w*A
    close(logp.grad, [[-1.2 * 2, -1.1 * 2]])


def test_gspo_hand_and_mask():
    l1, l3 = math.log(1.1), math.log(1.3)
    s = math.sqrt(1.1 * 1.3)
    logp = t([[l1, l3, 4.0]])
    mask = t([[1, 1, 0]])
    loss, clipped = F.gspo_loss(logp, torch.zeros_like(logp), t([[1.0, 1.0, 1.0]]), mask, 0.5, None)
    close(loss[0, :2], [-s, -s])
    assert not clipped[0, :2].any()
    loss, clipped = F.gspo_loss(logp, torch.zeros_like(logp), t([[1.0, 1.0, 1.0]]), mask, 0.1, None)
    close(loss[0, :2], [-1.1, -1.1])
    assert clipped[0, :2].all()
    # the masked token's value does not matter; an empty row has s = 1
    logp2 = t([[l1, l3, -9.0], [3.0, 2.0, 1.0]])
    mask2 = t([[1, 1, 0], [0, 0, 0]])
    loss2, _ = F.gspo_loss(logp2, torch.zeros_like(logp2), t([[1.0] * 3, [2.0] * 3]), mask2, 0.5, None)
    close(loss2[0, :2], [-s, -s])
    close(loss2[1], [-2.0, -2.0, -2.0])


def test_gspo_gradient_flows_through_logp():
    logp = t([[0.1, 0.3]]).requires_grad_()
    loss, _ = F.gspo_loss(logp, torch.zeros(1, 2, dtype=D), t([[1.0, 1.0]]), t([[1, 1]]), 10.0, None)
    loss.sum().backward()
    s = math.exp(0.2)
    # loss = -2 s, s = exp(mean) -> d/dlogp_t = -2 * s * 1/2
    close(logp.grad, [[-s, -s]])


def test_sapo_hand_and_gate_slope():
    logp = torch.zeros(1, 2, dtype=D, requires_grad=True)
    a = t([[1.0, -1.0]])
    loss = F.sapo_loss(logp, torch.zeros(1, 2, dtype=D), a, 1.0, 1.05)
    close(loss, [[-4.0 * 0.5, (4.0 / 1.05) * 0.5]])
    loss.sum().backward()
    # gate slope 1 at ratio 1: d loss / d ratio = -A, and d ratio / d logp = ratio = 1
    close(logp.grad, [[-1.0, 1.0]])
    # slope of the gate itself at ratio 1 for other temperatures
    for tau in (0.5, 2.0, 7.0):
        r = torch.ones((), dtype=D, requires_grad=True)
        ((4.0 / tau) * torch.sigmoid(tau * (r - 1))).backward()
        close(r.grad, 1.0)
    # A == 0 uses tau_neg and gives 0
    close(F.sapo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), 1.0, 1.05), [[0.0]])


def test_m2po_clip_bounds_hand():
    # harmful d^2 = 0.01, 0.04, 0.09, 0.16 -> M2 = 0.075; budget 0.05 -> target 0.2;
    # water level: 0.01 + 0.04 + 2 tau^2 = 0.2 -> tau^2 = 0.075
    d = t([[0.1, 0.2, 0.3, 0.4, -0.9, 5.0]])
    a = t([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])  # -0.9 is not harmful (A > 0, ratio < 1); 5.0 is masked
    m = t([[1, 1, 1, 1, 1, 0]])
    lo, hi, before, after = F.m2po_clip_bounds(d, torch.zeros_like(d), a, m, 0.05, 0.1, 0.1)
    tau = math.sqrt(0.075)
    close(lo, 1 - math.exp(-tau))
    close(hi, math.exp(tau) - 1)
    close(before, 0.075)
    close(after, 0.05)
    # miniclip floors
    lo, hi, _, _ = F.m2po_clip_bounds(d, torch.zeros_like(d), a, m, 0.05, 0.3, 0.5)
    assert (lo, hi) == (0.3, 0.5)
    # under budget: no clipping
    lo, hi, before, after = F.m2po_clip_bounds(d, torch.zeros_like(d), a, m, 0.08, 0.1, 0.1)
    assert lo == math.inf and hi == math.inf and before == pytest.approx(0.075) and after == before
    # no harmful tokens at all
    lo, hi, before, after = F.m2po_clip_bounds(d, torch.zeros_like(d), -a, m * 0, 0.01, 0.1, 0.1)
    assert (lo, hi, before, after) == (math.inf, math.inf, 0.0, 0.0)


def test_m2po_negative_advantages_are_harmful_when_ratio_below_one():
    d = t([[-0.3, 0.3]])
    a = t([[-1.0, -1.0]])  # only the first is harmful
    _, _, before, _ = F.m2po_clip_bounds(d, torch.zeros_like(d), a, t([[1, 1]]), 1.0, 0.1, 0.1)
    close(before, 0.09)


def test_value_clipped_mask_needs_the_clip_to_be_exceeded():
    g = torch.Generator().manual_seed(1)
    v = torch.randn(512, 128, generator=g)
    old = v + (torch.rand(512, 128, generator=g) * 2 - 1) * 0.2  # |V - V_old| <= 0.2 (up to rounding)
    ret = torch.randn(512, 128, generator=g)
    within = (v - old).abs() <= 0.2
    assert not F.value_clipped_mask(v, old, ret, 0.2)[within].any()
    assert torch.equal(F.value_loss(v, old, ret, 0.2)[within], (0.5 * (v - ret) ** 2)[within])


def test_value_loss_hand():
    v = t([[1.0, 0.6, 0.0]])
    old = t([[0.5, 1.0, 1.0]])
    ret = t([[0.0, 0.9, 0.0]])
    close(F.value_loss(v, old, ret, 0.2), [[0.5, 0.045, 0.32]])
    assert F.value_clipped_mask(v, old, ret, 0.2).tolist() == [[False, False, True]]


def test_exp_log_ratio_is_exp_inside_the_clamp_and_finite_outside():
    x = t([-100.0, -20.0, -1.0, 0.0, 3.0, 20.0, 100.0], torch.float32).requires_grad_()
    r = F.exp_log_ratio(x)
    close(r, [math.exp(-20), math.exp(-20), math.exp(-1), 1.0, math.exp(3), math.exp(20), math.exp(20)], tol=1e-6)
    r.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert x.grad[0] == 0 and x.grad[-1] == 0  # beyond the clamp the gradient is 0, not NaN


def test_k3_clamp_of_x_changes_no_value_and_no_gradient():
    # reference without any inner clamp, in float64 (exp(40) is finite there)
    x = torch.linspace(-40.0, 40.0, 8001, dtype=D)
    ref = t(x.tolist()).requires_grad_()
    want = (torch.exp(-ref) - 1 + ref).clamp(-10, 10)
    want.sum().backward()
    got_x = t(x.tolist()).requires_grad_()
    got = F.kl_estimate(got_x, torch.zeros_like(got_x), "k3")
    got.sum().backward()
    assert torch.equal(got, want.detach())
    assert torch.equal(got_x.grad, ref.grad)


def test_kl_estimates_hand():
    logp, ref = t([[0.5, -20.0]]), t([[0.0, 0.0]])
    close(F.kl_estimate(logp, ref, "k1"), [[0.5, -20.0]])
    close(F.kl_estimate(logp, ref, "k2"), [[0.125, 200.0]])
    close(F.kl_estimate(logp, ref, "k3"), [[math.exp(-0.5) - 0.5, 10.0]])
    with pytest.raises(ValueError):
        F.kl_estimate(logp, ref, "k4")


def test_reduce_loss_hand():
    loss = t([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0], [7.0, 7.0, 7.0]])
    mask = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    close(F.reduce_loss(loss, mask, per_token=True), 10.0 / 4)
    close(F.reduce_loss(loss, mask, per_token=True, num_tokens=10), 1.0)
    close(F.reduce_loss(loss, mask, per_token=False), (2.0 + 4.0) / 2)  # the empty row is not a response
    close(F.reduce_loss(loss, mask * 0, per_token=True), 0.0)
    close(F.reduce_loss(loss, mask * 0, per_token=False), 0.0)


def test_reduce_loss_per_response_counts_the_responses_the_trainer_counts():
    # the per-response denominator is N_resp, the rows with a valid token (trainer.step_denominators), not all rows:
    # a response left out of the loss (mask_truncated, a failed reward) must not shrink the others' weight
    from relax.algorithms import LossBatch, compute_loss, get
    from relax.train.trainer import step_denominators

    loss = t([[2.0, 0.0], [5.0, 5.0], [1.0, 3.0]])
    mask = t([[1, 0], [0, 0], [1, 1]])
    close(F.reduce_loss(loss, mask, per_token=False), (2.0 + 2.0) / 2)
    denominator, _ = step_denominators(mask, per_token=False)
    assert denominator == 2
    close(F.reduce_loss(loss, mask, per_token=False), F.masked_sum_reduce(loss, mask, False, denominator))
    # and compute_loss of a batch that is the whole step: RLOO's loss is -A * logp, so `loss` as -logp with A = 1
    logp = -loss.clone().requires_grad_()
    total, _ = compute_loss(get("rloo").config_cls(), LossBatch(logp=logp, old_logp=logp.detach(),
                                                                advantages=torch.ones_like(loss), mask=mask),
                            per_token=False, denominator=denominator)
    close(F.reduce_loss(loss, mask, per_token=False), total.detach())
    close(F.reduce_loss(loss[0], mask[0], per_token=False), 2.0)  # one row
    close(F.reduce_loss(loss[1], mask[1], per_token=False), 0.0)


def test_rloo_diagnostics_hand():
    out = F.rloo_diagnostics(
        t([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 5.0, 5.0]),
        torch.tensor([0, 0, 0, 1, 1, 1, 2, 2]),
        torch.tensor([2, 0, 3, 1, 1, 1, 4, 4]),
        3,
    )
    # group 0: baselines 0, .5, .5 -> A 1, -.5, -.5 ; group 1: baselines 1 -> A 0 ; group 2 incomplete
    expected = {
        "rollout/rloo/baseline_mean": 4 / 6,
        "rollout/rloo/adv_abs_mean": 2 / 6,
        "rollout/rloo/no_signal_frac": 3 / 8,
        "rollout/rloo/empty_response_frac": 1 / 6,
        "rollout/rloo/zero_adv_group_frac": 1 / 2,
        "rollout/rloo/dropped_group_frac": 1 / 3,
    }
    assert out == pytest.approx(expected)


def test_rloo_diagnostics_generated_lengths_decide_emptiness():
    # valid-token counts include the stop token: a lone <eos> is length 1 but generated length 0
    out = F.rloo_diagnostics(
        t([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]), torch.tensor([1, 3, 1, 2]), 2,
        generated_lengths=torch.tensor([0, 2, 1, 1]),
    )
    assert out["rollout/rloo/empty_response_frac"] == 1 / 4
    assert out["rollout/rloo/no_signal_frac"] == 0.0  # still over valid tokens


def test_rloo_diagnostics_float_noise_counts_as_zero():
    out = F.rloo_diagnostics(t([0.1, 0.1, 0.1]), torch.tensor([0, 0, 0]), torch.tensor([1, 1, 1]), 3)
    assert out["rollout/rloo/zero_adv_group_frac"] == 1.0
    assert out["rollout/rloo/no_signal_frac"] == 1.0


def test_float32_and_float64_preserved():
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(2, 3, dtype=dtype)
        m = torch.ones(2, 3)
        assert F.ppo_clip_loss(x, x * 0, x, 0.2)[0].dtype == dtype
        assert F.gspo_loss(x, x * 0, x, m, 0.2)[0].dtype == dtype
        assert F.sapo_loss(x, x * 0, x, 1.0, 1.05).dtype == dtype
        assert F.global_token_normalize(x, m).dtype == dtype
        assert F.gae(torch.ones(2, dtype=dtype), x, m, 1.0, 1.0)[0].dtype == dtype
        assert F.reinforce_pp_returns(torch.ones(2, dtype=dtype), m, x, x, 0.1, 0.9).dtype == dtype
        assert F.kl_estimate(x, x, "k3").dtype == dtype
        assert F.reduce_loss(x, m, True).dtype == dtype
