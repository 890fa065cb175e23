"""The trainer, the reference and the rollout engine compute log-probs of the same tempered distribution."""

from __future__ import annotations

import pytest
import torch

from relax.models.hf import build_model
from relax.rollout.embedded import EmbeddedEngine
from relax.train.torch_policy import TorchPolicy
from relax.train.torch_reference import TorchReference

VOCAB, PAD, EOS = 32, 0, 31


def generate(model_cfg, temperature: float, **sampling):
    model = build_model(model_cfg, VOCAB, PAD, seed=3, dtype=torch.float32)
    engine = EmbeddedEngine(model, eos_token_ids=[EOS], pad_token_id=PAD)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    return engine.generate(prompts, n_samples_per_prompt=4, max_new_tokens=6, temperature=temperature, seed=11,
                           **sampling)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_on_policy_ratio_is_one_at_any_temperature(tiny_model_cfg, train_cfg, temperature):
    samples = generate(tiny_model_cfg, temperature)
    valid = samples.response_mask.bool()
    policy = TorchPolicy(tiny_model_cfg, train_cfg, vocab_size=VOCAB, pad_token_id=PAD, seed=3,
                         temperature=temperature)
    reference = TorchReference(tiny_model_cfg, vocab_size=VOCAB, pad_token_id=PAD, seed=3, temperature=temperature)
    for logp in (policy.compute_logprobs(samples, 4), reference.compute_logprobs(samples, 5)):
        ratio = torch.exp(logp - samples.rollout_logp)[valid]
        assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5), ratio


def test_a_trainer_at_another_temperature_is_off_policy(tiny_model_cfg, train_cfg):
    """The negative control: log-probs at T=1 of tokens sampled at T=0.7 differ (so the test above can fail)."""
    samples = generate(tiny_model_cfg, 0.7)
    policy = TorchPolicy(tiny_model_cfg, train_cfg, vocab_size=VOCAB, pad_token_id=PAD, seed=3)
    diff = (policy.compute_logprobs(samples, 4) - samples.rollout_logp)[samples.response_mask.bool()]
    assert diff.abs().max() > 1e-2


def test_truncation_keeps_full_vocabulary_logprobs_and_reports_the_dropped_mass(tiny_model_cfg, train_cfg):
    samples = generate(tiny_model_cfg, 0.7, top_k=3)
    policy = TorchPolicy(tiny_model_cfg, train_cfg, vocab_size=VOCAB, pad_token_id=PAD, seed=3, temperature=0.7)
    ratio = torch.exp(policy.compute_logprobs(samples, 4) - samples.rollout_logp)[samples.response_mask.bool()]
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5)
    assert 0 < samples.dropped_mass < 1  # 32 tokens cut to 3: a random model's distribution loses mass
    assert generate(tiny_model_cfg, 0.7).dropped_mass == 0.0


def test_dropped_mass_is_the_mass_outside_the_top_k():
    from relax.rollout.sampling import sample_tokens

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    out = sample_tokens(logits, temperature=1.0, top_k=2, top_p=1.0, uniforms=torch.tensor([0.5]))
    assert out.dropped_mass.item() == pytest.approx(0.2, abs=1e-6)
    assert out.tokens.item() in (0, 1)
    assert out.logp.item() == pytest.approx(float(torch.log(torch.tensor([0.5, 0.3]))[out.tokens.item()]), abs=1e-6)
