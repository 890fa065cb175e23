"""Rollout correction (relax.algorithms.rollout_correction) against formulas written out here, token by token:
truncated importance sampling at the token, sequence and geometric-mean levels, rejection at the same levels, their
product, the loss they weight (gradients through the trainer's log-probs only), the mismatch metrics, and the
config rules."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from relax.algorithms.base import LossBatch
from relax.algorithms.grpo import GRPOConfig
from relax.algorithms.loss import compute_loss
from relax.algorithms.rollout_correction import correction_weights, is_weights, mismatch_metrics, rejection_mask
from relax.config import ConfigError, load_config
from relax.metrics import (
    MISMATCH_K1,
    MISMATCH_K3,
    MISMATCH_LOG_PPL_DIFF,
    MISMATCH_RATIO_QUANTILES,
    RS_MASKED_SEQ_FRAC,
    RS_MASKED_TOKEN_FRAC,
    TIS_TRUNCATED_FRAC,
)

# two responses; the second is an episode whose observation (positions 2-3) is out of the loss mask
OLD = torch.tensor([[-1.0, -0.5, -2.0, -0.1, -3.0], [-0.2, -1.5, -9.0, -9.0, -0.7]], dtype=torch.float64)
ROLLOUT = torch.tensor([[-1.5, -0.4, -1.0, -0.3, -3.0], [-0.9, -1.1, 5.0, 5.0, -0.1]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 1]])


def kept(row: int) -> list[int]:
    return [t for t in range(MASK.shape[1]) if MASK[row, t]]


def ratio(row: int, t: int) -> float:
    return math.exp(float(OLD[row, t]) - float(ROLLOUT[row, t]))


def level_ratio(row: int, t: int, level: str) -> float:
    if level == "token":
        return ratio(row, t)
    logs = [math.log(ratio(row, u)) for u in kept(row)]
    return math.exp(sum(logs) if level == "sequence" else sum(logs) / len(logs))


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("clip", [1.2, 5.0])
def test_importance_weights_by_hand(level, clip):
    w = is_weights(OLD, ROLLOUT, MASK, level, clip)
    for row in range(2):
        for t in range(MASK.shape[1]):
            expected = min(level_ratio(row, t, level), clip) if MASK[row, t] else 0.0
            assert float(w[row, t]) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("bounds", [(0.5, 2.0), (0.9, 1.1), (0.1, 10.0)])
def test_rejection_mask_by_hand(level, bounds):
    low, high = bounds
    m = rejection_mask(OLD, ROLLOUT, MASK, level, low, high)
    for row in range(2):
        for t in range(MASK.shape[1]):
            expected = float(bool(MASK[row, t]) and low <= level_ratio(row, t, level) <= high)
            assert float(m[row, t]) == expected


def test_the_corrections_multiply_and_nothing_is_asked_without_them():
    cfg = GRPOConfig(use_tis=True, tis_level="sequence", tis_clip=3.0, rollout_mask="token")
    expected = is_weights(OLD, ROLLOUT, MASK, "sequence", 3.0) * rejection_mask(OLD, ROLLOUT, MASK, "token", 0.5, 2.0)
    assert torch.equal(correction_weights(cfg, OLD, ROLLOUT, MASK), expected)
    assert correction_weights(GRPOConfig(), OLD, ROLLOUT, MASK) is None


def test_a_long_responses_product_neither_overflows_nor_underflows():
    old, rollout, mask = torch.zeros(2, 400), torch.full((2, 400), -1.0), torch.ones(2, 400)
    rollout[1] = 1.0  # ratios e and 1/e on every token: products e^400, e^-400
    w = is_weights(old, rollout, mask, "sequence", 2.0)
    assert torch.isfinite(w).all() and float(w[0, 0]) == 2.0 and 0 <= float(w[1, 0]) < 1e-8
    m = rejection_mask(old, rollout, mask, "sequence", 0.5, 2.0)
    assert float(m.sum()) == 0.0
    assert float(is_weights(old, rollout, mask, "geometric", 10.0)[0, 0]) == pytest.approx(math.e)


@pytest.mark.parametrize("per_token", [True, False])
def test_the_loss_weights_each_tokens_policy_loss_and_its_gradient_flows_through_the_trainer_only(per_token):
    """GRPO's per-token loss `-A * exp(logp - old)` (no clipping within the ratios here) times the weight, reduced
    by hand; the gradient reaches logp alone."""
    cfg = GRPOConfig(use_tis=True, tis_level="geometric", tis_clip=1.5, rollout_mask="token", rollout_mask_low=0.6,
                     rollout_mask_high=1.9, eps_clip=10.0)
    logp = (OLD + 0.01).clone().requires_grad_()
    old = OLD.clone()
    adv = torch.tensor([[1.0, -2.0, 0.5, 1.0, 3.0], [0.3, 0.3, 0.3, 0.3, 0.3]], dtype=torch.float64)
    batch = LossBatch(logp=logp, old_logp=old, advantages=adv, mask=MASK.double(), rollout_logp=ROLLOUT)
    denominator = float(MASK.sum()) if per_token else 2.0
    loss, _ = compute_loss(cfg, batch, per_token=per_token, denominator=denominator)
    loss.backward()
    expected, grads = 0.0, torch.zeros_like(OLD)
    for row in range(2):
        terms = []
        for t in kept(row):
            w = min(level_ratio(row, t, "geometric"), 1.5) * float(0.6 <= ratio(row, t) <= 1.9)
            r = math.exp(0.01)
            terms.append(-float(adv[row, t]) * r * w)
            grads[row, t] = -float(adv[row, t]) * r * w / (denominator if per_token else 2.0 * len(kept(row)))
        expected += sum(terms) / (denominator if per_token else 2.0 * len(terms))
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-9)
    assert torch.allclose(logp.grad, grads, rtol=1e-9)  # the weights are constants of the gradient
    leaf = OLD.clone().requires_grad_(), ROLLOUT.clone().requires_grad_()
    assert not correction_weights(cfg, *leaf, MASK).requires_grad


def test_mismatch_metrics_by_hand():
    cfg = GRPOConfig(use_tis=True, tis_level="sequence", tis_clip=1.5, rollout_mask="geometric",
                     rollout_mask_low=0.9, rollout_mask_high=1.1)
    out = mismatch_metrics(cfg, OLD, ROLLOUT, MASK)
    pairs = [(row, t) for row in range(2) for t in kept(row)]
    diffs = [float(OLD[r, t]) - float(ROLLOUT[r, t]) for r, t in pairs]
    assert out[MISMATCH_K1] == pytest.approx(sum(-d for d in diffs) / len(diffs))
    assert out[MISMATCH_K3] == pytest.approx(sum(math.exp(d) - 1 - d for d in diffs) / len(diffs))
    ppl = [sum(float(ROLLOUT[r, t]) - float(OLD[r, t]) for t in kept(r)) / len(kept(r)) for r in range(2)]
    assert out[MISMATCH_LOG_PPL_DIFF] == pytest.approx(sum(ppl) / 2)
    quantiles = np.quantile([math.exp(d) for d in diffs], [0.05, 0.5, 0.95])
    assert [out[k] for k in MISMATCH_RATIO_QUANTILES] == pytest.approx(list(quantiles))
    seq = [level_ratio(r, kept(r)[0], "sequence") for r in range(2)]
    assert out[TIS_TRUNCATED_FRAC] == pytest.approx(sum(s > 1.5 for s in seq) / 2)
    geo = [level_ratio(r, kept(r)[0], "geometric") for r in range(2)]
    masked_rows = [not 0.9 <= g <= 1.1 for g in geo]
    assert out[RS_MASKED_SEQ_FRAC] == pytest.approx(sum(masked_rows) / 2)
    assert out[RS_MASKED_TOKEN_FRAC] == pytest.approx(sum(len(kept(r)) for r in range(2) if masked_rows[r])
                                                      / len(pairs))
    plain = mismatch_metrics(GRPOConfig(), OLD, ROLLOUT, MASK)  # whatever is chosen: the mismatch itself
    assert plain[MISMATCH_K3] == out[MISMATCH_K3] and TIS_TRUNCATED_FRAC not in plain


def test_split_into_micro_batches_changes_nothing():
    cfg = GRPOConfig(use_tis=True, tis_level="sequence", rollout_mask="token")
    logp = OLD + 0.02
    adv = torch.ones_like(OLD)
    whole, _ = compute_loss(cfg, LossBatch(logp=logp, old_logp=OLD, advantages=adv, mask=MASK.double(),
                                           rollout_logp=ROLLOUT), per_token=True, denominator=float(MASK.sum()))
    parts = sum(compute_loss(cfg, LossBatch(logp=logp[i:i + 1], old_logp=OLD[i:i + 1], advantages=adv[i:i + 1],
                                            mask=MASK[i:i + 1].double(), rollout_logp=ROLLOUT[i:i + 1]),
                             per_token=True, denominator=float(MASK.sum()))[0] for i in range(2))
    assert float(parts) == pytest.approx(float(whole), rel=1e-12)


@pytest.mark.parametrize("overrides, key", [
    (["algorithm.tis_level=sequence"], "algorithm.tis_level"),
    (["algorithm.rollout_mask_low=0.8"], "algorithm.rollout_mask_low"),
    (["algorithm.rollout_mask=token", "algorithm.rollout_mask_low=2.0", "algorithm.rollout_mask_high=1.5"],
     "algorithm.rollout_mask_low"),
    (["algorithm.rollout_mask=token", "algorithm.rollout_mask_low=1.2"], "algorithm.rollout_mask_low"),
    (["algorithm.rollout_mask=token", "algorithm.rollout_mask_low=-1"], "algorithm.rollout_mask_low"),
    # low < high, not only low <= 1 <= high (docs/algorithms.md): [1, 1] would keep exact agreement only
    (["algorithm.rollout_mask=token", "algorithm.rollout_mask_low=1.0", "algorithm.rollout_mask_high=1.0"],
     "algorithm.rollout_mask_high"),
    (["algorithm.rollout_mask=geometric", "algorithm.use_rollout_logprobs=true"], "algorithm.rollout_mask"),
    (["algorithm.rollout_mask=tokens"], "algorithm.rollout_mask"),
])
def test_bad_corrections_are_rejected_before_start(overrides, key):
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    assert any(key in v.fields for v in info.value.violations), info.value


def test_bounds_touching_one_on_one_side_are_accepted():
    for low, high in ((1.0, 1.5), (0.5, 1.0)):
        cfg = load_config(["algorithm.rollout_mask=token", f"algorithm.rollout_mask_low={low}",
                           f"algorithm.rollout_mask_high={high}"]).algorithm
        assert (cfg.rollout_mask_low, cfg.rollout_mask_high) == (low, high)


def test_icepop_is_token_importance_sampling_with_token_rejection():
    cfg = load_config(["algorithm.use_tis=true", "algorithm.rollout_mask=token"]).algorithm
    assert (cfg.tis_level, cfg.rollout_mask_low, cfg.rollout_mask_high) == ("token", 0.5, 2.0)
    w = correction_weights(cfg, OLD, ROLLOUT, MASK)
    for row in range(2):
        for t in kept(row):
            r = ratio(row, t)
            assert float(w[row, t]) == pytest.approx(r if 0.5 <= r <= 2.0 else 0.0)
    assert replace(cfg, rollout_mask="none").rollout_mask == "none"


@pytest.mark.slow
@pytest.mark.parametrize("mode", [["train.mode=sync"], ["train.mode=fully_async", "train.max_staleness=1"]])
def test_every_correction_runs_in_the_loop_with_its_metrics(mode, in_process, small_run, tmp_path):
    from relax.runner.train import run

    cfg = load_config(small_run("algorithm.use_tis=true", "algorithm.tis_level=sequence",
                                "algorithm.rollout_mask=geometric", "algorithm.rollout_mask_low=0.9",
                                "algorithm.rollout_mask_high=1.1", *mode, steps=2))
    result = run(cfg, output_dir=tmp_path / "out")
    for _, m in result.history:
        assert m[MISMATCH_K3] >= 0 and 0 <= m[RS_MASKED_TOKEN_FRAC] <= 1
        assert 0 <= m[TIS_TRUNCATED_FRAC] <= 1 and 0 <= m[RS_MASKED_SEQ_FRAC] <= 1
        assert all(math.isfinite(m[k]) for k in (MISMATCH_K1, MISMATCH_LOG_PPL_DIFF, *MISMATCH_RATIO_QUANTILES))
        assert math.isfinite(m["train/loss"])
