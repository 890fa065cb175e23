"""The merged weights a LoRA run sends its engines (`relax.models.lora.rollout_state(merged=True)`, the default
`rollout.lora_sync=merged`) are the merged model's state dict, names and values, on a dense model and on a
mixture-of-experts one, where PEFT's `all-linear` also adapts each router and the experts' stacked 3-D parameters
(the experts through two nested ParamWrappers). Checked against PEFT's own `merge_and_unload` on a copy of the model
(what `relax-export --merge` writes), against the adapted model's own forward, and through an engine's strict
`load_weights` (which refused the MoE's merged weights before, at the first weight sync of a run)."""

from __future__ import annotations

import copy

import pytest
import torch

from relax.algorithms.grpo import GRPOConfig
from relax.batch import TrainBatch
from relax.config.schema import ModelConfig, TrainConfig
from relax.models import lora
from relax.models.hf import build_model
from relax.rollout.embedded import EmbeddedEngine
from relax.train.torch_policy import TorchPolicy

V, PAD = 64, 0
DENSE = ModelConfig(dtype="float32", lora_rank=4, lora_alpha=8.0)
MOE = ModelConfig(arch="qwen3_moe", dtype="float32", lora_rank=4, lora_alpha=8.0)  # 2 layers, 4 experts, top-2
CFGS = {"dense": DENSE, "moe": MOE}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def adapted(cfg: ModelConfig, seed: int = 0):
    """The model with adapters whose A and B are all random (not B = 0, so every delta is nonzero)."""
    peft_model = lora.apply_lora(build_model(cfg, V, PAD, seed=seed, dtype=torch.float32), cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for t in lora.adapter_params(peft_model).values():
            t.copy_(torch.randn(t.shape, generator=g) * 0.05)
    return peft_model


def expected_adapted_names(cfg: ModelConfig) -> set[str]:
    """By hand: the weights `all-linear` changes (the attention projections; the MLP's three projections on a dense
    model; on an MoE one the router's weight and the experts' stacked gate_up_proj and down_proj)."""
    mlp = (["mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if cfg.arch == "qwen3_moe"
           else [f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")])
    attn = [f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    return {f"model.layers.{i}.{n}" for i in range(cfg.num_layers) for n in attn + mlp}


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_merged_weights_are_peft_merge_and_unload(arch):
    cfg = CFGS[arch]
    peft_model = adapted(cfg)
    state = lora.rollout_state(peft_model, merged=True)
    reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    assert set(state) == set(reference)
    assert set(state) == set(build_model(cfg, V, PAD, seed=0).state_dict())  # the plain model's names
    for k, v in reference.items():
        assert state[k].dtype == v.dtype and torch.equal(state[k], v), k
    base = build_model(cfg, V, PAD, seed=0, dtype=torch.float32).state_dict()
    changed = {k for k in base if not torch.equal(base[k], state[k])}
    assert changed == expected_adapted_names(cfg)


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_the_merged_model_computes_the_adapted_models_logits(arch):
    """Independent of PEFT's merge code: the plain model loaded with the merged weights gives the logits of the
    adapted model's own forward (its adapters on), and the base's differ."""
    cfg = CFGS[arch]
    peft_model = adapted(cfg)
    ids = torch.tensor([[3, 9, 17, 25, 40, 41, 2, 60]])
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        plain = build_model(cfg, V, PAD, seed=0, dtype=torch.float32)
        base_logits = plain(input_ids=ids).logits
        plain.load_state_dict(lora.rollout_state(peft_model, merged=True), strict=True)
        got = plain(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    assert float((base_logits - want).abs().max()) > 1e-2  # negative control: the adapters do change the logits


def test_lora_on_moe_syncs_merged_weights_to_an_engine():
    """The run that crashed: LoRA (all-linear) on tiny_moe, lora_sync=merged. After training, the engine takes the
    merged weights (strict names) and samples with the trainer's log-probs; an engine left at the base does not."""
    p = TorchPolicy(MOE, TrainConfig(lr=2e-2, clip_grad=0.0), vocab_size=V, pad_token_id=PAD, seed=3, device="cpu",
                    num_threads=1, lora_sync="merged")
    eng = EmbeddedEngine(build_model(MOE, V, PAD, seed=3, dtype=torch.float32), eos_token_ids=[], pad_token_id=PAD,
                         device="cpu")
    for step in range(2):
        samples = eng.generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=6, seed=step)
        g = torch.Generator().manual_seed(step)
        adv = torch.randn(len(samples), 1, generator=g).expand_as(samples.response_mask) * samples.response_mask
        p.train_step(TrainBatch.from_samples(samples, advantages=adv), GRPOConfig(), per_token=True,
                     micro_batch_size=3)
        eng.load_weights(p.state_dict_for_rollout(), step + 1)
    samples = eng.generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=6, seed=9)
    mask = samples.response_mask.bool()
    trainer = p.compute_logprobs(samples, 8)
    assert float((trainer[mask] - samples.rollout_logp[mask]).abs().max()) < 1e-4
    stale = EmbeddedEngine(build_model(MOE, V, PAD, seed=3, dtype=torch.float32), eos_token_ids=[],
                           pad_token_id=PAD, device="cpu").generate(PROMPTS, n_samples_per_prompt=2,
                                                                     max_new_tokens=6, seed=9)
    m = stale.response_mask.bool()
    assert float((p.compute_logprobs(stale, 8)[m] - stale.rollout_logp[m]).abs().max()) > 1e-2


def test_an_unmergeable_lora_layer_is_refused_by_name():
    """A LoRA layer kind whose merge is not known here (an embedding's) is a ValueError naming it and the way out,
    not a silently unmerged weight."""
    from peft import LoraConfig, get_peft_model

    model = build_model(DENSE, V, PAD, seed=0, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"]))
    with pytest.raises(ValueError, match=r"embed_tokens.*lora_target_modules"):
        lora.rollout_state(peft_model, merged=True)
    assert set(lora.rollout_state(peft_model, merged=False))  # the adapters alone still go out


def test_all_linear_wraps_moe_routers_and_experts_as_documented():
    """What docs/training.md says `all-linear` adapts on an MoE model: the router and the experts' stacked parameters
    (gate_up_proj at rank 2r with alpha 2 alpha, so the same scale), at rank r per expert."""
    peft_model = adapted(MOE)
    params = {k: tuple(v.shape) for k, v in lora.adapter_params(peft_model).items()}
    pre = "base_model.model.model.layers.0.mlp."
    E, r, H, inter = MOE.num_experts, 4, MOE.hidden_size, MOE.moe_intermediate_size
    assert params[pre + "gate.lora_A.default.weight"] == (r, H)
    assert params[pre + "experts.base_layer.lora_A.default.weight"] == (2 * r * E, H)  # gate_up_proj
    assert params[pre + "experts.lora_A.default.weight"] == (r * E, inter)  # down_proj


def test_an_adapter_on_a_tied_output_head_is_not_merged(tmp_path):
    """The tiny model's output head is its input embedding (tied). PEFT trains an adapter on the head alone; merged
    into the shared weight it changes the embeddings too, so the merged model is not the adapted one (checked here on
    PEFT's own merge_and_unload, by the logits). The engines' merged weights and relax-export --merge refuse such an
    adapter, naming the layer and the tie; the adapter export still writes it. Control: without the head, both merge
    and PEFT's merged model computes the adapted model's logits."""
    import dataclasses
    import json

    from relax.train.export import ExportError, _write_lora

    ids = torch.tensor([[3, 9, 17, 25, 40, 41, 2, 60]])
    for targets, tied in ((["q_proj", "lm_head"], True), (["q_proj"], False)):
        cfg = dataclasses.replace(DENSE, lora_target_modules=targets)
        peft_model = adapted(cfg)
        with torch.no_grad():
            want = peft_model(input_ids=ids).logits
            merged = copy.deepcopy(peft_model).merge_and_unload()
            off = float((merged(input_ids=ids).logits - want).abs().max())
        policy, out = tmp_path / f"policy-{tied}", tmp_path / f"out-{tied}"
        peft_model.save_pretrained(str(policy))
        (policy / lora.BASE_FILE).write_text(json.dumps({"fingerprint": lora.base_fingerprint(peft_model)}))
        out.mkdir()
        tokenizer = type("Tok", (), {"pad_token_id": PAD, "__len__": lambda self: V})()
        if tied:
            assert off > 1e-2  # PEFT's merge is not the adapted model
            with pytest.raises(ValueError, match=r"lm_head cannot be merged: its weight is also "
                                                 r"\['model.embed_tokens.weight'.*tied embeddings"):
                lora.rollout_state(peft_model, merged=True)
            with pytest.raises(ExportError, match=r"--merge: LoRA layer lm_head cannot be merged.*without --merge"):
                _write_lora(policy, out, cfg, tokenizer, merge=True, seed=0)
            _write_lora(policy, out, cfg, tokenizer, merge=False, seed=0)  # the adapter export
            assert (out / lora.ADAPTER_WEIGHTS).is_file()
        else:
            assert off < 2e-5
            lora.rollout_state(peft_model, merged=True)
            _write_lora(policy, out, cfg, tokenizer, merge=True, seed=0)
            assert (out / "config.json").is_file()


def test_moe_adapters_load_in_peft_at_the_fused_experts_rank(tmp_path):
    """PEFT adapts the fused gate_up_proj at rank 2r through a rank_pattern it writes itself. PEFT 0.21 then warns,
    when it loads the saved directory, that the pattern matched no targeted module (its check looked at modules, not
    parameters; 0.22 no longer warns); Relax's own injection shows no such warning. The pattern is applied all the
    same: the loaded adapters have rank 2r per expert and give the adapted model's logits."""
    import warnings

    from peft import PeftModel

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        peft_model = adapted(MOE)
    assert not [w for w in seen if "rank_pattern" in str(w.message) or "alpha_pattern" in str(w.message)]
    peft_model.save_pretrained(str(tmp_path))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loaded = PeftModel.from_pretrained(build_model(MOE, V, PAD, seed=0), str(tmp_path)).eval()
    patterns = [str(w.message) for w in seen if "rank_pattern" in str(w.message)]
    assert all("gate_up_proj" in m for m in patterns), patterns  # PEFT 0.21's false warning, about this one key
    E, r, H = MOE.num_experts, 4, MOE.hidden_size
    a = dict(loaded.named_parameters())["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.default.weight"]
    assert tuple(a.shape) == (2 * r * E, H)
    ids = torch.tensor([[3, 9, 17, 25, 40, 41, 2, 60]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, peft_model.eval()(input_ids=ids).logits,
                                   atol=1e-5, rtol=0)
