"""Packed sequences (train.pack_sequences) compute what the padded micro-batches compute: log-probs and entropies
against the untrimmed padded forward, losses, metrics and gradients of a train step for every algorithm, the
reference's log-probs and the critic's values and update; and the packed row holds no padding."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from relax import algorithms
from relax.algorithms import PPOConfig
from relax.models.hf import token_logprobs
from relax.train.logprobs import forward_logprobs
from relax.train.packing import pack, packed_tokens
from relax.train.torch_critic import TorchCritic
from relax.train.torch_policy import TorchPolicy
from relax.train.torch_reference import TorchReference
from relax.train.trainer import length_sorted_micro_batches


def policy(model_cfg, train_cfg, packed: bool) -> TorchPolicy:
    return TorchPolicy(model_cfg, dataclasses.replace(train_cfg, pack_sequences=packed), vocab_size=32,
                       pad_token_id=0, seed=0, num_threads=1)


def test_the_packed_row_is_every_real_token_once_with_positions_restarting(make_samples):
    s = make_samples(n=5, P=6, T=5, seed=2)
    p = pack(s)
    lengths = packed_tokens(s)
    assert p.input_ids.shape == (1, int(lengths.sum()))
    expected_ids, expected_pos = [], []
    for i in range(5):
        seq = s.prompt_ids[i][s.prompt_mask[i] != 0].tolist() + s.response_ids[i][s.response_mask[i] != 0].tolist()
        assert len(seq) == lengths[i]
        expected_ids += seq
        expected_pos += list(range(len(seq)))
    assert p.input_ids[0].tolist() == expected_ids and 0 not in expected_ids  # no pad token
    assert p.position_ids[0].tolist() == expected_pos
    assert p.targets.tolist() == s.response_ids[s.response_mask != 0].tolist()
    assert (p.input_ids[0, p.before + 1] == p.targets).all()  # each state is the one just before its token


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_logprobs_and_entropy_equal_the_padded_forward(tiny_model_cfg, train_cfg, make_samples, temperature):
    s = make_samples(n=6, P=5, T=6, seed=3)
    model = policy(tiny_model_cfg, train_cfg, packed=False).model.eval()
    ids, mask = s.sequences()
    with torch.no_grad():
        ref_logp, ref_ent = token_logprobs(model, ids, mask, 5, 6, with_entropy=True, temperature=temperature)
        logp, ent, t = forward_logprobs(model, s, device=torch.device("cpu"), compute_dtype=torch.float32,
                                        temperature=temperature, entropy="metric", packed=True)
    valid = s.response_mask[:, :t] != 0
    torch.testing.assert_close(logp[valid], ref_logp[:, :t][valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent[valid], ref_ent[:, :t][valid], atol=1e-5, rtol=1e-5)
    assert (logp[~valid] == 0).all()
    # the negative control: one packed row without restarting positions attends across sequences
    p = pack(s)
    with torch.no_grad():
        leaky = model(input_ids=p.input_ids, position_ids=torch.arange(p.input_ids.shape[1])[None]).logits
    leaked = torch.log_softmax(leaky[0, p.before].float() / temperature, -1).gather(-1, p.targets[:, None])[:, 0]
    assert (leaked - ref_logp[:, :t][valid]).abs().max() > 1e-3


@pytest.mark.parametrize("name", algorithms.names())
def test_a_packed_train_step_gives_the_padded_losses_metrics_and_gradients(tiny_model_cfg, train_cfg, make_batch,
                                                                           name):
    base = make_batch(n=8, P=5, T=6, seed=7)
    ref = policy(tiny_model_cfg, train_cfg, packed=False)
    logp = ref.compute_logprobs(base, micro_batch_size=8)
    batch = base.with_(old_logp=logp - 0.05 * base.response_mask, ref_logp=logp + 0.02 * base.response_mask)
    cfg = algorithms.get(name).config_cls()
    out = {}
    for packed, max_tokens in ((False, None), (True, None), (True, 20)):
        p = policy(tiny_model_cfg, train_cfg, packed)
        metrics = p.accumulate_gradients(batch, cfg, per_token=True, micro_batch_size=4, max_tokens=max_tokens)
        out[packed, max_tokens] = (metrics, {n: w.grad.clone() for n, w in p.model.named_parameters()
                                             if w.grad is not None})
        torch.testing.assert_close(p.compute_logprobs(base, 4, max_tokens), logp, atol=1e-5, rtol=1e-5)
    metrics, grads = out[False, None]
    for key in (True, None), (True, 20):
        m, g = out[key]
        assert m.keys() == metrics.keys() and g.keys() == grads.keys()
        for k in metrics:
            assert m[k] == pytest.approx(metrics[k], rel=1e-4, abs=1e-6), (key, k)
        for n in grads:
            torch.testing.assert_close(g[n], grads[n], atol=1e-5, rtol=1e-3, msg=f"{key} {n}")


def test_packed_token_budget_counts_real_tokens(make_samples):
    s = make_samples(n=10, P=6, T=7, seed=5)
    tokens = packed_tokens(s)
    splits = length_sorted_micro_batches(s, 10, 15, packed=True)
    assert sorted(torch.cat(splits).tolist()) == list(range(10))
    for rows in splits:
        assert len(rows) == 1 or int(tokens[rows].sum()) <= 15


def test_packed_reference_and_critic_equal_the_padded_ones(tiny_model_cfg, train_cfg, make_batch):
    batch = make_batch(n=6, P=5, T=6, seed=9)
    refs = [TorchReference(tiny_model_cfg, vocab_size=32, pad_token_id=0, seed=0, num_threads=1, packed=packed)
            for packed in (False, True)]
    torch.testing.assert_close(refs[1].compute_logprobs(batch, 3), refs[0].compute_logprobs(batch, 3), atol=1e-5,
                               rtol=1e-5)
    critics, outs = [], []
    for packed in (False, True):
        c = TorchCritic(tiny_model_cfg, dataclasses.replace(train_cfg, pack_sequences=packed), vocab_size=32,
                        pad_token_id=0, seed=0, num_threads=1)
        torch.nn.init.normal_(c.critic.value_head.weight, std=0.5, generator=torch.Generator().manual_seed(1))
        critics.append(c)
    values = critics[0].compute_values(batch, 3)
    torch.testing.assert_close(critics[1].compute_values(batch, 3), values, atol=1e-5, rtol=1e-5)
    train = batch.with_(returns=values + 1.0, old_values=values)
    for c in critics:
        outs.append((c.train_step(train, PPOConfig(), per_token=True, micro_batch_size=3),
                     [w.detach().clone() for w in c.critic.parameters()]))
    for k in outs[0][0]:
        assert outs[1][0][k] == pytest.approx(outs[0][0][k], rel=1e-4, abs=1e-6), k
    for a, b in zip(outs[0][1], outs[1][1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
