"""The embedded policy trainer: micro-batch invariance, clipping, lr schedule, learning, checkpoints."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from relax.algorithms import (
    Algorithm,
    AlgorithmConfig,
    GRPOConfig,
    M2POConfig,
    PolicyLossOutput,
    RLOOConfig,
    get,
    register,
    unregister,
)
from relax.algorithms import get as get_algorithm
from relax.algorithms import names as algorithm_names
from relax.config.schema import ModelConfig
from relax.metrics import GRAD_NORM, LR, M2_AFTER, M2_BEFORE
from relax.models.hf import build_model, token_logprobs
from relax.train.torch_policy import TorchPolicy
from relax.train.trainer import length_sorted_micro_batches, lr_factor

VOCAB, PAD = 32, 0


def policy(model_cfg, train_cfg, seed: int = 0, **kw) -> TorchPolicy:
    return TorchPolicy(model_cfg, train_cfg, vocab_size=VOCAB, pad_token_id=PAD, seed=seed, device="cpu", **kw)


def grads(p: TorchPolicy) -> dict[str, torch.Tensor]:
    return {n: w.grad.clone() for n, w in p.model.named_parameters() if w.grad is not None}


def test_compute_logprobs_matches_untrimmed_forward(tiny_model_cfg, train_cfg, make_samples):
    p = policy(tiny_model_cfg, train_cfg)
    # no row uses the first prompt column or the last response column: both get trimmed
    samples = make_samples(n=5, P=6, T=5, seed=3, full_row=False)
    samples.prompt_mask[:, 0] = 0
    samples.response_mask[:, -1] = 0
    ids, mask = samples.sequences()
    with torch.no_grad():
        ref = token_logprobs(p.model.eval(), ids, mask, 6, 5) * samples.response_mask
    for mbs in (1, 2, 5):
        out = p.compute_logprobs(samples, micro_batch_size=mbs)
        assert out.shape == (5, 5) and out.dtype == torch.float32
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert (out[samples.response_mask == 0] == 0).all()


@pytest.mark.parametrize("per_token", [True, False])
def test_micro_batch_split_gives_the_same_gradients_and_update(tiny_model_cfg, train_cfg, make_batch, per_token):
    base = make_batch(n=8, P=5, T=4, seed=4)
    ref = policy(tiny_model_cfg, train_cfg)
    old = ref.compute_logprobs(base, micro_batch_size=8) - 0.05 * base.response_mask  # some ratios clip
    batch = base.with_(old_logp=old)
    cfg = GRPOConfig(eps_clip=0.03)
    results = {}
    for mbs in (2, 8):
        p = policy(tiny_model_cfg, train_cfg)
        metrics = p.accumulate_gradients(batch, cfg, per_token=per_token, micro_batch_size=mbs)
        results[mbs] = (metrics, grads(p), p)
    (m2, g2, p2), (m8, g8, p8) = results[2], results[8]
    assert g2.keys() == g8.keys() and len(g2) > 0
    for name in g2:
        torch.testing.assert_close(g2[name], g8[name], atol=1e-6, rtol=1e-4)
    assert m2.keys() == m8.keys()
    for name in m2:
        assert m2[name] == pytest.approx(m8[name], rel=1e-5, abs=1e-7), name
    assert 0 < m8["train/pg_clipfrac"] < 1
    # whole step: same update from both splits. AdamW's first step moves every weight by about lr = 1e-3 (it divides
    # each gradient by its own size), and the splits' weights then differ by up to 2.9e-7 (measured; MKL_CBWR=COMPATIBLE
    # 1.6e-7), too close to 1e-6 for another CPU's kernels; a step too many moves each tensor by 7e-4 or more: atol 1e-5
    p2.train_step(batch, cfg, per_token=per_token, micro_batch_size=2)
    p8.train_step(batch, cfg, per_token=per_token, micro_batch_size=8)
    for (n, a), (_, b) in zip(p2.model.named_parameters(), p8.model.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=n)



def widths(samples, rows: torch.Tensor) -> int:
    """Tokens the model computes for micro-batch `rows`: rows x (longest prompt + longest response), by hand."""
    prompt = max(int(samples.prompt_mask[i].sum()) for i in rows)
    response = max(max((t + 1 for t in range(samples.response_mask.shape[1]) if samples.response_mask[i, t]),
                       default=0) for i in rows)
    return len(rows) * (prompt + response)


@pytest.mark.parametrize("max_tokens", [1, 9, 16, 40, 1000])
@pytest.mark.parametrize("micro_batch_size", [1, 3, 8])
def test_token_budget_micro_batches_hold_at_most_the_budget(make_samples, max_tokens, micro_batch_size):
    """Every row once; at most micro_batch_size rows and max_tokens tokens (padding included) in each micro-batch,
    but for a row wider than the budget, alone; the next row in length order would not have fitted."""
    samples = make_samples(n=12, P=6, T=7, seed=3)
    splits = length_sorted_micro_batches(samples, micro_batch_size, max_tokens)
    order = torch.cat(splits).tolist()
    assert sorted(order) == list(range(12))
    assert order == length_sorted_micro_batches(samples, 12)[0].tolist()  # the rows in length order
    for k, rows in enumerate(splits):
        assert len(rows) <= micro_batch_size
        assert len(rows) == 1 or widths(samples, rows.tolist()) <= max_tokens
        if k + 1 < len(splits) and len(rows) < micro_batch_size:  # closed because the next row did not fit
            assert widths(samples, rows.tolist() + [int(splits[k + 1][0])]) > max_tokens
    if max_tokens == 1000:
        assert [len(r) for r in splits] == [len(r) for r in length_sorted_micro_batches(samples, micro_batch_size)]


@pytest.mark.parametrize("name", algorithm_names())
def test_token_budget_micro_batches_give_the_same_gradients_for_every_algorithm(tiny_model_cfg, train_cfg,
                                                                                make_batch, name):
    """Micro-batches by tokens change the split, never the step: gradients and metrics as with one micro-batch
    (the loss's denominators count the whole step's tokens)."""
    base = make_batch(n=8, P=5, T=6, seed=7)
    ref = policy(tiny_model_cfg, train_cfg)
    batch = base.with_(old_logp=ref.compute_logprobs(base, micro_batch_size=8) - 0.05 * base.response_mask,
                       ref_logp=ref.compute_logprobs(base, micro_batch_size=8) + 0.02 * base.response_mask)
    cfg = get_algorithm(name).config_cls()
    results = {}
    for max_tokens in (None, 12):
        p = policy(tiny_model_cfg, train_cfg)
        metrics = p.accumulate_gradients(batch, cfg, per_token=True, micro_batch_size=8, max_tokens=max_tokens)
        results[max_tokens] = (metrics, grads(p))
    assert len(length_sorted_micro_batches(batch, 8, 12)) >= 4  # the budget did split the batch
    (m_rows, g_rows), (m_tokens, g_tokens) = results[None], results[12]
    for key in g_rows:
        torch.testing.assert_close(g_tokens[key], g_rows[key], atol=1e-6, rtol=1e-4)
    for key in m_rows:
        assert m_tokens[key] == pytest.approx(m_rows[key], rel=1e-5, abs=1e-7), key
    logp = ref.compute_logprobs(base, micro_batch_size=8)
    torch.testing.assert_close(ref.compute_logprobs(base, micro_batch_size=8, max_tokens=12), logp, atol=1e-6,
                               rtol=1e-5)

def test_grad_clipping_caps_the_norm_and_reports_the_pre_clip_norm(tiny_model_cfg, train_cfg, make_batch):
    p = policy(tiny_model_cfg, dataclasses.replace(train_cfg, clip_grad=1e-3))
    batch = make_batch(n=4, seed=5)
    seen = []

    def record(optimizer, args, kwargs):
        seen.append(math.sqrt(sum(float(w.grad.pow(2).sum()) for w in p.model.parameters() if w.grad is not None)))

    p.optimizer.register_step_pre_hook(record)
    metrics = p.train_step(batch, RLOOConfig(), per_token=True, micro_batch_size=4)
    assert metrics[GRAD_NORM] > 1e-2
    assert seen[0] == pytest.approx(1e-3, rel=1e-3)


def test_the_fused_adamw_update_is_adamw_by_hand(tiny_model_cfg, train_cfg, make_batch):
    """Two steps of the trainer's (fused) AdamW against the AdamW formula written out (Loshchilov & Hutter)."""
    cfg = dataclasses.replace(train_cfg, lr=1e-2, weight_decay=0.1, clip_grad=0.0)
    p = policy(tiny_model_cfg, cfg)
    assert p.optimizer.defaults["fused"] is True
    b1, b2, eps = cfg.adam_beta1, cfg.adam_beta2, 1e-8
    params = dict(p.model.named_parameters())
    w = {n: t.detach().double().clone() for n, t in params.items()}
    m = {n: torch.zeros_like(t) for n, t in w.items()}
    v = {n: torch.zeros_like(t) for n, t in w.items()}
    seen: dict[str, torch.Tensor] = {}  # the gradients each optimizer step applies
    p.optimizer.register_step_pre_hook(
        lambda *_: seen.update({n: t.grad.detach().double().clone() for n, t in params.items()}))
    for step, seed in ((1, 5), (2, 6)):
        seen.clear()
        p.train_step(make_batch(n=4, seed=seed), RLOOConfig(), per_token=True, micro_batch_size=4)
        assert sum(float(g.abs().sum()) for g in seen.values()) > 0
        lr = cfg.lr * lr_factor(step - 1, schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps,
                                total_steps=p.total_steps, min_lr_ratio=cfg.min_lr_ratio)
        for n, g in seen.items():
            w[n] *= 1 - lr * cfg.weight_decay
            m[n] = b1 * m[n] + (1 - b1) * g
            v[n] = b2 * v[n] + (1 - b2) * g * g
            w[n] -= lr * (m[n] / (1 - b1**step)) / ((v[n] / (1 - b2**step)).sqrt() + eps)
    for n, t in params.items():
        torch.testing.assert_close(t.detach().double(), w[n], atol=1e-6, rtol=1e-5)


def test_lr_factor_by_hand():
    kw = dict(warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    assert [lr_factor(s, schedule="constant", **kw) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    # after warmup: progress = (step - 2) / 8
    assert lr_factor(2, schedule="cosine", **kw) == pytest.approx(1.0)
    assert lr_factor(4, schedule="cosine", **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_factor(6, schedule="cosine", **kw) == pytest.approx(0.55)
    assert lr_factor(10, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_factor(4, schedule="linear", **kw) == pytest.approx(1 - 0.9 * 0.25)
    assert lr_factor(50, schedule="linear", **kw) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="lr_schedule"):
        lr_factor(0, schedule="step", **kw)


def test_trainer_reports_the_scheduled_lr_per_step(tiny_model_cfg, train_cfg, make_batch):
    cfg = dataclasses.replace(train_cfg, lr=0.01, lr_schedule="linear", warmup_steps=1, min_lr_ratio=0.0)
    p = policy(tiny_model_cfg, cfg, total_steps=5)
    batch = make_batch(n=2, seed=6)
    lrs = [p.train_step(batch, RLOOConfig(), per_token=True, micro_batch_size=2)[LR] for _ in range(4)]
    assert lrs == pytest.approx([0.01, 0.01, 0.01 * 0.75, 0.01 * 0.5])
    assert p.step == 4


def test_positive_advantages_raise_the_logprob_of_sampled_tokens(tiny_model_cfg, train_cfg, make_batch):
    p = policy(tiny_model_cfg, dataclasses.replace(train_cfg, lr=1e-2))
    base = make_batch(n=8, seed=7)
    batch = base.with_(advantages=base.response_mask.float(), old_logp=p.compute_logprobs(base, 8))
    mask = batch.response_mask.bool()
    before = p.compute_logprobs(batch, 8)[mask].mean()
    losses = [p.train_step(batch, GRPOConfig(), per_token=True, micro_batch_size=4)["train/loss"] for _ in range(4)]
    after = p.compute_logprobs(batch, 8)[mask].mean()
    assert after > before + 0.05
    assert losses[-1] < losses[0]


def test_entropy_bonus_path_and_entropy_metric(tiny_model_cfg, train_cfg, make_batch):
    batch = make_batch(n=4, seed=8)
    with_bonus = policy(tiny_model_cfg, train_cfg).accumulate_gradients(
        batch, GRPOConfig(entropy_coef=0.01), per_token=True, micro_batch_size=2
    )
    measured = policy(tiny_model_cfg, train_cfg).accumulate_gradients(
        batch, GRPOConfig(), per_token=True, micro_batch_size=2
    )
    assert with_bonus["train/entropy"] == pytest.approx(measured["train/entropy"], rel=1e-5)
    assert 0 < measured["train/entropy"] <= math.log(VOCAB) + 1e-4
    quiet = policy(tiny_model_cfg, train_cfg).accumulate_gradients(
        batch, GRPOConfig(), per_token=True, micro_batch_size=2, report_entropy=False
    )
    assert "train/entropy" not in quiet


def test_bf16_autocast_keeps_fp32_master_weights(tiny_model_cfg, train_cfg, make_batch):
    p = policy(dataclasses.replace(tiny_model_cfg, dtype="bfloat16"), train_cfg)
    assert p.compute_dtype == torch.bfloat16
    batch = make_batch(n=4, seed=9)
    metrics = p.train_step(batch, GRPOConfig(), per_token=True, micro_batch_size=2)
    assert all(math.isfinite(v) for v in metrics.values())
    assert all(w.dtype == torch.float32 for w in p.model.parameters())
    assert p.compute_logprobs(batch, 4).dtype == torch.float32


def test_rollout_state_dict_and_load_weights(tiny_model_cfg, train_cfg, make_batch):
    a, b = policy(tiny_model_cfg, train_cfg, seed=0), policy(tiny_model_cfg, train_cfg, seed=1)
    batch = make_batch(n=4, seed=10)
    a.train_step(batch, GRPOConfig(), per_token=True, micro_batch_size=4)
    sd = a.state_dict_for_rollout()
    assert all(t.device.type == "cpu" for t in sd.values())
    assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]  # tied: one tensor
    b.load_weights(sd)
    torch.testing.assert_close(b.compute_logprobs(batch, 4), a.compute_logprobs(batch, 4), atol=0, rtol=0)
    b.load_weights({k: v for k, v in sd.items() if k != "lm_head.weight"})  # tied key may be left out
    with pytest.raises(KeyError, match="missing"):
        b.load_weights({k: v for k, v in sd.items() if k != "model.norm.weight"})


def test_checkpoint_round_trip(tiny_model_cfg, train_cfg, make_batch, tmp_path):
    cfg = dataclasses.replace(train_cfg, lr_schedule="cosine", warmup_steps=1)
    a = policy(tiny_model_cfg, cfg, seed=0)
    batch = make_batch(n=4, seed=11)
    for _ in range(2):
        a.train_step(batch, GRPOConfig(), per_token=True, micro_batch_size=2)
    a.save_checkpoint(tmp_path / "ckpt")
    files = {f.name for f in (tmp_path / "ckpt").iterdir()}
    assert {"config.json", "model.safetensors", "optimizer.pt", "scheduler.pt"} <= files
    for name in ("optimizer.pt", "scheduler.pt"):
        torch.load(tmp_path / "ckpt" / name, weights_only=True)

    b = policy(tiny_model_cfg, cfg, seed=5)
    b.load_checkpoint(tmp_path / "ckpt")
    assert b.step == a.step == 2
    for (n, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(x, y), n
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    for i in sa["state"]:
        for k in sa["state"][i]:
            assert torch.equal(sa["state"][i][k], sb["state"][i][k])
    assert sa["param_groups"][0]["lr"] == sb["param_groups"][0]["lr"]
    ma = a.train_step(batch, GRPOConfig(), per_token=True, micro_batch_size=2)
    mb = b.train_step(batch, GRPOConfig(), per_token=True, micro_batch_size=2)
    assert ma == mb
    for (n, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(x, y), n

    # the checkpoint is a plain HF directory: build_model(source=hf) reads it
    hf = build_model(ModelConfig(source="hf", path=str(tmp_path / "ckpt")), VOCAB, PAD, seed=0, device="cpu")
    ids, mask = batch.sequences()
    c = policy(tiny_model_cfg, cfg, seed=7)
    c.load_checkpoint(tmp_path / "ckpt", load_optimizer=False)
    with torch.no_grad():
        hf_logp = token_logprobs(hf.eval(), ids, mask, 5, 4) * batch.response_mask
    torch.testing.assert_close(hf_logp, c.compute_logprobs(batch, 4), atol=1e-5, rtol=1e-5)
    with pytest.raises(FileNotFoundError):
        b.load_checkpoint(tmp_path / "missing")


def brute_m2po(d: list[float], a: list[float], budget: float, lo_floor: float, hi_floor: float):
    """The spec's M2PO bounds by bisection over the valid tokens' (log-ratio, advantage) pairs."""
    sq = [x * x for x, y in zip(d, a, strict=True) if (y > 0 and x > 0) or (y < 0 and x < 0)]
    if not sq:
        return math.inf, math.inf, 0.0, 0.0
    m2 = sum(sq) / len(sq)
    if m2 <= budget:
        return math.inf, math.inf, m2, m2
    lo, hi = 0.0, max(sq)
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(min(x, mid) for x in sq) < len(sq) * budget else (lo, mid)
    tau = math.sqrt((lo + hi) / 2)
    after = sum(min(x, tau * tau) for x in sq) / len(sq)
    return max(1 - math.exp(-tau), lo_floor), max(math.exp(tau) - 1, hi_floor), m2, after


@pytest.mark.parametrize("per_token", [True, False])
def test_m2po_step_statistics_cover_the_whole_step(tiny_model_cfg, train_cfg, make_batch, per_token):
    base = make_batch(n=8, P=5, T=4, seed=12)
    probe = policy(tiny_model_cfg, train_cfg)
    logp = probe.compute_logprobs(base, micro_batch_size=8)
    g = torch.Generator().manual_seed(13)
    old = (logp + 0.2 * torch.randn(8, 4, generator=g)) * base.response_mask  # ratios far from 1: bounds bind
    batch = base.with_(old_logp=old)
    cfg = M2POConfig(kl2_budget=0.005, miniclip_low=0.01, miniclip_high=0.01)
    results = {}
    for mbs in (2, 8):
        p = policy(tiny_model_cfg, train_cfg)
        results[mbs] = (p.accumulate_gradients(batch, cfg, per_token=per_token, micro_batch_size=mbs), grads(p))
    (m2, g2), (m8, g8) = results[2], results[8]
    for name in g2:
        torch.testing.assert_close(g2[name], g8[name], atol=1e-6, rtol=1e-4)
    # rel=1e-5 as the other mbs-2-vs-8 comparisons: fp32 log-probs of 2 rows and of 8 rows need not be the same
    # bits (MKL's sgemm path depends on the CPU); statistics of one micro-batch would differ far more
    for name in (M2_BEFORE, M2_AFTER, "train/loss", "train/pg_clipfrac"):
        assert m2[name] == pytest.approx(m8[name], rel=1e-5, abs=1e-7), name

    # the statistics are the spec's water filling over every valid token of the batch
    mask = batch.response_mask.bool()
    d, a = (logp - old)[mask].double(), batch.advantages[mask].double()
    lo, hi, before, after = brute_m2po(d.tolist(), a.tolist(), 0.005, 0.01, 0.01)
    assert before > 0.005  # clipping is active
    assert m8[M2_BEFORE] == pytest.approx(before, rel=1e-5)
    assert m8[M2_AFTER] == pytest.approx(after, rel=1e-5)
    # and the loss is PPO-Clip with those bounds, reduced as configured
    ratio = torch.exp(logp - old).double()
    adv = batch.advantages.double()
    pg = torch.maximum(-ratio * adv, -ratio.clamp(1 - lo, 1 + hi) * adv) * mask
    if per_token:
        want = pg.sum() / mask.sum()
    else:
        want = (pg.sum(-1) / mask.sum(-1)).mean()
    assert m8["train/loss"] == pytest.approx(float(want), rel=1e-5)
    clipped = ((-ratio.clamp(1 - lo, 1 + hi) * adv > -ratio * adv) & mask).sum() / mask.sum()
    assert m8["train/pg_clipfrac"] == pytest.approx(float(clipped))


def test_diagnostics_are_token_means_with_per_response_loss(tiny_model_cfg, train_cfg, make_batch):
    batch = make_batch(n=8, P=5, T=4, seed=14)
    mask = batch.response_mask.bool()
    assert len(set(mask.sum(-1).tolist())) > 1  # uneven response lengths
    p = policy(tiny_model_cfg, train_cfg)
    logp = p.compute_logprobs(batch, micro_batch_size=8)
    g = torch.Generator().manual_seed(15)
    old = (logp + 0.1 * torch.randn(8, 4, generator=g)) * batch.response_mask
    metrics = p.accumulate_gradients(batch.with_(old_logp=old), GRPOConfig(eps_clip=0.05), per_token=False,
                                     micro_batch_size=3)
    ratio = torch.exp(logp - old)
    adv = batch.advantages
    clipped = (-ratio.clamp(0.95, 1.05) * adv > -ratio * adv) & mask
    assert metrics["train/pg_clipfrac"] == pytest.approx(float(clipped.sum() / mask.sum()), abs=1e-6)
    assert metrics["train/ppo_kl"] == pytest.approx(float((old - logp)[mask].mean()), abs=1e-6)
    per_response = float(((clipped.sum(-1) / mask.sum(-1))).mean())
    assert metrics["train/pg_clipfrac"] != pytest.approx(per_response)  # the two definitions differ here


def test_step_statistics_hook_sees_every_valid_token_once(tiny_model_cfg, train_cfg, make_batch):
    """A temporary algorithm with `step_statistics`: the trainer calls it once per step, on all valid tokens."""
    calls: list[int] = []

    @dataclasses.dataclass(frozen=True)
    class StepMeanConfig(AlgorithmConfig):
        name: str = "step_mean_pg"

    def step_statistics(cfg, logp, old_logp, advantages, mask):
        calls.append(int((mask != 0).sum()))
        keep = mask != 0
        return {"mean_adv": float(advantages[keep].double().mean())}

    def policy_loss(cfg, logp, old_logp, advantages, mask, *, stats):
        return PolicyLossOutput(loss=-(advantages - stats["mean_adv"]) * logp)

    register(Algorithm("step_mean_pg", StepMeanConfig, get("grpo").compute_advantages, policy_loss, "test only",
                       step_statistics=step_statistics))
    try:
        batch = make_batch(n=8, seed=16)
        mask = batch.response_mask.bool()
        results = {}
        for mbs in (3, 8):
            p = policy(tiny_model_cfg, train_cfg)
            p.accumulate_gradients(batch, StepMeanConfig(), per_token=True, micro_batch_size=mbs)
            results[mbs] = grads(p)
        assert calls == [int(mask.sum())] * 2
        for name in results[8]:
            torch.testing.assert_close(results[3][name], results[8][name], atol=1e-6, rtol=1e-4)
        # the gradient is that of -(A - mean_step(A)) * logp over the step's tokens
        p = policy(tiny_model_cfg, train_cfg)
        ids, attn = batch.sequences()
        centered = (batch.advantages - batch.advantages[mask].mean()) * batch.response_mask
        p.model.train()
        (-(centered * token_logprobs(p.model, ids, attn, 5, 4)).sum() / mask.sum()).backward()
        for name, g in grads(p).items():
            torch.testing.assert_close(results[8][name], g, atol=1e-6, rtol=1e-4)
    finally:
        unregister("step_mean_pg")
