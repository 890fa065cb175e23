"""Dual-clip PPO (`algorithm.dual_clip_c`, Ye et al. 2020; verl's clip_ratio_c, slime's --eps-clip-c).

Per token, with `r = exp(clamp(logp - old_logp, -20, 20))`:
`loss = min(max(-A r, -A clip(r, 1 - eps_clip, 1 + eps_clip_high)), -A c)` where `A < 0`, the PPO-Clip loss where
`A >= 0`. Tested against that formula written out token by token in Python (values, and gradients by central
differences of it), through `compute_loss` and the registry's hooks of every algorithm that reads it.
"""

from __future__ import annotations

import math

import pytest
import torch

from relax.algorithms import LossBatch, compute_loss, get
from relax.algorithms import functional as F
from relax.algorithms.base import range_of
from relax.algorithms.loss import PG_CLIPFRAC, PG_LOSS
from relax.config import ConfigError, load_config
from relax.metrics import PG_CLIPFRAC_LOWER

D = torch.float64
EPS, EPS_HIGH, C = 0.2, 0.28, 3.0
# the algorithms whose policy loss is the PPO-Clip surrogate (with GSPO's sequence ratio, M2PO's solved bounds) and
# the ones that reject the option
PPO_CLIP = ["grpo", "ppo", "reinforce_pp", "reinforce_pp_baseline", "opd", "gspo", "m2po"]
TOKEN_PPO_CLIP = ["grpo", "ppo", "reinforce_pp", "reinforce_pp_baseline", "opd"]  # the shared token-level hook
REJECTING = ["rloo", "cispo", "sapo"]

# (log-ratio, advantage): A < 0 with ratios below the clip range, inside it, above it but under c, far above c and
# beyond the log-ratio clamp; A > 0 below, inside and far above; A = 0
CASES = [
    (math.log(0.5), -1.5),  # below 1 - eps: the clipped term wins, loss 0.8 |A|
    (math.log(0.95), -0.7),  # inside: -A r
    (math.log(1.1), -2.0),  # inside
    (math.log(2.0), -1.0),  # above 1 + eps_high, under c: the unclipped -A r (PPO-Clip does not bound it)
    (math.log(2.9), -0.3),  # just under c
    (math.log(3.5), -1.2),  # above c: capped at c |A|
    (10.0, -0.5),  # e^10: capped
    (25.0, -2.0),  # beyond the clamp (e^20): capped
    (math.log(0.5), 1.0),  # A > 0, below: -A r
    (math.log(1.05), 0.4),  # A > 0, inside
    (math.log(1.5), 2.0),  # A > 0, above 1 + eps_high: clipped, -A (1 + eps_high)
    (10.0, 0.8),  # A > 0, far above: clipped
    (math.log(3.5), 0.0),  # A = 0
]


def token_loss(log_ratio: float, a: float, c: float | None, lo: float = 1 - EPS, hi: float = 1 + EPS_HIGH) -> float:
    """The formula for one token, in Python floats."""
    r = math.exp(min(max(log_ratio, -20.0), 20.0))
    loss = max(-a * r, -a * min(max(r, lo), hi))
    if c is not None and a < 0:
        loss = min(loss, -a * c)
    return loss


def token_grad(log_ratio: float, a: float, c: float | None, lo: float = 1 - EPS, hi: float = 1 + EPS_HIGH) -> float:
    """d token_loss / d logp by central differences (every case is away from a kink)."""
    h = 1e-6
    return (token_loss(log_ratio + h, a, c, lo, hi) - token_loss(log_ratio - h, a, c, lo, hi)) / (2 * h)


def batch_of(cases, mask=None) -> LossBatch:
    log_ratio = torch.tensor([[d for d, _ in cases]], dtype=D)
    old = torch.full_like(log_ratio, -0.5)
    return LossBatch(logp=(old + log_ratio).requires_grad_(), old_logp=old,
                     advantages=torch.tensor([[a for _, a in cases]], dtype=D),
                     mask=torch.ones_like(log_ratio) if mask is None else mask)


def cfg_for(name, **kw):
    if name != "m2po":
        kw = {"eps_clip": EPS, "eps_clip_high": EPS_HIGH, **kw}
    return get(name).config_cls(**kw)


# ---- the formula, per token


@pytest.mark.parametrize("name", TOKEN_PPO_CLIP)
def test_loss_and_gradient_match_the_formula_token_by_token(name):
    b = batch_of(CASES)
    n = len(CASES)
    loss, metrics = compute_loss(cfg_for(name, dual_clip_c=C), b, per_token=True, denominator=n)
    loss.backward()
    want = [token_loss(d, a, C) for d, a in CASES]
    assert loss.item() == pytest.approx(sum(want) / n, rel=1e-12)
    assert b.logp.grad[0].tolist() == pytest.approx([token_grad(d, a, C) / n for d, a in CASES], rel=1e-6, abs=1e-9)
    # the cases' own expectations, so that the formula above is the one meant
    capped = [a < 0 and math.exp(min(d, 20.0)) > C for d, a in CASES]
    assert capped == [False] * 5 + [True] * 3 + [False] * 5
    for (_, a), w, cut, g in zip(CASES, want, capped, b.logp.grad[0].tolist(), strict=True):
        if cut:
            assert w == pytest.approx(-a * C) and g == 0.0  # capped: a constant, no gradient
    assert metrics[PG_CLIPFRAC_LOWER].item() == pytest.approx(3 / n)


@pytest.mark.parametrize("name", TOKEN_PPO_CLIP)
def test_positive_and_zero_advantages_are_unchanged(name):
    b_on, b_off = batch_of(CASES), batch_of(CASES)
    pg_on = get(name).policy_loss(cfg_for(name, dual_clip_c=C), b_on.logp, b_on.old_logp, b_on.advantages,
                                  b_on.mask).loss
    pg_off = get(name).policy_loss(cfg_for(name), b_off.logp, b_off.old_logp, b_off.advantages, b_off.mask).loss
    keep = b_on.advantages >= 0
    assert torch.equal(pg_on[keep], pg_off[keep])
    (pg_on * keep).sum().backward()
    (pg_off * keep).sum().backward()
    assert torch.equal(b_on.logp.grad, b_off.logp.grad)


def test_a_cap_below_the_clip_range_still_follows_the_formula():
    # c in (1, 1 + eps_high): allowed (c > 1), and the cap binds inside the clip range, as the formula says
    cases = [(math.log(1.05), -1.0), (math.log(1.2), -1.0), (math.log(1.5), -1.0), (math.log(0.5), -1.0)]
    b = batch_of(cases)
    loss, metrics = compute_loss(cfg_for("grpo", dual_clip_c=1.1), b, per_token=True, denominator=4)
    loss.backward()
    assert loss.item() == pytest.approx(sum(token_loss(d, a, 1.1) for d, a in cases) / 4, rel=1e-12)
    assert b.logp.grad[0].tolist() == pytest.approx([token_grad(d, a, 1.1) / 4 for d, a in cases], abs=1e-9)
    assert metrics[PG_CLIPFRAC_LOWER].item() == pytest.approx(2 / 4)


def test_functional_dual_clip_against_a_loop_on_random_tokens():
    g = torch.Generator().manual_seed(0)
    d = torch.randn(7, 9, generator=g, dtype=D) * 2
    a = torch.randn(7, 9, generator=g, dtype=D)
    logp = d.clone().requires_grad_()
    pg, clipped = F.ppo_clip_loss(logp, torch.zeros_like(d), a, EPS, EPS_HIGH)
    loss, cut = F.dual_clip(pg, a, C)
    loss.sum().backward()
    for i in range(7):
        for j in range(9):
            dij, aij = d[i, j].item(), a[i, j].item()
            assert loss[i, j].item() == pytest.approx(token_loss(dij, aij, C), rel=1e-12, abs=1e-15)
            assert bool(cut[i, j]) == (aij < 0 and math.exp(dij) > C)
            assert logp.grad[i, j].item() == pytest.approx(token_grad(dij, aij, C), rel=1e-6, abs=1e-9)
    assert cut.any() and not (cut & clipped).any()  # a capped token is not one PPO-Clip clipped


# ---- None: today's loss exactly


@pytest.mark.parametrize("name", PPO_CLIP)
def test_off_is_exactly_the_ppo_clip_loss_and_logs_nothing(name):
    b_default, b_none = batch_of(CASES), batch_of(CASES)
    default_cfg = cfg_for(name)
    assert default_cfg.dual_clip_c is None  # off by default
    loss, metrics = compute_loss(default_cfg, b_default, per_token=True, denominator=len(CASES))
    assert PG_CLIPFRAC_LOWER not in metrics
    out = get(name).policy_loss(default_cfg, b_none.logp, b_none.old_logp, b_none.advantages, b_none.mask,
                                **({"stats": get(name).step_statistics(default_cfg, b_none.logp.detach(),
                                                                       b_none.old_logp, b_none.advantages,
                                                                       b_none.mask)} if name == "m2po" else {}))
    assert out.dual_clipped is None
    if name in TOKEN_PPO_CLIP:  # the PPO-Clip loss of before the option, the same tensors bit for bit
        pg, clipped = F.ppo_clip_loss(b_none.logp, b_none.old_logp, b_none.advantages, EPS, EPS_HIGH)
        assert torch.equal(out.loss, pg) and torch.equal(out.clipped, clipped)
        assert loss.item() == pytest.approx(sum(token_loss(d, a, None) for d, a in CASES) / len(CASES), rel=1e-12)


@pytest.mark.parametrize("name", PPO_CLIP)
def test_a_cap_that_never_binds_changes_no_value_and_no_gradient(name):
    # the control that the option touches only the tokens it caps: c so large nothing reaches it
    b_off, b_big = batch_of(CASES), batch_of(CASES)
    off, m_off = compute_loss(cfg_for(name), b_off, per_token=True, denominator=len(CASES))
    big, m_big = compute_loss(cfg_for(name, dual_clip_c=1e12), b_big, per_token=True, denominator=len(CASES))
    off.backward()
    big.backward()
    assert torch.equal(off, big) and torch.equal(b_off.logp.grad, b_big.logp.grad)
    assert m_big.pop(PG_CLIPFRAC_LOWER).item() == 0.0
    assert m_big.keys() == m_off.keys() and all(torch.equal(m_big[k], m_off[k]) for k in m_off)


# ---- the metric


def test_metric_is_a_share_of_the_steps_valid_tokens_and_adds_over_micro_batches():
    g = torch.Generator().manual_seed(1)
    B, T = 6, 5
    d = torch.randn(B, T, generator=g, dtype=D) * 1.5
    a = torch.randn(B, T, generator=g, dtype=D)
    mask = (torch.rand(B, T, generator=g) > 0.3).to(D)
    mask[2] = 0.0
    d[1, 0], a[1, 0], mask[1, 0] = 5.0, -1.0, 0.0  # a masked token that would bind: not counted
    d[3, 1], a[3, 1] = float("nan"), float("inf")  # garbage under the mask never reaches a result
    mask[3, 1] = 0.0
    old = torch.zeros(B, T, dtype=D)
    cfg = cfg_for("grpo", dual_clip_c=2.0)
    tokens = float(mask.sum())
    want = sum(1 for i in range(B) for j in range(T)
               if mask[i, j] and a[i, j] < 0 and math.exp(d[i, j].item()) > 2.0) / tokens
    assert want > 0
    for per_token in (True, False):
        denominator = tokens if per_token else float((mask.sum(-1) > 0).sum())
        whole = compute_loss(cfg, LossBatch(logp=d.clone().requires_grad_(), old_logp=old, advantages=a, mask=mask),
                             per_token=per_token, denominator=denominator, num_tokens=tokens)
        assert whole[1][PG_CLIPFRAC_LOWER].item() == pytest.approx(want)  # a token share whatever the reduction
        assert torch.isfinite(whole[0])
        parts = [compute_loss(cfg, LossBatch(logp=d[r].clone().requires_grad_(), old_logp=old[r], advantages=a[r],
                                             mask=mask[r]), per_token=per_token, denominator=denominator,
                              num_tokens=tokens) for r in (slice(0, 2), slice(2, 6))]
        for key in (PG_CLIPFRAC_LOWER, PG_CLIPFRAC, PG_LOSS):
            assert sum(p[1][key].item() for p in parts) == pytest.approx(whole[1][key].item(), rel=1e-12)


def test_the_shared_trainer_step_reports_it():
    """`relax.train.trainer.StepLoss`: the loss core both backends run (TorchPolicy and MegatronPolicy call it per
    micro-batch, then all-reduce its sums over data-parallel ranks by name)."""
    from relax.batch import TrainBatch
    from relax.train.trainer import StepLoss

    n, T = 4, 3
    d = torch.tensor([[0.0, 2.0, -1.0], [1.5, 0.1, 0.0], [0.0, 0.0, 3.0], [-2.0, 2.5, 0.0]])
    a = torch.tensor([[-1.0, -1.0, -1.0], [-0.5, 1.0, 1.0], [1.0, 1.0, -2.0], [-1.0, 1.0, -1.0]])
    mask = torch.ones(n, T, dtype=torch.long)
    batch = TrainBatch(prompt_ids=torch.full((n, 2), 5), prompt_mask=torch.ones(n, 2, dtype=torch.long),
                       response_ids=torch.full((n, T), 6), response_mask=mask, rollout_logp=torch.zeros(n, T),
                       finish_reason=["stop"] * n, advantages=a, old_logp=torch.zeros(n, T))
    # binds where A < 0 and e^d > 2: d = 2.0 (row 0), 1.5 (row 1, e^1.5 = 4.5), 3.0 (row 2)
    for c, want in ((2.0, 3 / 12), (None, None)):
        step = StepLoss(batch, cfg_for("grpo", dual_clip_c=c), per_token=True, report_entropy=False,
                        rollout_mismatch=False)
        for rows in (torch.tensor([0, 1]), torch.tensor([2, 3])):
            step.micro_batch(batch, rows, d[rows].clone().requires_grad_(), T, device=torch.device("cpu"))
        got = step.metrics()
        assert got.get(PG_CLIPFRAC_LOWER) == (None if want is None else pytest.approx(want))


# ---- GSPO's sequence ratio, M2PO's bounds


def test_gspo_caps_every_negative_token_of_a_response_whose_sequence_ratio_exceeds_c():
    # row 0: s = exp(mean(1.0, 1.4)) = e^1.2 = 3.32 > c; row 1: s = e^0.5 = 1.65 < c
    logp = torch.tensor([[1.0, 1.4], [0.5, 0.5]], dtype=D, requires_grad=True)
    a = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]], dtype=D)
    out = get("gspo").policy_loss(cfg_for("gspo", dual_clip_c=C), logp, torch.zeros_like(a), a, torch.ones_like(a))
    s0, s1 = math.exp(1.2), math.exp(0.5)
    want = [min(-x * s0, -x * C) for x in (-1.0, -2.0)] + [-x * s1 for x in (-1.0, -1.0)]
    assert out.loss.flatten().tolist() == pytest.approx(want)
    assert out.dual_clipped.tolist() == [[True, True], [False, False]]
    out.loss.sum().backward()
    assert logp.grad[0].tolist() == [0.0, 0.0]  # the capped response gets no gradient
    assert logp.grad[1].tolist() == pytest.approx([s1 * 2 / 2] * 2)  # d/dlogp_t of -A s = -A s / T summed over A


def test_m2po_caps_independently_of_its_solved_bounds():
    b = batch_of(CASES)
    cfg = cfg_for("m2po", dual_clip_c=C, kl2_budget=1e-4)
    stats = get("m2po").step_statistics(cfg, b.logp.detach(), b.old_logp, b.advantages, b.mask)
    lo, hi = 1 - stats["eps_low"], 1 + stats["eps_high"]
    assert math.isfinite(hi)  # the budget binds: M2PO clips
    out = get("m2po").policy_loss(cfg, b.logp, b.old_logp, b.advantages, b.mask, stats=stats)
    assert out.loss[0].tolist() == pytest.approx([token_loss(d, a, C, lo, hi) for d, a in CASES], rel=1e-12)
    assert out.dual_clipped[0].tolist() == [a < 0 and math.exp(min(d, 20.0)) > C for d, a in CASES]
    assert set(out.metrics) == {"train/ppo_kl_m2_before", "train/ppo_kl_m2_after"}


# ---- validation


@pytest.mark.parametrize("value", ["1.0", "0.5", "inf", "nan", "-3", "1"])
def test_values_that_are_not_a_finite_number_above_one_are_rejected_naming_the_field(value):
    with pytest.raises(ConfigError) as err:
        load_config([f"algorithm.dual_clip_c={value}"])
    found = [v.message for v in err.value.violations if "algorithm.dual_clip_c" in v.fields]
    assert len(found) == 1 and found[0].startswith(f"algorithm.dual_clip_c={float(value)} must be a finite number > 1")


@pytest.mark.parametrize("name", ["grpo", "gspo", "m2po", "reinforce_pp_baseline"])
def test_three_is_accepted(name):
    assert load_config([f"algorithm={name}", "algorithm.dual_clip_c=3.0"]).algorithm.dual_clip_c == 3.0


def test_the_range_is_declared_on_the_field_once_for_every_algorithm():
    allowed = range_of(get("grpo").config_cls, "dual_clip_c")
    assert allowed.admits(None) and allowed.admits(1.0001) and allowed.admits(3.0)
    for value in (1.0, 0.5, -3.0, math.inf, -math.inf, math.nan):
        assert not allowed.admits(value)
    for name in PPO_CLIP + REJECTING:
        assert range_of(get(name).config_cls, "dual_clip_c") == allowed
        assert get(name).config_cls().dual_clip_c is None


@pytest.mark.parametrize("name", REJECTING)
def test_losses_that_are_not_the_ppo_clip_surrogate_reject_it(name):
    assert "dual_clip_c" in get(name).ignores and "PPO-Clip" in get(name).ignores["dual_clip_c"]
    with pytest.raises(ConfigError) as err:
        load_config([f"algorithm={name}", "algorithm.dual_clip_c=3.0"])
    found = [v.message for v in err.value.violations if "algorithm.dual_clip_c" in v.fields]
    assert found and "has no effect" in found[0], str(err.value)


@pytest.mark.parametrize("name", PPO_CLIP)
def test_every_ppo_clip_algorithm_reads_it(name):
    assert "dual_clip_c" not in get(name).ignores
