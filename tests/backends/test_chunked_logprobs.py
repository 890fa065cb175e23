"""The chunked linear + log-softmax (relax.train.logprobs) against the unchunked definition (models.token_logprobs).

Two tiny models: Relax's `source=config` Qwen3 (tied embeddings) and a transformers `LlamaForCausalLM` with
`tie_word_embeddings=True` (SmolLM2's architecture). Rows have left-padded prompts and right-padded responses;
chunk sizes do not divide the number of valid tokens. fp32: log-probs to 1e-5, entropies to 5e-5, every parameter's
gradient to rtol 1e-4 (measured: <= 1e-6, <= 4e-6, <= 2e-6 of the gradient's largest entry; the entropy, a sum over
the 1031 tokens of each row's distribution, is 6.92 here, where float32's step is 4.8e-7: the chunked and unchunked
sums differ by up to 7 steps, 3.3e-6, too close to 1e-5 for another CPU's kernels; a wrong temperature moves it by
6e-3; these near-uniform models' entropies hardly depend on the tokens, so wrong rows or tokens are the log-probs'
check). bf16 autocast,
measured on these models (CPU, torch 2.13): log-probs and entropies identical (both paths run the same bf16 matmul,
upcast and log-softmax), per-parameter gradient differences <= 0.3% of the gradient's norm (<= 0.6% of its largest
entry) while either bf16 path is up to 0.8% (Llama) / 2.7% (Qwen3) from the fp32 gradient; the tolerances are
2e-5, 1%, and the chunked path no further from fp32 than the unchunked bf16 path is (+0.1%).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from relax.config.schema import TrainConfig
from relax.models.hf import build_model, token_logprobs
from relax.train import logprobs as chunked
from relax.train.logprobs import LinearLogSoftmax, chunk_rows, chunked_head, response_logprobs
from relax.train.torch_policy import TorchPolicy

V = 1031  # larger than any other activation's last axis, so a [N, T, V] tensor is recognisable
P, T, N = 6, 9, 7


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    from relax.config.schema import ModelConfig

    qwen = build_model(ModelConfig(name="tiny-test", source="config", dtype="float32", hidden_size=32, num_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                   max_position_embeddings=64), V, 0, seed=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        llama = LlamaForCausalLM(LlamaConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0,
            use_cache=False, attn_implementation="sdpa"))
    assert llama.lm_head.weight is llama.model.embed_tokens.weight
    assert qwen.lm_head.weight is qwen.model.embed_tokens.weight
    return {"qwen3": qwen, "llama": llama}


def samples(make_samples, seed: int = 5):
    s = make_samples(N, P, T, seed=seed, vocab=V)
    ids, mask = s.sequences()
    return ids, mask, s.response_mask.bool()


REF = "unchunked"


def run(model, ids, mask, valid, *, chunk: int | str | None, temperature: float, entropy: str, bf16: bool = False,
        seed: int = 1):
    """(logp, entropy or None, {name: grad}) of a random weighted sum of log-probs (and entropies for "grad");
    chunk: rows per chunk (None: the default), or REF for the unchunked token_logprobs."""
    g = torch.Generator().manual_seed(seed)
    w_logp, w_ent = torch.randn(N, T, generator=g), torch.randn(N, T, generator=g)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        if chunk == REF:
            logp, ent = token_logprobs(model, ids, mask, P, T, with_entropy=True, temperature=temperature)
            ent = None if entropy == "none" else ent
        else:
            logp, ent = response_logprobs(model, ids, mask, P, T, temperature=temperature, entropy=entropy,
                                          chunk_size=chunk)
    assert logp.dtype == torch.float32 and logp.shape == (N, T)
    loss = (logp * w_logp * valid).sum()
    if entropy == "grad":
        loss = loss + (ent * w_ent * valid).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), (None if ent is None else ent.detach()), grads


@pytest.mark.parametrize("name", ["qwen3", "llama"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy", ["none", "metric", "grad"])
@pytest.mark.parametrize("chunk", [1, 5, 8, None])
def test_fp32_equals_the_unchunked_definition(models, make_samples, name, temperature, entropy, chunk):
    model = models[name]
    ids, mask, valid = samples(make_samples)
    assert int(valid.sum()) % 5 and int(valid.sum()) % 8  # the chunks do not divide the valid tokens
    ref_logp, ref_ent, ref_grads = run(model, ids, mask, valid, chunk=REF, temperature=temperature, entropy=entropy)
    logp, ent, grads = run(model, ids, mask, valid, chunk=chunk, temperature=temperature, entropy=entropy)
    torch.testing.assert_close(logp[valid], ref_logp[valid], atol=1e-5, rtol=0)
    assert (logp[~valid] == 0).all()
    if entropy == "none":
        assert ent is None
    else:
        torch.testing.assert_close(ent[valid], ref_ent[valid], atol=5e-5, rtol=0)  # module docstring
        assert (ent[~valid] == 0).all()
    assert grads.keys() == ref_grads.keys() and len(grads) == len(list(model.parameters()))
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-4 * float(ref_grads[n].abs().max()), msg=n)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", ["qwen3", "llama"])
@pytest.mark.parametrize("entropy", ["metric", "grad"])
def test_bf16_autocast_matches_the_unchunked_bf16_path(models, make_samples, name, entropy):
    model = models[name]
    ids, mask, valid = samples(make_samples)
    kw = dict(temperature=0.7, entropy=entropy)
    truth_logp, truth_ent, truth = run(model, ids, mask, valid, chunk=REF, **kw)  # fp32
    ref_logp, ref_ent, ref = run(model, ids, mask, valid, chunk=REF, bf16=True, **kw)
    logp, ent, grads = run(model, ids, mask, valid, chunk=5, bf16=True, **kw)
    assert float((ref_logp - truth_logp)[valid].abs().max()) > 1e-4  # bf16 really was used
    torch.testing.assert_close(logp[valid], ref_logp[valid], atol=2e-5, rtol=0)
    torch.testing.assert_close(ent[valid], ref_ent[valid], atol=2e-5, rtol=0)
    for n, g in grads.items():
        assert rel(g, ref[n]) < 1e-2, (n, rel(g, ref[n]))
        assert rel(g, truth[n]) <= rel(ref[n], truth[n]) + 1e-3, (n, rel(g, truth[n]), rel(ref[n], truth[n]))


def test_the_default_chunk_bounds_the_logits_held_at_once():
    assert chunk_rows(49152) == 341  # SmolLM2: 64 MiB per fp32 [rows, V] work tensor
    assert chunk_rows(151936) == 110 and chunk_rows(V) == 2**24 // V and chunk_rows(2**30) == 16


@pytest.mark.parametrize("with_entropy", [False, True])
def test_the_backward_formulas_pass_gradcheck(with_entropy):
    """fp64 finite differences of log p(target) and of the entropy w.r.t. hidden states and weight."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (7,), generator=g)

    def f(h, w):
        logp, ent = LinearLogSoftmax.apply(h, w, targets, 0.7, 3, torch.float64, with_entropy)
        return (logp, ent) if with_entropy else logp

    assert torch.autograd.gradcheck(f, (h, w))


def saved_numels(model, fn) -> list[int]:
    """Sizes of the tensors `fn` saves for the backward, other than the model's parameters."""
    params = {p.data_ptr() for p in model.parameters()}
    sizes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


@pytest.mark.parametrize("entropy", ["metric", "grad"])
def test_no_vocabulary_sized_tensor_is_saved_for_the_backward(models, make_samples, entropy):
    model = models["qwen3"]
    ids, mask, _ = samples(make_samples)
    full = N * T * V
    ref = saved_numels(model, lambda: token_logprobs(model, ids, mask, P, T, with_entropy=True))
    assert max(ref) >= full  # the unchunked path keeps [N, T, V] tensors
    out = saved_numels(model, lambda: response_logprobs(model, ids, mask, P, T, entropy=entropy, chunk_size=8))
    assert max(out) < full // 4, max(out)  # the decoder's activations, nothing [N, T, V]


def test_a_model_it_does_not_cover_takes_the_unchunked_path(models, make_samples, monkeypatch):
    model = models["llama"]
    ids, mask, valid = samples(make_samples)
    expected, _, _ = run(model, ids, mask, valid, chunk=4, temperature=0.7, entropy="none")
    handle = model.register_forward_hook(lambda *a: None)  # a hook on the top-level forward must still run
    try:
        assert chunked_head(model) is None
        calls = []
        real = chunked.response_logprobs_all
        monkeypatch.setattr(chunked, "response_logprobs_all", lambda *a, **k: calls.append(1) or real(*a, **k))
        logp, _, _ = run(model, ids, mask, valid, chunk=4, temperature=0.7, entropy="none")
        assert calls == [1]
        torch.testing.assert_close(logp, expected, atol=1e-5, rtol=0)
        assert (logp[~valid] == 0).all()
    finally:
        handle.remove()
    assert chunked_head(model) is not None
    model.config.final_logit_softcapping = 30.0  # logit post-processing it does not implement
    try:
        assert chunked_head(model) is None
    finally:
        del model.config.final_logit_softcapping


def test_the_trainer_uses_the_chunked_path(tiny_model_cfg, make_batch, monkeypatch):
    """Training, old log-prob recomputation and the reference (micro_batched_logprobs) never build [B, T, V]."""
    monkeypatch.setattr(chunked, "response_logprobs_all", lambda *a, **k: pytest.fail("unchunked path used"))
    from relax.algorithms import GRPOConfig

    p = TorchPolicy(tiny_model_cfg, TrainConfig(lr=1e-3, clip_grad=0.0, num_rollout=10), vocab_size=32,
                    pad_token_id=0, seed=0, device="cpu", temperature=0.8)
    batch = make_batch(n=6, P=5, T=4, seed=2)
    old = p.compute_logprobs(batch, micro_batch_size=4)
    out = p.train_step(batch.with_(old_logp=old), GRPOConfig(entropy_coef=0.01), per_token=True, micro_batch_size=4)
    assert out["train/skipped_steps"] == 0 and "train/entropy" in out
