"""algorithm.loss_agg_mode (verl's four loss aggregations) against per-sequence loops written out by hand.

The reference of each mode is a Python loop over the responses and their tokens, each token's PPO-Clip term written
from its formula (no `relax.algorithms.functional`), summed as the mode says: token-mean over the step's valid tokens,
seq-mean-token-mean / seq-mean-token-sum over the responses that have a valid token, seq-mean-token-sum-norm that
divided by the constant `loss_scale_factor`. Its gradient is autograd through that loop. `compute_loss` must give
the same loss and gradient for every split of the step into micro-batches (the trainer's denominators of the whole
step), and a trainer must give the same gradients for every micro-batch size. Megatron against the torch backend:
tests/megatron/test_megatron_cpu.py (`agg_dp2`).
"""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from relax.algorithms import GRPOConfig, LossBatch, PPOConfig, compute_loss, compute_value_loss
from relax.algorithms.base import LOSS_AGG_MODES
from relax.algorithms.loss import KL_LOSS, LOSS, PG_LOSS
from relax.config import compose, resolve, validate
from relax.config.schema import ModelConfig, TrainConfig
from relax.train.torch_policy import TorchPolicy
from relax.train.trainer import step_denominators

D = torch.float64
EPS_LO, EPS_HI, C = 0.2, 0.28, 7.0
KL_COEF, ENT_COEF = 0.3, 0.05


def batch(seed: int = 0, B: int = 7, T: int = 6) -> LossBatch:
    """Responses of different lengths (one empty), NaN on masked tokens, ratios inside and outside the clip range."""
    g = torch.Generator().manual_seed(seed)
    lengths = [6, 1, 0, 4, 2, 5, 3][:B]
    mask = torch.zeros(B, T, dtype=D)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1.0
    old = -torch.rand(B, T, generator=g, dtype=D) * 2
    logp = old + 0.4 * torch.randn(B, T, generator=g, dtype=D)
    adv = torch.randn(B, 1, generator=g, dtype=D).expand(B, T).clone()
    ref = old + 0.3 * torch.randn(B, T, generator=g, dtype=D)
    ent = torch.rand(B, T, generator=g, dtype=D)
    for x in (logp, old, adv, ref, ent):
        x[mask == 0] = float("nan")  # whatever masked tokens hold never reaches the loss
    return LossBatch(logp=logp.requires_grad_(), old_logp=old, advantages=adv, mask=mask, ref_logp=ref, entropy=ent)


def by_hand(mode: str, lb: LossBatch) -> torch.Tensor:
    """The loss of the whole step, response by response and token by token."""
    seqs, tokens = [], 0
    for b in range(lb.mask.shape[0]):
        terms = []
        for t in range(lb.mask.shape[1]):
            if lb.mask[b, t] == 0:
                continue
            lp, old, a = lb.logp[b, t], lb.old_logp[b, t], lb.advantages[b, t]
            r = torch.exp(lp - old)
            pg = torch.maximum(-r * a, -torch.clamp(r, 1 - EPS_LO, 1 + EPS_HI) * a)
            x = lp - lb.ref_logp[b, t]
            kl = torch.exp(-x) - 1 + x  # k3, inside the [-10, 10] clamp for these values
            terms.append(pg + KL_COEF * kl - ENT_COEF * lb.entropy[b, t])
        tokens += len(terms)
        if terms:
            seqs.append((sum(terms), len(terms)))
    if mode == "token-mean":
        return sum(s for s, _ in seqs) / tokens
    if mode == "seq-mean-token-mean":
        return sum(s / n for s, n in seqs) / len(seqs)
    if mode == "seq-mean-token-sum":
        return sum(s for s, _ in seqs) / len(seqs)
    assert mode == "seq-mean-token-sum-norm"
    return sum(s / C for s, _ in seqs) / len(seqs)


def cfg_of(mode: str) -> GRPOConfig:
    return GRPOConfig(eps_clip=EPS_LO, eps_clip_high=EPS_HI, use_kl_loss=True, kl_loss_coef=KL_COEF,
                      entropy_coef=ENT_COEF, loss_agg_mode=mode,
                      loss_scale_factor=C if mode == "seq-mean-token-sum-norm" else None)


def split_loss(mode: str, lb: LossBatch, splits: list[list[int]]) -> tuple[torch.Tensor, dict[str, float]]:
    """compute_loss over the micro-batches `splits` (row lists), the step's denominators as the trainer takes them."""
    per_token = mode == "token-mean"
    denominator, num_tokens = step_denominators(lb.mask, per_token)
    total, metrics = torch.zeros((), dtype=D), {}
    for rows in splits:
        part = LossBatch(logp=lb.logp[rows], old_logp=lb.old_logp[rows], advantages=lb.advantages[rows],
                         mask=lb.mask[rows], ref_logp=lb.ref_logp[rows], entropy=lb.entropy[rows])
        loss, m = compute_loss(cfg_of(mode), part, per_token=per_token, denominator=denominator,
                               num_tokens=num_tokens)
        total = total + loss
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + float(v)
    return total, metrics


SPLITS = [[[0, 1, 2, 3, 4, 5, 6]], [[0], [1], [2], [3], [4], [5], [6]], [[6, 2, 0], [5, 1], [3, 4]],
          [[2], [0, 1, 3, 4, 5, 6]]]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_loss_and_gradient_equal_the_loop_by_hand_for_every_split(mode):
    lb = batch()
    expected = by_hand(mode, lb)
    (want,) = torch.autograd.grad(expected, lb.logp)
    assert math.isfinite(float(expected.detach()))
    for splits in SPLITS:
        loss, metrics = split_loss(mode, lb, splits)
        (grad,) = torch.autograd.grad(loss, lb.logp)
        assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-12), splits
        assert metrics[LOSS] == pytest.approx(float(expected.detach()), rel=1e-12)
        torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-15)
        assert bool(torch.isfinite(grad).all()) and bool((grad[lb.mask == 0] == 0).all())


def test_the_modes_differ_as_their_definitions_say():
    """On the same step: sum-norm is sum / C exactly; sum differs from both means (responses of unequal length)."""
    lb = batch()
    loss = {mode: float(split_loss(mode, lb, SPLITS[2])[0].detach()) for mode in LOSS_AGG_MODES}
    assert loss["seq-mean-token-sum-norm"] == pytest.approx(loss["seq-mean-token-sum"] / C, rel=1e-12)
    assert len({round(v, 9) for v in loss.values()}) == 4
    # pg_loss and kl_loss are reduced the same way as the loss
    _, m = split_loss("seq-mean-token-sum", lb, SPLITS[1])
    _, m_norm = split_loss("seq-mean-token-sum-norm", lb, SPLITS[1])
    for key in (PG_LOSS, KL_LOSS):
        assert m_norm[key] == pytest.approx(m[key] / C, rel=1e-12)


def test_auto_is_the_mode_calculate_per_token_loss_names():
    lb = batch()
    d_tok, n = step_denominators(lb.mask, True)
    d_seq, _ = step_denominators(lb.mask, False)
    for per_token, mode, d in ((True, "token-mean", d_tok), (False, "seq-mean-token-mean", d_seq)):
        auto, _ = compute_loss(cfg_of("auto"), lb, per_token=per_token, denominator=d, num_tokens=n)
        assert float(auto.detach()) == pytest.approx(float(by_hand(mode, lb).detach()), rel=1e-12)


def test_a_mode_that_disagrees_with_the_denominator_is_an_error():
    lb = batch()
    d, n = step_denominators(lb.mask, True)
    with pytest.raises(ValueError, match="seq-mean-token-sum needs train.calculate_per_token_loss=false"):
        compute_loss(cfg_of("seq-mean-token-sum"), lb, per_token=True, denominator=d, num_tokens=n)
    with pytest.raises(ValueError, match="needs algorithm.loss_scale_factor"):
        compute_loss(GRPOConfig(loss_agg_mode="seq-mean-token-sum-norm"), lb, per_token=False, denominator=6,
                     num_tokens=n)


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_critic_loss_by_hand(mode):
    g = torch.Generator().manual_seed(5)
    lb = batch()
    mask = lb.mask
    values = torch.randn(mask.shape, generator=g, dtype=D).requires_grad_()
    old_v = values.detach() + 0.3 * torch.randn(mask.shape, generator=g, dtype=D)
    ret = torch.randn(mask.shape, generator=g, dtype=D)
    cfg = PPOConfig(value_clip=0.2, loss_agg_mode=mode, loss_scale_factor=C if mode.endswith("norm") else None)
    d, n = step_denominators(mask, False)
    loss = sum(compute_value_loss(cfg, values[r], old_v[r], ret[r], mask[r], per_token=False, denominator=d,
                                  num_tokens=n)[0] for r in ([0, 3], [1, 2, 4, 5, 6]))
    seqs, v = [], values.detach()
    for b in range(mask.shape[0]):
        terms = [0.5 * max(float(v[b, t] - ret[b, t]) ** 2,
                           float(old_v[b, t] + max(-0.2, min(0.2, float(v[b, t] - old_v[b, t]))) - ret[b, t])
                           ** 2) for t in range(mask.shape[1]) if mask[b, t]]
        if terms:
            seqs.append(sum(terms) / (C if mode.endswith("norm") else 1.0))
    assert float(loss.detach()) == pytest.approx(sum(seqs) / len(seqs), rel=1e-12)


def backends_conftest():
    """tests/backends/conftest.py, under a name of its own (every test directory's conftest is `conftest`)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("backends_conftest",
                                                  Path(__file__).resolve().parents[1] / "backends" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MODEL = ModelConfig(name="tiny-test", source="config", dtype="float32", hidden_size=32, num_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                    max_position_embeddings=64)


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_torch_trainer_gradients_do_not_depend_on_the_micro_batch_size(mode):
    """TorchPolicy.accumulate_gradients (gradient accumulation over micro-batches, the step's denominators): the same
    gradients and metrics for 1, 3 and 8 rows per micro-batch; and -norm's gradients are the plain sum's / C."""
    base = backends_conftest().random_batch(8, P=5, T=4, seed=4)
    train = TrainConfig(lr=1e-3, clip_grad=0.0, num_rollout=10)
    grads, metrics = {}, {}
    for mbs in (1, 3, 8):
        p = TorchPolicy(MODEL, train, vocab_size=32, pad_token_id=0, seed=0, device="cpu", num_threads=1)
        old = p.compute_logprobs(base, micro_batch_size=8) - 0.05 * base.response_mask
        b = base.with_(old_logp=old, ref_logp=old + 0.1 * base.response_mask)
        metrics[mbs] = p.accumulate_gradients(b, cfg_of(mode), per_token=False, micro_batch_size=mbs)
        grads[mbs] = {n: w.grad.clone() for n, w in p.model.named_parameters() if w.grad is not None}
        if mbs == 8:
            p.model.zero_grad()
            p.accumulate_gradients(b, cfg_of("seq-mean-token-sum"), per_token=False, micro_batch_size=8)
            plain = {n: w.grad.clone() for n, w in p.model.named_parameters() if w.grad is not None}
    for mbs in (1, 3):
        for name, g in grads[8].items():
            torch.testing.assert_close(grads[mbs][name], g, rtol=1e-4, atol=1e-7)
        for k, v in metrics[8].items():
            assert metrics[mbs][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    scale = C if mode.endswith("norm") else 1.0
    for name, g in plain.items():
        torch.testing.assert_close(grads[8][name] * scale, g, rtol=1e-4, atol=1e-7)


def violations(*overrides: str) -> list[str]:
    return [v.message for v in validate(resolve(OmegaConf.to_object(compose(list(overrides)))))]


def test_config_rules_are_checked_before_start():
    assert violations("algorithm.loss_agg_mode=seq-mean-token-sum") == []
    assert violations("algorithm.loss_agg_mode=seq-mean-token-sum-norm", "algorithm.loss_scale_factor=64") == []
    assert violations("algorithm.loss_agg_mode=token-mean", "train.calculate_per_token_loss=true") == []
    (msg,) = violations("algorithm.loss_agg_mode=token-mean")
    assert "needs train.calculate_per_token_loss=true" in msg and "grpo's default" in msg
    (msg,) = violations("algorithm=cispo", "algorithm.loss_agg_mode=seq-mean-token-sum")
    assert "set train.calculate_per_token_loss=false too" in msg
    assert violations("algorithm=cispo", "algorithm.loss_agg_mode=seq-mean-token-sum",
                      "train.calculate_per_token_loss=false") == []
    (msg,) = violations("algorithm.loss_agg_mode=seq-mean-token-sum-norm")
    assert "needs algorithm.loss_scale_factor" in msg and "rollout.max_response_len=" in msg
    (msg,) = violations("algorithm.loss_scale_factor=64")
    assert "has no effect" in msg
    (msg,) = violations("algorithm.loss_agg_mode=seq-mean-token-sum", "algorithm.loss_scale_factor=64")
    assert "has no effect with algorithm.loss_agg_mode=seq-mean-token-sum" in msg
    (msg,) = violations("algorithm=rloo", "algorithm.loss_agg_mode=seq-mean-token-sum")
    assert "rloo needs token-mean" in msg
    (msg,) = violations("algorithm=reinforce_pp", "algorithm.loss_agg_mode=seq-mean-token-sum")
    assert "reinforce_pp needs seq-mean-token-mean" in msg
    (msg,) = violations("algorithm.loss_agg_mode=sum")
    assert "must be one of auto, token-mean" in msg


@pytest.mark.parametrize("overrides, shown", [
    ([], "loss_agg_mode=seq-mean-token-mean (auto)"),  # grpo: per response by default
    (["algorithm=rloo"], "loss_agg_mode=token-mean (auto)"),  # rloo: per token by default
    (["train.calculate_per_token_loss=true"], "loss_agg_mode=token-mean (auto)"),
    (["algorithm.loss_agg_mode=seq-mean-token-sum"], "loss_agg_mode=seq-mean-token-sum"),
    (["algorithm.loss_agg_mode=seq-mean-token-sum-norm", "algorithm.loss_scale_factor=64"],
     "loss_agg_mode=seq-mean-token-sum-norm (loss_scale_factor=64)"),
    (["algorithm=cispo", "algorithm.loss_agg_mode=seq-mean-token-sum", "train.calculate_per_token_loss=false"],
     "loss_agg_mode=seq-mean-token-sum"),
])
def test_the_run_summary_names_the_aggregation_the_loss_uses(overrides, shown):
    """The summary relax-train prints (dry run, start) names the loss aggregation by verl's name, the mode `reduce`
    applies (auto resolved through train.calculate_per_token_loss), once, on the train line; not the old
    per_token_loss flag, which no longer decides it alone."""
    from relax.config import load_config
    from relax.runner.summary import config_summary

    text = config_summary(load_config(overrides))
    (train,) = [line for line in text.splitlines() if line.startswith("train ")]
    assert f", {shown}, mode=" in train, train
    assert "per_token_loss" not in text and text.count("loss_agg_mode=") == 1, text
