"""Defaults and ranges that the algorithms review (F0-F3) fixed, each checked against an independent computation:
GSPO's own clip range (the paper's 3e-4 / 4e-4 on the sequence ratio), PPO's whitened GAE advantages (verl whitens
always), eps_clip in (0, 1) (CISPO: (0, 1]), and the KL-loss estimators' expected gradients (k1 refused as a loss)."""

from __future__ import annotations

import math

import pytest
import torch

import relax.algorithms as A
from relax.algorithms import AdvantageInputs
from relax.algorithms import functional as F
from relax.config import ConfigError, load_config

D = torch.float64


# ------------------------------------------------------------------------------------------------ GSPO (F0)


def test_gspo_defaults_are_the_papers_clip_range_and_the_config_gets_them():
    assert (A.GSPOConfig().eps_clip, A.GSPOConfig().clip_high) == (3e-4, 4e-4)
    cfg = load_config(["algorithm=gspo"]).algorithm
    assert (cfg.eps_clip, cfg.clip_high) == (3e-4, 4e-4)
    # the token-level algorithms keep 0.2
    assert A.GRPOConfig().eps_clip == 0.2 and A.GRPOConfig().eps_clip_high is None


# (sequence ratio s, advantage, clipped by [1 - 3e-4, 1 + 4e-4]): s above the range matters for A > 0 only, below it
# for A < 0 only (PPO-Clip keeps the more pessimistic term)
GSPO_CASES = [(1 + 5e-4, 1.0, True), (1 - 4e-4, -1.0, True), (1 + 3e-4, 1.0, False), (1 - 2e-4, -1.0, False),
              (1 + 5e-4, -1.0, False), (1 - 4e-4, 1.0, False)]


def test_gspo_default_clips_a_sequence_ratio_outside_the_papers_range_by_hand():
    lengths = [3, 2, 4, 1, 3, 2]
    T = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths], dtype=D)
    # token log-ratios that differ within a response but average to log(s): the mean, not each token, decides
    offsets = torch.tensor([[0.01 * ((t % 2) * 2 - 1) * (t < n - (n % 2)) for t in range(T)] for n in lengths], dtype=D)
    old_logp = torch.full((len(lengths), T), -1.0, dtype=D)
    log_s = torch.tensor([math.log(s) for s, _, _ in GSPO_CASES], dtype=D)
    logp = (old_logp + log_s[:, None] + offsets) * mask + old_logp * (1 - mask)
    logp.requires_grad_(True)
    adv = torch.tensor([a for _, a, _ in GSPO_CASES], dtype=D)[:, None] * mask

    out = A.get("gspo").policy_loss(A.GSPOConfig(), logp, old_logp, adv, mask)
    out.loss.sum().backward()
    for b, ((s, a, clipped), n) in enumerate(zip(GSPO_CASES, lengths, strict=True)):
        # independently: the geometric mean of the token ratios, plain floats
        ratios = [math.exp(logp[b, t].item() - old_logp[b, t].item()) for t in range(n)]
        seq = math.exp(sum(math.log(r) for r in ratios) / n)
        assert seq == pytest.approx(s, rel=1e-12)
        bounded = min(max(seq, 1 - 3e-4), 1 + 4e-4)
        assert (-bounded * a > -seq * a) is clipped  # the hand check agrees with the case table
        want = max(-seq * a, -bounded * a)
        for t in range(n):
            assert out.loss[b, t].item() == pytest.approx(want, rel=1e-12)
            assert bool(out.clipped[b, t]) is clipped
        grad = logp.grad[b, :n]
        assert torch.all(grad == 0) if clipped else torch.all(grad != 0)  # a clipped response has no gradient
    # the token-level 0.2 the registry used to give GSPO clips none of them: no trust region at this scale
    wide = A.get("gspo").policy_loss(A.GSPOConfig(eps_clip=0.2, eps_clip_high=0.2), logp.detach(), old_logp, adv, mask)
    assert not wide.clipped.any()


# ------------------------------------------------------------------------------------------------- PPO (F1)


def hand_gae(rewards, values, lengths, gamma, lambd):
    """Spec's GAE, plain loops: R on the last response token, V = 0 past it."""
    out = []
    for R, V, n in zip(rewards, values, lengths, strict=True):
        adv = [0.0] * len(V)
        nxt = 0.0
        for t in reversed(range(n)):
            r = R if t == n - 1 else 0.0
            v_next = V[t + 1] if t + 1 < n else 0.0
            nxt = r + gamma * v_next - V[t] + gamma * lambd * nxt
            adv[t] = nxt
        out.append(adv)
    return out


def hand_whiten(rows, lengths):
    """Masked whitening over every valid token of the batch (population variance, floor 1e-8 as the spec says;
    verl's masked_whiten divides by N - 1 instead of N, a factor N / (N - 1) of the variance)."""
    valid = [x for row, n in zip(rows, lengths, strict=True) for x in row[:n]]
    mu = sum(valid) / len(valid)
    var = sum((x - mu) ** 2 for x in valid) / len(valid)
    return [[(x - mu) / math.sqrt(max(var, 1e-8)) if t < n else 0.0 for t, x in enumerate(row)]
            for row, n in zip(rows, lengths, strict=True)]


def test_ppo_whitens_its_gae_advantages_by_default_as_verl_does():
    assert A.PPOConfig().normalize_advantages is True
    assert A.GRPOConfig().normalize_advantages is False  # only PPO's default changed
    rewards, lengths, T = [1.0, 0.0, 1.0, 0.0], [3, 4, 1, 2], 4
    values = [[0.1 * (b + 1) - 0.05 * t for t in range(T)] for b in range(4)]
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths], dtype=D)
    inputs = AdvantageInputs(rewards=torch.tensor(rewards, dtype=D), mask=mask, group_size=1,
                             values=torch.tensor(values, dtype=D))
    gamma, lambd = 0.9, 0.95
    raw = hand_gae(rewards, values, lengths, gamma, lambd)

    out = A.get("ppo").compute_advantages(A.PPOConfig(gamma=gamma, lambd=lambd), inputs)
    torch.testing.assert_close(out.advantages, torch.tensor(hand_whiten(raw, lengths), dtype=D), rtol=1e-12,
                               atol=1e-12)
    # the returns stay the critic's targets: raw advantages + V on valid tokens, whatever the whitening
    for b, n in enumerate(lengths):
        for t in range(n):
            assert out.returns[b, t].item() == pytest.approx(raw[b][t] + values[b][t], abs=1e-12)
    off = A.get("ppo").compute_advantages(A.PPOConfig(gamma=gamma, lambd=lambd, normalize_advantages=False), inputs)
    torch.testing.assert_close(off.advantages, torch.tensor(raw, dtype=D), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(off.returns, out.returns)


# ---------------------------------------------------------------------------------------------- eps_clip (F2)


@pytest.mark.parametrize("name,value", [("grpo", "1.5"), ("grpo", "1.0"), ("ppo", "1.0"), ("gspo", "1.2"),
                                        ("grpo", "0.0"), ("cispo", "1.5")])
def test_eps_clip_whose_lower_bound_is_not_positive_is_refused(name, value):
    with pytest.raises(ConfigError, match=rf"algorithm\.eps_clip={value} must be in \(0, 1[)\]]: .*lower") as err:
        load_config([f"algorithm={name}", f"algorithm.eps_clip={value}"])
    assert len(err.value.violations) == 1


def test_eps_clip_is_reported_with_the_other_problems_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(["algorithm.eps_clip=1.5", "algorithm.kl_loss_coef=0.1", "algorithm.dual_clip_c=0.5"])
    keys = {key for v in err.value.violations for key in v.fields}
    assert {"algorithm.eps_clip", "algorithm.kl_loss_coef", "algorithm.dual_clip_c"} <= keys


def test_eps_clip_just_below_one_and_a_large_eps_clip_high_are_accepted():
    assert load_config(["algorithm.eps_clip=0.999"]).algorithm.eps_clip == 0.999
    assert load_config(["algorithm.eps_clip_high=0.28"]).algorithm.clip_high == 0.28  # clip-higher (DAPO)
    assert load_config(["algorithm=cispo", "algorithm.eps_clip_high=10"]).algorithm.clip_high == 10
    with pytest.raises(ConfigError, match=r"algorithm\.eps_clip_high=0\.0 must be"):
        load_config(["algorithm.eps_clip_high=0.0"])


def test_cispo_eps_clip_one_is_the_one_sided_weight_clip():
    cfg = load_config(["algorithm=cispo", "algorithm.eps_clip=1", "algorithm.eps_clip_high=0.5"]).algorithm
    logp = torch.tensor([[-3.0, -1.0, 0.5, -0.2]], dtype=D)
    old_logp = torch.tensor([[-0.5, -1.0, -0.5, -0.2]], dtype=D)
    adv = torch.tensor([[1.0, -1.0, 2.0, 0.5]], dtype=D)
    out = A.get("cispo").policy_loss(cfg, logp, old_logp, adv, torch.ones(1, 4, dtype=D))
    # MiniMax-M1: w = min(ratio, 1 + eps_clip_high), no lower bound; loss value -w * A * logp
    for t in range(4):
        w = min(math.exp(logp[0, t].item() - old_logp[0, t].item()), 1.5)
        assert out.loss[0, t].item() == pytest.approx(-w * adv[0, t].item() * logp[0, t].item(), rel=1e-12)


# ---------------------------------------------------------------------------------------------------- KL (F3)


def expected_gradients(kind: str, logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """E_{y ~ pi}[grad_theta kl_estimate(log pi(y), log ref(y))], exactly over the vocabulary (the sampling
    distribution is not differentiated: the samples are data, as in the loss)."""
    theta = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)
    ref = torch.log_softmax(ref_logits, -1)
    weights = logp.detach().exp()
    (weights * F.kl_estimate(logp, ref, kind)).sum().backward()
    return theta.grad


def test_kl_loss_estimators_expected_gradients():
    logits = torch.tensor([1.0, -0.5, 0.3, 0.0, -1.0], dtype=D)
    ref_logits = torch.tensor([-1.0, 1.0, 0.5, -0.5, 0.0], dtype=D)

    def grad_of(fn):
        theta = logits.clone().requires_grad_(True)
        fn(torch.log_softmax(theta, -1), torch.log_softmax(ref_logits, -1)).backward()
        return theta.grad

    reverse = grad_of(lambda lp, lr: (lp.exp() * (lp - lr)).sum())  # KL(pi || ref)
    forward = grad_of(lambda lp, lr: (lr.exp() * (lr - lp)).sum())  # KL(ref || pi)
    assert reverse.abs().max() > 0.1 and (reverse - forward).abs().max() > 0.05
    torch.testing.assert_close(expected_gradients("k1", logits, ref_logits), torch.zeros(5, dtype=D), atol=1e-15,
                               rtol=0)
    torch.testing.assert_close(expected_gradients("k2", logits, ref_logits), reverse, atol=1e-12, rtol=0)
    torch.testing.assert_close(expected_gradients("k3", logits, ref_logits), forward, atol=1e-12, rtol=0)


def test_k1_is_refused_as_a_kl_loss_and_k2_k3_are_accepted():
    kl = ["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1"]
    with pytest.raises(ConfigError, match=r"kl_loss_type=k1 is not allowed .* zero expected gradient.* use k2 .* k3"):
        load_config([*kl, "algorithm.kl_loss_type=k1"])
    for kind in ("k2", "k3"):
        assert load_config([*kl, f"algorithm.kl_loss_type={kind}"]).algorithm.kl_loss_type == kind
