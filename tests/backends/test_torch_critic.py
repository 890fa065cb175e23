"""The embedded PPO critic: value alignment with token_logprobs, learning, checkpoints."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from relax.algorithms import GRPOConfig, PPOConfig
from relax.train.torch_critic import VALUE_HEAD_FILE, TorchCritic, critic_lr
from relax.train.torch_policy import TorchPolicy

VOCAB, PAD = 32, 0


def critic(model_cfg, train_cfg, seed: int = 0, algo=None, **kw) -> TorchCritic:
    return TorchCritic(
        model_cfg, train_cfg, algo or PPOConfig(), vocab_size=VOCAB, pad_token_id=PAD, seed=seed, device="cpu", **kw
    )


def randomise_head(c: TorchCritic, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        c.critic.value_head.weight.copy_(torch.randn(c.critic.value_head.weight.shape, generator=g))
        c.critic.value_head.bias.fill_(0.3)


def test_critic_lr_resolution(train_cfg):
    assert critic_lr(train_cfg, PPOConfig(critic_lr=0.2)) == 0.2
    assert critic_lr(train_cfg, GRPOConfig()) == train_cfg.lr
    assert critic_lr(train_cfg, None) == train_cfg.lr


def test_values_are_read_at_the_state_before_each_response_token(tiny_model_cfg, train_cfg, make_samples):
    c = critic(tiny_model_cfg, train_cfg)
    assert torch.equal(c.compute_values(make_samples(n=3, seed=0), 3), torch.zeros(3, 4))  # zero-initialised head
    randomise_head(c)
    samples = make_samples(n=5, P=6, T=5, seed=1)
    values = c.compute_values(samples, micro_batch_size=2)
    assert values.shape == (5, 5) and torch.isfinite(values).all()
    head = c.critic.value_head
    with torch.no_grad():
        for i in range(len(samples)):
            prompt = samples.prompt_ids[i][samples.prompt_mask[i].bool()]
            response = samples.response_ids[i][samples.response_mask[i].bool()]
            ids = torch.cat([prompt, response]).unsqueeze(0)
            h = c.critic.lm.base_model(input_ids=ids).last_hidden_state[0]
            expected = head(h[len(prompt) - 1 : len(prompt) + len(response) - 1]).squeeze(-1)
            torch.testing.assert_close(values[i, : len(response)], expected, atol=1e-5, rtol=1e-5)
    assert (values[samples.response_mask == 0] == 0).all()


def test_value_loss_steps_reduce_the_value_error(tiny_model_cfg, train_cfg, make_batch):
    c = critic(tiny_model_cfg, dataclasses.replace(train_cfg, lr=1e-2, clip_grad=1.0))
    base = make_batch(n=8, seed=2)
    g = torch.Generator().manual_seed(3)
    returns = torch.rand(8, 4, generator=g) * base.response_mask
    mask = base.response_mask.bool()

    def error() -> float:
        return float(((c.compute_values(base, 8) - returns)[mask] ** 2).mean())

    before = error()
    for _ in range(5):
        batch = base.with_(returns=returns, old_values=c.compute_values(base, 8))
        metrics = c.train_step(batch, PPOConfig(value_clip=10.0), per_token=True, micro_batch_size=4)
    assert set(metrics) >= {"critic/value_loss", "critic/value_clipfrac", "critic/grad_norm", "critic/lr"}
    assert metrics["critic/lr"] == pytest.approx(1e-2)
    assert error() < 0.5 * before


@pytest.mark.parametrize("per_token", [True, False])
def test_critic_micro_batch_split_gives_the_same_update(tiny_model_cfg, train_cfg, make_batch, per_token):
    base = make_batch(n=8, seed=4)
    g = torch.Generator().manual_seed(5)
    probe = critic(tiny_model_cfg, train_cfg)
    randomise_head(probe)
    old_values = probe.compute_values(base, 8) + 0.3 * torch.randn(8, 4, generator=g)
    batch = base.with_(returns=old_values + torch.randn(8, 4, generator=g), old_values=old_values)
    params, metrics = [], []
    for mbs, max_tokens in ((8, None), (2, None), (8, 10)):  # one micro-batch; by rows; by tokens
        c = critic(tiny_model_cfg, train_cfg)
        randomise_head(c)
        metrics.append(c.train_step(batch, PPOConfig(value_clip=0.1), per_token=per_token, micro_batch_size=mbs,
                                    max_tokens=max_tokens))
        params.append([p.detach().clone() for p in c.critic.parameters()])
        torch.testing.assert_close(c.compute_values(batch, mbs, max_tokens), c.compute_values(batch, 8))
    for other in (1, 2):
        for a, b in zip(params[0], params[other], strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        for name in metrics[0]:
            assert metrics[0][name] == pytest.approx(metrics[other][name], rel=1e-5, abs=1e-7), name
    assert 0 < metrics[0]["critic/value_clipfrac"] < 1


def test_critic_checkpoint_round_trip_and_policy_backbone(tiny_model_cfg, train_cfg, make_batch, tmp_path):
    batch0 = make_batch(n=4, seed=6)
    a = critic(tiny_model_cfg, train_cfg, seed=0)
    batch = batch0.with_(returns=torch.ones(4, 4))
    a.train_step(batch, PPOConfig(), per_token=True, micro_batch_size=2)
    a.save_checkpoint(tmp_path / "critic")
    assert (tmp_path / "critic" / VALUE_HEAD_FILE).is_file()
    b = critic(tiny_model_cfg, train_cfg, seed=9)
    b.load_checkpoint(tmp_path / "critic")
    for x, y in zip(a.critic.parameters(), b.critic.parameters(), strict=True):
        assert torch.equal(x, y)
    assert b.step == 1
    ma = a.train_step(batch, PPOConfig(), per_token=True, micro_batch_size=2)
    mb = b.train_step(batch, PPOConfig(), per_token=True, micro_batch_size=2)
    assert ma == mb

    # a policy checkpoint initialises the critic's backbone; the head stays zero
    p = TorchPolicy(tiny_model_cfg, train_cfg, vocab_size=VOCAB, pad_token_id=PAD, seed=3, device="cpu")
    p.save_checkpoint(tmp_path / "policy")
    c = critic(tiny_model_cfg, train_cfg, seed=0)
    c.load_backbone(tmp_path / "policy")
    for (n, x), (_, y) in zip(p.model.named_parameters(), c.critic.lm.named_parameters(), strict=True):
        assert torch.equal(x, y), n
    assert (c.critic.value_head.weight == 0).all()


def test_value_clipfrac_is_a_token_share_with_per_response_loss(tiny_model_cfg, train_cfg, make_batch):
    base = make_batch(n=8, seed=7)
    mask = base.response_mask.bool()
    assert len(set(mask.sum(-1).tolist())) > 1  # uneven response lengths
    c = critic(tiny_model_cfg, train_cfg)
    randomise_head(c)
    values = c.compute_values(base, 8)
    g = torch.Generator().manual_seed(8)
    old_values = values + 0.3 * torch.randn(8, 4, generator=g)
    returns = values + torch.randn(8, 4, generator=g)
    metrics = c.train_step(base.with_(returns=returns, old_values=old_values), PPOConfig(value_clip=0.2),
                           per_token=False, micro_batch_size=3)
    delta = values - old_values
    clipped_v = old_values + delta.clamp(-0.2, 0.2)
    clipped = (delta.abs() > 0.2) & ((clipped_v - returns) ** 2 > (values - returns) ** 2) & mask
    assert 0 < clipped.sum() < mask.sum()
    assert metrics["critic/value_clipfrac"] == pytest.approx(float(clipped.sum() / mask.sum()), abs=1e-6)
