"""The loss mask of episodes in every loss term: the trainer's loss over an episode batch (observation tokens in the
context, out of the mask) equals a loss computed by hand over the model's tokens only, with every term on
(PPO-Clip, TIS, the KL loss, the entropy bonus) and both reductions; whatever the observation positions hold never
reaches it. GAE skips observations; DAPO's overlong shaping counts the model's tokens."""

from __future__ import annotations

import math

import pytest
import torch

from relax.agents.episode import EpisodeMaker
from relax.agents.loops import AgentFactory
from relax.algorithms import GRPOConfig
from relax.algorithms import functional as F
from relax.batch import TrainBatch
from relax.config.schema import ModelConfig, TrainConfig
from relax.data.tokenizer import build_tiny_tokenizer
from relax.models.hf import build_model
from relax.rollout.embedded import EmbeddedEngine
from relax.train.torch_policy import TorchPolicy

EPS, TIS_CLIP, KL_COEF, ENT_COEF = 0.1, 1.5, 0.3, 0.01


@pytest.fixture(scope="module")
def episodes():
    """Real guess_number episodes of the tiny model (several turns, observations between them)."""
    tok = build_tiny_tokenizer()
    model = build_model(ModelConfig(), len(tok), tok.pad_token_id, seed=0, dtype=torch.float32, device="cpu")
    engine = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    maker = EpisodeMaker(AgentFactory("guess_number", [], None, None), tok, max_turns=4, max_tool_errors=3)
    text = tok.apply_chat_template([{"role": "user", "content": "guess"}], add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    eps = [maker.new({"label": str(s)}) for s in (2, 7) for _ in range(3)]
    out = engine.generate([prompt, prompt[1:]], n_samples_per_prompt=3, max_new_tokens=70, seed=3, episodes=eps,
                          turn_limit=4)
    assert int(out.obs_mask().sum()) > 0 and len(set(out.response_mask.sum(1).tolist())) > 1
    return out, len(tok)


def hand_loss(model, batch: TrainBatch, per_token: bool) -> torch.Tensor:
    """The loss over the model's tokens only, written out: a forward over prompt + whole episode, then each term at
    each generated token, reduced by hand."""
    ids, attention = batch.sequences()
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits.float()
    P = batch.prompt_ids.shape[1]
    rows = []
    for b in range(len(batch)):
        terms = []
        for j in torch.nonzero(batch.response_mask[b]).squeeze(-1).tolist():
            lp_all = torch.log_softmax(logits[b, P + j - 1], -1)
            logp = lp_all[batch.response_ids[b, j]]
            old, ref, rollout = batch.old_logp[b, j], batch.ref_logp[b, j], batch.rollout_logp[b, j]
            a = batch.advantages[b, j]
            ratio = torch.exp(logp - old)
            pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - EPS, 1 + EPS))
            w = min(math.exp(float(old - rollout)), TIS_CLIP)
            x = logp - ref
            k3 = torch.exp(-x) - 1 + x
            entropy = -(lp_all.exp() * lp_all).sum()
            terms.append(w * pg + KL_COEF * k3 - ENT_COEF * entropy)
        rows.append(torch.stack(terms))
    if per_token:
        return torch.cat(rows).sum() / sum(len(r) for r in rows)
    return torch.stack([r.mean() for r in rows]).mean()


@pytest.mark.parametrize("per_token", [True, False])
def test_every_loss_term_skips_the_observations(episodes, per_token):
    samples, vocab = episodes
    g = torch.Generator().manual_seed(0)
    shape = samples.response_ids.shape
    policy = TorchPolicy(ModelConfig(dtype="float32"), TrainConfig(), vocab_size=vocab, pad_token_id=0, seed=1,
                         device="cpu")
    logp = policy.compute_logprobs(samples, micro_batch_size=6)
    gen, obs = samples.response_mask.bool(), samples.obs_mask().bool()
    garbage = torch.where(obs, torch.full(shape, 1e4), torch.zeros(shape))  # what observation positions hold

    def per_token_values(scale: float) -> torch.Tensor:
        return torch.where(gen, scale * torch.randn(shape, generator=g), garbage)

    batch = TrainBatch.from_samples(
        samples, advantages=per_token_values(1.0), old_logp=torch.where(gen, logp, 0) + per_token_values(0.1),
        ref_logp=torch.where(gen, logp, 0) + per_token_values(0.3))
    batch.rollout_logp = torch.where(gen, logp, 0) + per_token_values(0.3)
    cfg = GRPOConfig(eps_clip=EPS, use_tis=True, tis_clip=TIS_CLIP, use_kl_loss=True, kl_loss_coef=KL_COEF,
                     kl_loss_type="k3", entropy_coef=ENT_COEF)
    metrics = policy.accumulate_gradients(batch, cfg, per_token=per_token, micro_batch_size=4)
    expected = hand_loss(policy.model, batch, per_token)
    assert metrics["train/loss"] == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    policy.model.zero_grad()
    expected.backward()
    for n, p in policy.model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-5, rtol=1e-3, msg=n)
    # negative control: the observation tokens counted as the model's change the loss
    policy.model.zero_grad()
    wrong = batch.with_(response_mask=samples.present(), advantages=torch.where(obs, 1.0, batch.advantages),
                        old_logp=torch.where(obs, 0.0, batch.old_logp), ref_logp=torch.where(obs, 0.0, batch.ref_logp))
    wrong.rollout_logp = torch.where(obs, 0.0, batch.rollout_logp)
    other = policy.accumulate_gradients(wrong, cfg, per_token=per_token, micro_batch_size=4)
    assert other["train/loss"] != pytest.approx(expected.item(), rel=1e-3)


def test_gae_skips_observation_tokens():
    """GAE over a row with observations equals GAE over the same row with its observation columns removed."""
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 1, 0], [1, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    values, rewards = torch.randn(2, 12, generator=g), torch.tensor([1.0, -0.5])
    adv, ret = F.gae(rewards, values, mask, 0.9, 0.8)
    for b in range(2):
        keep = mask[b].bool()
        v = values[b, keep]
        # by hand over the model's tokens: delta_t = r_t + gamma V_{t+1} - V_t, reward on the last one
        n, a_next, out = len(v), 0.0, [0.0] * len(v)
        for t in reversed(range(n)):
            r = float(rewards[b]) if t == n - 1 else 0.0
            v_next = float(v[t + 1]) if t + 1 < n else 0.0
            a_next = r + 0.9 * v_next - float(v[t]) + 0.9 * 0.8 * a_next
            out[t] = a_next
        torch.testing.assert_close(adv[b, keep], torch.tensor(out), atol=1e-5, rtol=1e-5)
        assert (adv[b, ~keep] == 0).all() and (ret[b, ~keep] == 0).all()


def test_overlong_shaping_counts_the_models_tokens(episodes):
    from relax.config import load_config
    from relax.runner.rollout_driver.scoring import overlong_penalties

    samples, _ = episodes
    cfg = load_config(["data=guess_number", "data.overlong_buffer_len=6", "data.overlong_penalty_factor=1.0",
                       "rollout.max_episode_tokens=16"])
    penalty = overlong_penalties(cfg, samples)
    lengths = samples.response_mask.sum(1).tolist()  # the model's tokens, observations left out
    assert any(int(samples.present()[b].sum()) > 16 >= n > 10 for b, n in enumerate(lengths))
    for b, n in enumerate(lengths):  # by hand: 0 up to 16 - 6 model tokens, then falling to -1 at 16
        assert float(penalty[b]) == pytest.approx(-1.0 if n > 16 else -max(0, n - 10) / 6)


def test_reinforce_pp_returns_discount_over_the_models_tokens_only():
    """REINFORCE++'s discounted return with gamma < 1 counts the model's tokens as time steps, not observations: the
    same as over the row with its observation columns removed, computed by hand."""
    g = torch.Generator().manual_seed(2)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0, 1, 1, 0]])
    old, ref = torch.randn(2, 9, generator=g), torch.randn(2, 9, generator=g)
    rewards = torch.tensor([1.0, 0.5])
    out = F.reinforce_pp_returns(rewards, mask, old, ref, 0.1, 0.8)
    for b in range(2):
        keep = mask[b].bool()
        r = (-0.1 * (old[b, keep] - ref[b, keep])).tolist()
        r[-1] += float(rewards[b])
        expected, running = [0.0] * len(r), 0.0
        for t in reversed(range(len(r))):
            running = r[t] + 0.8 * running
            expected[t] = running
        torch.testing.assert_close(out[b, keep], torch.tensor(expected), atol=1e-6, rtol=1e-6)
        assert (out[b, ~keep] == 0).all()
